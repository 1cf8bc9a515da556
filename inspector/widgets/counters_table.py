"""Launch counters per arm, A beside B: live from the decision records while a side runs, then
the engine's own counters (`Generation.counters`) once it finishes, with Triton kernel launches
where kernels ran. A table that claims an arm ran must show its counter advancing and the
others not. A Static holding a small rich Table: cheap to redraw on every batch."""

from __future__ import annotations

from collections import Counter

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from engine.arms import Counters
from engine.dispatch import GROUPED
from inspector.events import A, B

SIDES = (A, B)


def arm_names() -> list[str]:
    return list(Counters().to_json()["arms"])


def executed_label(op: str, record: dict) -> str:
    """The counter a record bumps (the engine counts grouped per variant)."""
    if op == "moe" and record["executed_arm"] == GROUPED:
        return f"grouped_v{record['variant']}"
    return record["executed_arm"]


class CountersTable(Static):
    def __init__(self, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.arms = arm_names()
        self.counts: dict[str, Counter] = {side: Counter() for side in SIDES}
        self.kernels: dict[str, dict] = {side: {} for side in SIDES}
        self.final: dict[str, bool] = {side: False for side in SIDES}
        self.border_title = "launch counters"
        self.compact = False

    def on_mount(self) -> None:
        self._show()

    def reset(self) -> None:
        self.counts = {side: Counter() for side in SIDES}
        self.kernels = {side: {} for side in SIDES}
        self.final = {side: False for side in SIDES}
        self._show()

    def add_steps(self, side: str, steps: list[dict]) -> None:
        for step in steps:
            for op in ("moe", "attention"):
                self.counts[side].update(executed_label(op, record) for record in step[op])
        self._show()

    def set_final(self, side: str, counters: dict) -> None:
        self.counts[side] = Counter(counters["arms"])
        self.kernels[side] = dict(counters.get("kernels", {}))
        self.final[side] = True
        self._show()

    def count(self, side: str, arm: str) -> int:
        return self.counts[side][arm]

    def set_compact(self, compact: bool) -> None:
        """Compact: one line per side with the arms that ran (a narrow screen); else the table."""
        if compact != self.compact:
            self.compact = compact
            self.set_class(compact, "-compact")
            self._show()

    def _compact_text(self) -> Text:
        text = Text()
        for index, side in enumerate(SIDES):
            ran = [(name, count) for name, count in self.counts[side].items() if count]
            text.append(f"{side}{'' if self.final[side] else '*'}: ", style="bold")
            text.append(", ".join(f"{name} {count}" for name, count in ran) or "nothing ran", style="" if ran else "dim")
            kernels = sum(self.kernels[side].values())
            if kernels:
                text.append(f", ⚙ {kernels} Triton launches")
            if index == 0:
                text.append("\n")
        return text

    def _show(self) -> None:
        if self.compact:
            self.update(self._compact_text())
            self.border_subtitle = ""
            return
        table = Table(box=None, padding=(0, 1), expand=True, show_edge=False)
        table.add_column("arm", no_wrap=True)
        for side in SIDES:
            table.add_column(side + ("" if self.final[side] else "*"), justify="right", no_wrap=True)
        # arms only some models run (trellis experts' arms) join the fixed list once one of them counts
        extra = sorted(name for side in SIDES for name in self.counts[side] if name not in self.arms)
        for name in self.arms + list(dict.fromkeys(extra)):
            values = [self.counts[side][name] for side in SIDES]
            table.add_row(name, *map(str, values), style="" if any(values) else "dim")
        for kernel in sorted(set(self.kernels[A]) | set(self.kernels[B])):
            table.add_row(f"⚙ {kernel}", *(str(self.kernels[side].get(kernel, 0)) for side in SIDES))
        self.update(table)
        self.border_subtitle = "* live from records" if not all(self.final.values()) else "engine counters"
