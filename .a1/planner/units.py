"""Quantities written as people write them: `8 GiB`, `448 GB/s`, `12.1 GB/s`, `82.6 TFLOPS`, `10 us`.

Every parser returns plain SI numbers (bytes, bytes per second, FLOP per second, seconds) and refuses a
bare number: a profile that says `vram: 8` is ambiguous, and ambiguity is how OOMs start.
"""

import re

from planner.errors import StratumError

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_RATE_UNITS = {f"{unit}/s": factor for unit, factor in _SIZE_UNITS.items()}
_FLOPS_UNITS = {"FLOPS": 1, "GFLOPS": 10**9, "TFLOPS": 10**12, "PFLOPS": 10**15}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}

_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")


def _parse(text, units: dict, what: str, example: str, source: str | None, field: str | None) -> float:
    expected = f"a {what} with a unit ({', '.join(units)}), e.g. '{example}'"
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise StratumError(f"expected {expected}, got {text!r}", source=source, field=field)
    if str(text).strip().startswith("-"):
        raise StratumError(f"{text!r} is negative; expected {expected}", source=source, field=field)
    match = _QUANTITY.match(str(text))
    if match is None:
        if isinstance(text, (int, float)) or re.fullmatch(r"\s*-?[0-9.eE+-]+\s*", str(text)):
            raise StratumError(f"{text!r} has no unit; expected {expected}", source=source, field=field)
        raise StratumError(f"expected {expected}, got {text!r}", source=source, field=field)
    number, unit = match.groups()
    if unit not in units:
        raise StratumError(f"unknown unit {unit!r} in {text!r}; expected {expected}", source=source, field=field)
    return float(number) * units[unit]


def parse_count(text, source=None, field=None) -> int:
    """`132` -> 132: a count of things (a GPU's SMs), a whole positive number without a unit."""
    if isinstance(text, bool) or not isinstance(text, int) or text <= 0:
        raise StratumError(f"expected a whole positive number, such as 132, got {text!r}", source=source, field=field)
    return text


def parse_bytes(text, source=None, field=None) -> int:
    """`8 GiB` -> 8589934592. Sizes must be whole bytes."""
    value = _parse(text, _SIZE_UNITS, "size", "8 GiB", source, field)
    if value != int(value):
        raise StratumError(f"{text!r} is not a whole number of bytes", source=source, field=field)
    return int(value)


def parse_rate(text, source=None, field=None) -> float:
    """`448 GB/s` -> 448e9 bytes per second."""
    return _parse(text, _RATE_UNITS, "bandwidth", "448 GB/s", source, field)


def parse_flops(text, source=None, field=None) -> float:
    """`82.6 TFLOPS` -> 82.6e12 FLOP per second."""
    return _parse(text, _FLOPS_UNITS, "throughput", "82.6 TFLOPS", source, field)


def parse_seconds(text, source=None, field=None) -> float:
    """`10 us` -> 1e-5 seconds."""
    return _parse(text, _TIME_UNITS, "duration", "10 us", source, field)


def format_bytes(n_bytes: int) -> str:
    """Binary units, three significant digits: 8589934592 -> '8.00 GiB'."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s"
