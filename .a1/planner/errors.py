"""The project's one error type: every refusal of bad input is a StratumError.

The CLI prints it as one line (no traceback) and exits with code 2, so its message must name the
file and the field at fault and say what was expected.
"""


class StratumError(Exception):
    """Bad input or an impossible request, worded for the user."""

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        parts = [p for p in (source, field) if p]
        super().__init__(": ".join(parts + [message]))


class DoesNotFit(StratumError):
    """The model cannot be laid out on the hardware: says by how much and which region is the floor."""
