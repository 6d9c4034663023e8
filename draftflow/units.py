"""How numbers read in messages, tables and reports: decimal bytes, short durations."""

import argparse
import re

SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def fmt_bytes(n: float) -> str:
    """Decimal units, as df -H and the plan's messages."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 1000 or unit == "TB":
            break
    return f"{n:.2f} {unit}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 60:
        return f"{seconds:.2g}s" if seconds < 10 else f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500G``, ``1.5TB`` (decimal) or ``2TiB`` (binary)."""
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 123456, 500G, 1.5TB, 2TiB)")
    number, prefix, binary = match.groups()
    base = 1024 if binary else 1000
    return round(float(number) * base ** "_kmgtp".index(prefix.lower() or "_"))


def size_argument(text: str) -> int:
    """``parse_size`` for a command's option: its message, not argparse's own."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
