"""Plain-text tables for the CLI: left-aligned columns two spaces apart."""
from __future__ import annotations

from typing import Sequence


def print_table(header: Sequence[str], rows: list[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
