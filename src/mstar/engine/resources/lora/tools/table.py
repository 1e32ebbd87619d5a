"""Plain-text tables for the command line and the demo, fitted to the terminal."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence

GAP = "  "
NARROWEST = 8  # a column is never squeezed below this (or its header)
TERMINAL = -1  # table's default width: terminal_width()


def size(n: int) -> str:
    """A byte count in decimal units, as disks and downloads count them."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def terminal_width() -> int | None:
    """The width tables fit: $COLUMNS, else the terminal's; None where output goes to a file or a pipe,
    where a row stays one line for grep."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def table(rows: list[dict], columns: Sequence[str], width: int | None = TERMINAL) -> str:
    """rows as aligned text columns, a header line first; a missing value is blank. Where the table is
    wider than width (default: terminal_width()), the widest columns narrow and their cells wrap."""
    width = terminal_width() if width == TERMINAL else width
    cells = [[str(r.get(c, "")) for c in columns] for r in [dict(zip(columns, columns, strict=True)), *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    if width is not None:
        widths = _fit(widths, [min(w, max(len(c), NARROWEST)) for w, c in zip(widths, columns, strict=True)],
                      width - len(GAP) * (len(columns) - 1))
    return "\n".join(line for row in cells for line in _lines(row, widths))


def _fit(widths: list[int], floors: list[int], budget: int) -> list[int]:
    """widths narrowed, the widest first and none below its floor, until they sum to budget or no
    further."""
    widths = list(widths)
    while sum(widths) > budget:
        i = max(range(len(widths)), key=lambda j: (widths[j] - floors[j] > 0, widths[j]))
        if widths[i] <= floors[i]:
            break
        widths[i] -= 1
    return widths


def _lines(row: list[str], widths: list[int]) -> list[str]:
    """One row as lines: a cell longer than its column wraps onto the next."""
    wrapped = [_wrap(cell, w) for cell, w in zip(row, widths, strict=True)]
    height = max(map(len, wrapped))
    return [GAP.join((part[k] if k < len(part) else "").ljust(w) for part, w in zip(wrapped, widths, strict=True))
            .rstrip() for k in range(height)]


def _wrap(text: str, width: int) -> list[str]:
    """text in lines of at most width, broken after a space, a comma or a slash where it can be (a list of
    targets, a path), else cut."""
    lines, line = [], ""
    for token in re.split(r"(?<=[ ,/])", " ".join(text.split())):
        if line and len(line + token.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += token
        while len(line.rstrip()) > width:
            lines.append(line[:width])
            line = line[width:]
    return [*lines, line.rstrip()] if line.strip() or not lines else lines
