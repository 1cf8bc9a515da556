"""One line that says what configuration B is: A's flags with a few overrides (edited in a modal)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from engine.flags import format_value

DEFAULT_B_OVERRIDES: dict[str, Any] = {"flash_512": False, "moe_gate": "reference"}  # every layer on its reference arm


def describe_overrides(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{name}={format_value(name, value)}" for name, value in overrides.items()) or "no overrides"


class ConfigBRow(Static):
    def __init__(self, overrides: dict[str, Any], id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.overrides = dict(overrides)

    def on_mount(self) -> None:
        self.set_overrides(self.overrides)

    def set_overrides(self, overrides: dict[str, Any]) -> None:
        self.overrides = dict(overrides)
        line = Text()
        line.append("B", style="bold")
        line.append(" = A's flags with ")
        line.append(describe_overrides(self.overrides), style="bold")
        line.append("   (f4: edit B)", style="dim")
        self.update(line)
