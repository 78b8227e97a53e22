"""A progress line on stderr for long start-up work (weights loading, kernels compiling): one line redrawn
in place on a terminal; otherwise (logs stay readable) a line as a phase starts and one as it ends, so a log
cut off mid-phase still says which phase it was in."""

import sys
import time


class Progress:
    def __init__(self, enabled: bool = True, stream=None):
        self.enabled, self.stream = enabled, stream or sys.stderr
        self.label, self.total, self.done, self.unit, self.started = "", 0, 0, "", 0.0
        self._last_draw = 0.0

    def start(self, label: str, total: float, unit: str = "") -> None:
        self.label, self.total, self.done, self.unit = label, total, 0, unit
        self.started = time.perf_counter()
        if self.enabled and not self.stream.isatty():
            self.stream.write(f"{label} ...\n")
            self.stream.flush()
        self._draw(force=True)

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        self._draw()

    def finish(self, note: str = "") -> None:
        if not self.enabled:
            return
        seconds = time.perf_counter() - self.started
        redraw = "\r" if self.stream.isatty() else ""
        self.stream.write(f"{redraw}{self.label}: done in {seconds:.1f} s{f' ({note})' if note else ''}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """One line of its own (what the engine tells about a request, e.g. the drafter room's use)."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled or not self.stream.isatty():
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        fraction = self.done / self.total if self.total else 1.0
        bar = "#" * int(30 * fraction)
        self.stream.write(f"\r{self.label}: [{bar:<30}] {fraction:4.0%} {_amount(self.done, self.unit)}"
                          f" / {_amount(self.total, self.unit)}")
        self.stream.flush()


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 2 ** 30:.2f} GiB"
    return f"{value:g}{unit}"
