"""Plain-text tables for the command line and the demo."""

from __future__ import annotations

from collections.abc import Sequence


def size(n: int) -> str:
    """A byte count in decimal units, as disks and downloads count them."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def table(rows: list[dict], columns: Sequence[str]) -> str:
    """rows as aligned text columns, a header line first; a missing value is blank."""
    widths = [max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)) for r in rows]
    return "\n".join(lines)
