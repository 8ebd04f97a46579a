"""Sizes, bandwidths and latencies written with units: `80GiB`, `300GB/s`, `2us`.

A bare number is bytes, bytes per second, or seconds. Decimal prefixes are powers of
1000 (`GB`), binary ones powers of 1024 (`GiB`); `bit` units are eighths of a byte
(`100Gbit/s` is 12.5e9 bytes per second).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from pipelang.readers import MAX_BYTES, ReadError, number

_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)"


class UnitError(ReadError):
    """A value whose number or unit cannot be read; the message says what is expected."""


MAX_BANDWIDTH = 1e15
"""The fastest link read, in bytes per second (1 PB/s)."""
MAX_LATENCY = 1e3
"""The slowest link's latency read, in seconds."""
SPEEDS = (1e-3, 1e3)
"""The range of a device's speed relative to the profiled one."""


def _within(value: float, text: object, what: str, least: float, most: float) -> float:
    try:
        return number(value, what, least, most)
    except ReadError:
        raise UnitError(f"{what} is between {least:g} and {most:g}, not `{text}`") from None


def _scale(unit: str) -> float | None:
    """Bytes per one `unit` (`GiB`, `MB`, `Gbit`, `B`), or None for an unknown unit."""
    for suffix, per in (("B", 1.0), ("bit", 0.125), ("b", 0.125)):
        if unit.endswith(suffix):
            prefix = unit[: -len(suffix)]
            if prefix in _BINARY:
                return _BINARY[prefix] * per
            if prefix.upper() in _PREFIX and len(prefix) <= 1:
                return _PREFIX[prefix.upper()] * per
    return None


def parse_bytes(text: object) -> float:
    """`80GiB`, `512MB`, `1e9` (bytes)."""
    value, unit = _split(text, "a size such as 80GiB, 512MB or 1000000 (bytes)")
    if unit:
        per = _scale(unit)
        if per is None:
            raise UnitError(
                f"unknown size unit `{unit}` in `{text}`; use B, KB, MB, GB, KiB, MiB, GiB"
            )
        value *= per
    return _within(value, text, "a size", 0, MAX_BYTES)


def parse_bandwidth(text: object) -> float:
    """`300GB/s`, `100Gbit/s`, `25e9` (bytes per second); must be positive."""
    expected = "a bandwidth such as 300GB/s, 100Gbit/s or 25e9 (bytes per second)"
    value, unit = _split(text, expected)
    if unit:
        if not unit.endswith("/s"):
            raise UnitError(f"a bandwidth needs `/s`: `{text}`; expected {expected}")
        per = _scale(unit[:-2])
        if per is None:
            raise UnitError(f"unknown bandwidth unit `{unit}` in `{text}`; expected {expected}")
        value *= per
    if value <= 0:
        raise UnitError(f"a bandwidth must be positive, not `{text}`")
    return _within(value, text, "a bandwidth (bytes per second)", 0, MAX_BANDWIDTH)


def parse_seconds(text: object) -> float:
    """`2us`, `1.5ms`, `0.00001` (seconds)."""
    value, unit = _split(text, "a latency such as 2us, 1.5ms or 0.00001 (seconds)")
    if unit and unit not in _PER_SECOND:
        raise UnitError(f"unknown time unit `{unit}` in `{text}`; use s, ms, us or ns")
    return _within(value / _PER_SECOND.get(unit, 1.0), text, "a latency (s)", 0, MAX_LATENCY)


def _split(text: object, expected: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise UnitError(f"expected {expected}, not `{text}`")
    text = str(text).strip()
    match = re.fullmatch(_NUMBER + r"\s*(\S*)", text) if len(text) <= 100 else None
    if match is None:
        raise UnitError(f"cannot read `{text}`: expected {expected}")
    return float(match.group(1)), match.group(2)


def parse_speed(text: object) -> float:
    """`2`, `0.5`: a device's speed relative to the profiled device (1), more than 0."""
    value, unit = _split(text, "a relative speed such as 1 or 0.5 (the profiled device is 1)")
    if unit:
        raise UnitError(f"a speed has no unit (`{text}`): the profiled device is 1")
    return _within(value, text, "a speed", *SPEEDS)


def positive(parse: Callable[[object], float], what: str) -> Callable[[object], float]:
    """`parse`, refusing a value of 0 (a device without memory, a link without bandwidth)."""

    def checked(text: object) -> float:
        value = parse(text)
        if value <= 0:
            raise UnitError(f"{what} is more than 0, not `{text}`")
        return value

    return checked


def format_bytes(value: float) -> str:
    """`1.23 GiB`: the largest binary unit that keeps the number at least 1."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"
