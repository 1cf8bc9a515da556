"""Comma lists of NAME=VALUE items, split one way for every option and box that takes one.

`compare` and `ab`'s `--a`/`--b`, the TUI's configuration B box (flags: `flash_512=off,moe_gate=reference`)
and `--experts` (`trellis:K=2,code=hyb`) split here, so an empty item (a leading or trailing comma, two
commas in a row) is refused the same way everywhere, naming the item, instead of being dropped by one
option and not another. Blank text is the empty list (`--a ""`: no overrides). Knows nothing of what the
items mean: callers parse them (`engine.flags.parse_assignments`, `engine.trellis_job.parse_experts`).
"""

from __future__ import annotations

from typing import Any

from engine.errors import UserError
from engine.flags import parse_assignments
from engine.printable import printable


def split_items(text: str, where: str) -> list[str]:
    """`text`'s comma-separated items, each stripped; [] for blank text. UserError naming `where`, the text
    and the empty item's place for an item with nothing in it."""
    if not text.strip():
        return []
    items = [item.strip() for item in text.split(",")]
    for index, item in enumerate(items):
        if not item:
            place = ("before the first comma" if index == 0 else "after the last comma" if index == len(items) - 1
                     else f"between commas {index} and {index + 1}")
            raise UserError(f"{where} {printable(repr(text), 80)}: item {index + 1} of {len(items)} is empty "
                            f"(nothing {place}): remove the extra comma")
    return items


def parse_flag_list(text: str, where: str) -> dict[str, Any]:
    """`FLAG=VALUE,FLAG=VALUE` to validated flag values (`engine.flags.parse_assignments` on `split_items`)."""
    return parse_assignments(split_items(text, where), where)
