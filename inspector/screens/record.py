"""One dispatch-log row, whole: what the gate read, what it decided and why, what executed, and
the µs with how they were timed; then every key of the engine's record as it is.

Opened with Enter on a row of the dispatch log; ←/→ (or p/n) walk the shown rows, escape closes.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from inspector.describe import fill_text, shared_path_text, timing_method
from inspector.widgets.dispatch_log import LogEntry


def _value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _section(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None,
                  padding=(0, 1), expand=True)
    table.add_column(style="bold", no_wrap=True, min_width=24)
    table.add_column(overflow="fold")
    for name, value in rows:
        table.add_row(name, value if isinstance(value, Text) else _value(value))
    return table


def render_entry(entry: LogEntry, flags: dict[str, Any] | None, device_type: str) -> Group:
    """The whole decision of one record, in sections."""
    r, flags = entry.record, flags or {}
    family = "MoE" if entry.op == "moe" else "attention"
    executed = Text(r["executed_arm"])
    if r["executed_arm"] != r["decided_arm"]:
        executed.append(" (not the decided arm)", style="yellow")
    decision = [("configuration", entry.side), ("step", r["step"]), ("layer", f"{r['layer']} ({family})"),
                ("phase", r["phase"]), ("decided arm", r["decided_arm"])]
    if entry.op == "moe":
        decision.append(("variant", r.get("variant")))
    decision += [("executed arm", executed), ("why it executed there", r.get("execution_note") or "it is the decided arm")]
    if entry.op == "moe" and r.get("shared_path"):  # only layers with shared experts (DeepSeek, Qwen2-MoE)
        decision += [("shared experts", "folded into the routed arm's launches" if r["shared_path"] == "routed launches"
                      else f"{shared_path_text(r).removeprefix('shared ')}, after the arm"),
                     ("why that path", r.get("shared_reason") or "—")]
    if entry.op == "moe":
        observed = r.get("woken_observed")
        inputs = [("n tokens", r["n_tokens"]), ("k (experts per token)", r["k"]), ("E (routed experts)", r["experts"]),
                  ("TILE_M", r["tile_m"]), ("policy (moe_gate)", r["policy"]),
                  ("decode_floor", flags.get("decode_floor")), ("moe_max_tokens", flags.get("moe_max_tokens")),
                  ("grouped_variant", flags.get("grouped_variant")),
                  ("policy boundary", "none (the policy forces an arm)" if r.get("boundary") is None else
                   f"grouped from n = {r['boundary']}"),
                  ("woken experts", f"predicted {r['woken_predicted']}, observed {_value(observed)}"),
                  ("pairs per woken expert", f"predicted {r['pairs_per_woken']}, observed "
                                             f"{_value(r.get('pairs_per_woken_observed'))}"),
                  ("m-tile fill", f"{fill_text(r['pairs_per_woken'], r['tile_m'])} (fill {r['fill']}: pairs per woken "
                                  f"expert / TILE_M)")]
    else:
        mask = Text(r["applied_mask"], style="bold red" if entry.mask_dropped else "")
        inputs = [("n tokens", r["n_tokens"]), ("head_dim", r.get("head_dim")), ("flash_512", flags.get("flash_512")),
                  ("fused_mask", flags.get("fused_mask")), ("layer's mask", r["mask"]), ("mask applied", mask),
                  ("declined to the reference", r.get("declined"))]
    reason = Text(("declined: " if entry.op == "attention" and r.get("declined") else "") + r["reason"])
    timing = [("µs", "—" if r.get("us") is None else f"{r['us']:.1f}"), ("how it was timed", timing_method(r, device_type))]
    if r.get("graph"):
        timing.append(("graph", r["graph"]))
    raw = Text(json.dumps(r, indent=1, default=str, ensure_ascii=False), style="dim")
    return Group(_section("decision", decision), Text(""), _section("what the gate read", inputs), Text(""),
                 Text("reason", style="bold"), reason, Text(""), _section("timing", timing), Text(""),
                 Text("the record, every key", style="bold"), raw)


class RecordScreen(ModalScreen[None]):
    """`entries`: the log's shown rows; `index`: the one to show; `flags_of(side)`: that side's flags."""

    BINDINGS = [
        Binding("escape,q", "dismiss(None)", "Close"),
        Binding("left,p", "move(-1)", "Previous row"),
        Binding("right,n", "move(1)", "Next row"),
    ]

    def __init__(self, entries: list[LogEntry], index: int, flags_of: Callable[[str], dict | None],
                 device_type: str) -> None:
        super().__init__()
        self.entries, self.index, self.flags_of, self.device_type = entries, index, flags_of, device_type

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="record", classes="dialog"):
            yield Static("", id="record-body")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.show()

    def show(self) -> None:
        entry = self.entries[self.index]
        dialog = self.query_one("#record")
        dialog.border_title = f"dispatch log row {self.index + 1} of {len(self.entries)}"
        self.query_one("#record-body", Static).update(render_entry(entry, self.flags_of(entry.side), self.device_type))
        dialog.scroll_home(animate=False)

    def action_move(self, delta: int) -> None:
        index = min(max(self.index + delta, 0), len(self.entries) - 1)
        if index != self.index:
            self.index = index
            self.show()
