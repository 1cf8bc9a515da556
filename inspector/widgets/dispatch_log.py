"""The live dispatch log: one line per MoE layer and per attention layer of every step, A and B.

MoE lines: step, phase, n tokens, layer, decided→executed arm and variant, woken experts
predicted/observed, pairs per woken expert predicted/observed, m-tile fill, µs (when timed),
reason; a trellis-coded layer's reason starts with its format, bits per weight and the expert bytes
the step moved (the record's `bytes_moved`). Attention lines: decided→executed arm, the layer's mask → the mask applied, µs, reason
(a fused arm that declined says so). The full reason of the newest line of each kind is shown
under the log, since reasons are longer than a line.

A RichLog, not a DataTable: lines are rendered once when written, so a streaming run costs the
UI thread (and, through the GIL, the engine) almost nothing per frame. Filters (configuration,
layer, arm, phase) rewrite the log from the kept records. Follow mode keeps the newest line in
view; it stops when the user scrolls up and resumes at the bottom or with `resume_follow`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, ScrollableContainer, Vertical
from textual.reactive import reactive
from textual.widgets import RichLog, Select, Static

from engine.dispatch import MOE_ARMS
from inspector.events import A, B

ATTENTION_ARMS = ("fused", "unfused")
PHASES = ("prefill", "decode", "mixed")
# (title, width, align) — the reason follows, unpadded.
COLUMNS = (("", 1, "<"), ("step", 5, ">"), ("phase", 7, "<"), ("n", 5, ">"), ("L", 2, "<"),
           ("arm decided→executed", 22, "<"), ("woken p/o pairs/woken p/o fill | attn mask", 42, "<"),
           ("µs", 8, ">"))
ARM_STYLE = {"gemv": "cyan", "grouped": "magenta", "torch_grouped_mm": "blue", "reference": "yellow",
             "fused": "green", "unfused": "yellow"}


def _cell(value: str, width: int, align: str) -> str:
    value = value if len(value) <= width else value[: width - 1] + "…"
    return f"{value:{align}{width}}"


def header_text() -> Text:
    line = " ".join(_cell(title, width, align) for title, width, align in COLUMNS) + " reason"
    return Text(line, style="bold")


@dataclass(frozen=True)
class LogEntry:
    side: str
    op: str  # "moe" or "attention"
    record: dict

    def matches(self, side, layer, arm, phase) -> bool:
        record = self.record
        return ((side is None or self.side == side)
                and (layer is None or record["layer"] == layer)
                and (arm is None or arm in (record["decided_arm"], record["executed_arm"]))
                and (phase is None or record["phase"] == phase))

    def arm_text(self) -> str:
        r = self.record
        decided = r["decided_arm"] + (f" v{r['variant']}" if self.op == "moe" and r["variant"] is not None else "")
        return decided if r["decided_arm"] == r["executed_arm"] else f"{decided}→{r['executed_arm']}"

    def detail_text(self) -> str:
        r = self.record
        if self.op == "moe":
            observed = r.get("woken_observed")
            pairs_observed = r.get("pairs_per_woken_observed")
            return (f"{r['woken_predicted']:.1f}/{'-' if observed is None else observed}".ljust(10)
                    + f"{r['pairs_per_woken']:.2f}/{'-' if pairs_observed is None else f'{pairs_observed:.2f}'}".ljust(17)
                    + f"{100 * r['fill']:.1f}%")
        return "mask " + (r["mask"] if r["mask"] == r["applied_mask"] else f"{r['mask']} → {r['applied_mask']}")

    def weights_text(self) -> str:
        """Trellis layers only (bf16 lines are unchanged): the format, bits per weight, expert bytes moved."""
        r = self.record
        if self.op != "moe" or not str(r.get("weight_format", "")).startswith("trellis"):
            return ""
        moved = "" if r.get("bytes_moved") is None else f", {r['bytes_moved'] / 1e6:.3g} MB"
        return f"[{r['weight_format']}, {r['bits_per_weight']:.2f} b/w{moved}] "

    def reason(self) -> str:
        r = self.record
        reason = self.weights_text() + ("declined: " if self.op == "attention" and r["declined"] else "") + r["reason"]
        return reason + (f" [{r['execution_note']}]" if r.get("execution_note") else "")

    def line(self) -> Text:
        r = self.record
        us = "" if r.get("us") is None else f"{r['us']:.1f}"
        cells = (self.side, str(r["step"]), r["phase"], str(r["n_tokens"]), str(r["layer"]), self.arm_text(),
                 self.detail_text(), us)
        text = Text()
        for (title, width, align), value in zip(COLUMNS, cells):
            style = ARM_STYLE.get(r["executed_arm"], "") if title.startswith("arm") else ""
            if self.op == "attention" and r["mask"] != r["applied_mask"] and title.startswith("woken"):
                style = "bold red"  # the mask was dropped: the incident
            text.append(_cell(value, width, align), style=style)
            text.append(" ")
        text.append(self.weights_text() + (r["reason"] if not r.get("declined") else f"declined: {r['reason']}"),
                    style="dim")
        return text


def entries_of(side: str, steps: list[dict]) -> list[LogEntry]:
    entries = []
    for step in steps:
        entries.extend(LogEntry(side, "moe", record) for record in step["moe"])
        entries.extend(LogEntry(side, "attention", record) for record in step["attention"])
    return entries


class DispatchLog(Vertical):
    """Filters, a header, the log lines, and the newest full reasons."""

    follow: reactive[bool] = reactive(True)

    def __init__(self, n_layers: int, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.n_layers = n_layers
        self.entries: list[LogEntry] = []
        self.shown = 0  # lines in the log now (entries passing the filters)
        self.filters: dict[str, object] = {"side": None, "layer": None, "arm": None, "phase": None}
        self._rewriting = False  # scrolls the log makes itself never switch follow mode
        self.border_title = "dispatch log"

    def compose(self) -> ComposeResult:
        with Horizontal(id="log-filters"):
            yield Select([(f"cfg {side}", side) for side in (A, B)], prompt="cfg: all", compact=True,
                         id="filter-side")
            yield Select([(f"layer {layer}", layer) for layer in range(self.n_layers)], prompt="layer: all",
                         compact=True, id="filter-layer")
            yield Select([(arm, arm) for arm in MOE_ARMS + ATTENTION_ARMS], prompt="arm: all", compact=True,
                         id="filter-arm")
            yield Select([(phase, phase) for phase in PHASES], prompt="phase: all", compact=True, id="filter-phase")
        with ScrollableContainer(id="log-header-scroll"):
            yield Static(header_text(), id="log-header")
        yield RichLog(id="log-lines", wrap=False, markup=False, highlight=False, auto_scroll=True)
        yield Static("", id="log-why")

    def on_mount(self) -> None:
        self.watch(self.lines, "scroll_y", self._scrolled, init=False)
        self.watch(self.lines, "scroll_x", self._scrolled_sideways, init=False)
        self._show_follow()

    @property
    def lines(self) -> RichLog:
        return self.query_one("#log-lines", RichLog)

    # -- data ------------------------------------------------------------------------------------

    def clear(self) -> None:
        self.entries, self.shown = [], 0
        self._rewriting = True
        self.lines.clear()
        self._rewriting = False
        self.follow = True
        self.query_one("#log-why", Static).update("")

    def add_steps(self, side: str, steps: list[dict]) -> None:
        new = entries_of(side, steps)
        self.entries.extend(new)
        self._write([entry for entry in new if entry.matches(**self.filters)])

    def _write(self, entries: list[LogEntry]) -> None:
        if entries:  # one write per batch: the log renders the batch's lines in one go
            self.lines.write(Text("\n").join(entry.line() for entry in entries), scroll_end=self.follow)
        self.shown += len(entries)
        self._show_why()

    def _show_why(self) -> None:
        shown = [entry for entry in reversed(self.entries[-64:]) if entry.matches(**self.filters)]
        newest = {}
        for entry in shown:
            newest.setdefault(entry.op, entry)
        why = Text()
        for op in ("moe", "attention"):
            entry = newest.get(op)
            if entry is None:
                continue
            r = entry.record
            why.append(f"why {'MoE' if op == 'moe' else 'attn'} ({entry.side} step {r['step']} L{r['layer']}): ",
                       style="bold")
            why.append(entry.reason() + "\n")
        why.rstrip()
        self.query_one("#log-why", Static).update(why)

    def _rewrite(self) -> None:
        self._rewriting = True
        self.lines.clear()
        self.shown = 0
        self._rewriting = False
        self.follow = True
        self._write([entry for entry in self.entries if entry.matches(**self.filters)])

    # -- filters -----------------------------------------------------------------------------------

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        key = event.select.id.removeprefix("filter-")
        value = None if event.value == Select.NULL else event.value
        if self.filters[key] != value:
            self.filters[key] = value
            self._rewrite()

    def clear_filters(self) -> None:
        for key in self.filters:
            self.query_one(f"#filter-{key}", Select).clear()

    # -- follow mode -------------------------------------------------------------------------------

    def _scrolled(self, old: float, new: float) -> None:
        if self._rewriting:
            return
        if new >= self.lines.max_scroll_y - 1:
            self.follow = True
        elif new < old:
            self.follow = False

    def _scrolled_sideways(self, old: float, new: float) -> None:
        self.query_one("#log-header-scroll").scroll_to(x=new, animate=False, immediate=True)

    def resume_follow(self) -> None:
        self.follow = True
        self.lines.scroll_end(animate=False, x_axis=False)

    def watch_follow(self, follow: bool) -> None:
        if self.is_mounted:
            self.lines.auto_scroll = follow
        self._show_follow()

    def _show_follow(self) -> None:
        self.border_subtitle = ("following newest lines · ←/→ scroll" if self.follow
                                else "paused: scrolled up · f5 or end of log resumes")
