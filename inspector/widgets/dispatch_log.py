"""The live dispatch log: one row per MoE layer and per attention layer of every step, A and B.

Columns: configuration, step, layer (these three stay put when the table scrolls sideways),
phase, n tokens, decided→executed arm and variant, woken experts predicted/observed, pairs per
woken expert predicted/observed, m-tile fill, the attention mask (→ the mask applied, when it
differs; latent attention adds its cache bytes per token against the decompressed cache's), µs,
and the whole reason (a trellis-coded layer's starts with its format, bits per weight and the
expert bytes the step moved, the record's `bytes_moved`; a layer with shared experts adds their path to
the arm, "+ shared folded" or "+ shared apart", and the why to the reason). The header stays on top
and over its columns. The line under the table gives the full reason of the row under the cursor (the newest while
following), wrapped: it grows to the rows the longest reason shown so far needs (up to WHY_ROWS, so moving the cursor
does not make the table jump), and a reason longer still ends in "…"; on a short screen it is one row that
ends in an ellipsis. Enter opens the row's whole decision (`RecordScreen`).

A DataTable, fed in batches (one `add_rows` per drained batch), so a streaming run costs the UI
thread one call per batch. Filters (configuration, layer, arm, phase) rebuild the rows from the
kept records. Follow mode keeps the newest row in view; moving up or scrolling up stops it, the
end of the table or `resume_follow` (f5) resumes it. `find` (ctrl+f) searches every column of
the shown rows, `go_to_step` (ctrl+g) jumps to a step; both through the bar under the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import DataTable, Input, Select, Static

from engine.dispatch import MOE_ARMS
from inspector.describe import fill_text, shared_path_text, shared_reason_text
from inspector.events import A, B

ATTENTION_ARMS = ("fused", "unfused", "mla_fused", "mla_reference")
PHASES = ("prefill", "decode", "mixed")
COLUMNS = ("cfg", "step", "L", "phase", "n", "arm decided→executed", "woken p/o", "pairs/woken p/o", "fill",
           "mask → applied", "µs", "reason")
FIXED_COLUMNS = 3  # cfg, step, layer: where a row is, kept in view when the table scrolls sideways
WHY_ROWS = 6  # the most rows the reason line takes from the table (a MoE reason with its notes: ~3 at 200 columns)
WHY_WORDS = "enter: the whole decision"  # the hint after a reason: "  · " after a whole one, "… " after a cut one
WHY_HINT = f"  · {WHY_WORDS}"
ARM_STYLE = {"gemv": "cyan", "grouped": "magenta", "torch_grouped_mm": "blue", "reference": "yellow",
             "fused": "green", "unfused": "yellow", "mla_fused": "green", "mla_reference": "yellow"}


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
        arm = decided if r["decided_arm"] == r["executed_arm"] else f"{decided}→{r['executed_arm']}"
        shared = shared_path_text(r) if self.op == "moe" else ""
        return f"{arm} + {shared}" if shared else arm

    @property
    def mask_dropped(self) -> bool:
        return self.op == "attention" and self.record["mask"] != self.record["applied_mask"]

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
        reason += f" [{r['execution_note']}]" if r.get("execution_note") else ""
        shared = shared_reason_text(r) if self.op == "moe" else ""
        return f"{reason} · {shared}" if shared else reason

    def cells(self) -> tuple[str, ...]:
        """The row's text, column by column (what is shown and what `find` searches)."""
        r = self.record
        us = "" if r.get("us") is None else f"{r['us']:.1f}"
        woken = pairs = fill = mask = ""
        if self.op == "moe":
            observed, pairs_observed = r.get("woken_observed"), r.get("pairs_per_woken_observed")
            woken = f"{r['woken_predicted']:.1f}/{'-' if observed is None else observed}"
            pairs = f"{r['pairs_per_woken']:.2f}/{'-' if pairs_observed is None else f'{pairs_observed:.2f}'}"
            fill = fill_text(r["pairs_per_woken"], r["tile_m"])
        else:
            mask = r["mask"] if r["mask"] == r["applied_mask"] else f"{r['mask']} → {r['applied_mask']}"
            if "kv_cache_bytes_per_token" in r:  # latent attention: its cache against the decompressed one
                mask += f" · KV {r['kv_cache_bytes_per_token']}/{r['naive_kv_cache_bytes_per_token']} B/tok"
        return (self.side, str(r["step"]), str(r["layer"]), r["phase"], str(r["n_tokens"]), self.arm_text(), woken,
                pairs, fill, mask, us, self.reason())

    def row(self) -> list:
        cells = list(self.cells())
        cells[5] = Text(cells[5], style=ARM_STYLE.get(self.record["executed_arm"], ""))
        if self.mask_dropped:
            cells[9] = Text(cells[9], style="bold red")  # the mask was dropped: the incident
        cells[11] = Text(cells[11], style="dim")
        return cells

    def searchable(self) -> str:
        return " ".join(self.cells()).lower()


def entries_of(side: str, steps: list[dict]) -> list[LogEntry]:
    entries = []
    for step in steps:
        entries.extend(LogEntry(side, "moe", record) for record in step["moe"])
        entries.extend(LogEntry(side, "attention", record) for record in step["attention"])
    return entries


class LogTable(DataTable):
    """The rows; Enter opens the one under the cursor."""

    BINDINGS = [Binding("enter", "select_cursor", "Details", show=True)]


class DispatchLog(Vertical):
    """Filters, the table, the cursor row's whole reason, and the find / go-to-step bar."""

    follow: reactive[bool] = reactive(True)

    class Opened(Message):
        """The user asked for a row's whole decision (Enter on it): `index` into `shown`."""

        def __init__(self, log: "DispatchLog", index: int) -> None:
            super().__init__()
            self.log, self.index = log, index

    def __init__(self, n_layers: int, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.n_layers = n_layers
        self.entries: list[LogEntry] = []
        self.shown: list[LogEntry] = []  # the entries passing the filters, in the table's order
        self.filters: dict[str, object] = {"side": None, "layer": None, "arm": None, "phase": None}
        self.bar_mode: str | None = None  # "find" or "step" while the bar under the table is open
        self._programmatic = 0  # cursor moves and scrolls the log makes itself never switch follow mode
        self._why_rows = 0  # the reason line's rows: the most any reason shown since the last clear needed
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
        yield LogTable(id="log-lines", cursor_type="row", zebra_stripes=True, fixed_columns=FIXED_COLUMNS)
        yield Static("", id="log-why")
        with Horizontal(id="log-bar"):
            yield Input(compact=True, id="log-bar-input")
            yield Static("", id="log-bar-status")

    def on_mount(self) -> None:
        self.lines.add_columns(*COLUMNS)
        self.query_one("#log-bar").display = False
        self.watch(self.lines, "scroll_y", self._scrolled, init=False)
        self._show_follow()

    @property
    def lines(self) -> LogTable:
        return self.query_one("#log-lines", LogTable)

    # -- data ------------------------------------------------------------------------------------

    def clear(self) -> None:
        self.entries, self.shown = [], []
        self._programmatic += 1
        self.lines.clear()
        self._programmatic -= 1
        self.follow = True
        self._why_rows = 0
        self.query_one("#log-why", Static).styles.min_height = None
        self.query_one("#log-why", Static).update("")

    def add_steps(self, side: str, steps: list[dict]) -> None:
        new = entries_of(side, steps)
        self.entries.extend(new)
        self._add([entry for entry in new if entry.matches(**self.filters)])

    def _add(self, entries: list[LogEntry]) -> None:
        if entries:  # one call per batch
            self.lines.add_rows([entry.row() for entry in entries])
            self.shown.extend(entries)
        if self.follow:
            self._move_to(len(self.shown) - 1)
        else:
            self._show_why()

    def _rebuild(self) -> None:
        self._programmatic += 1
        self.lines.clear()
        self._programmatic -= 1
        self.shown = []
        self.follow = True
        self._add([entry for entry in self.entries if entry.matches(**self.filters)])

    def refresh_values(self) -> None:
        """Render every row again from its record, keeping the cursor: a profiled run's per-layer µs of
        replayed steps are filled into the records when the run ends (engine.layer_timing)."""
        row, follow = self.lines.cursor_row, self.follow
        self._rebuild()
        if not follow:
            self.follow = False
            self._move_to(min(row, len(self.shown) - 1))

    @property
    def cursor_entry(self) -> LogEntry | None:
        row = self.lines.cursor_row
        return self.shown[row] if 0 <= row < len(self.shown) else None

    def _move_to(self, row: int) -> None:
        if 0 <= row < len(self.shown):
            self._programmatic += 1
            self.lines.move_cursor(row=row, animate=False, scroll=True)
            self._programmatic -= 1
        self._show_why()

    def _show_why(self) -> None:
        entry = self.cursor_entry
        why = Text()
        if entry is not None:
            r = entry.record
            why.append(f"why ({entry.side} step {r['step']} L{r['layer']} {'MoE' if entry.op == 'moe' else 'attn'}): ",
                       style="bold")
            why.append(entry.reason())
            why.append(WHY_HINT, style="dim")
        elif self.entries and not self.shown:
            why.append("no row passes the filters", style="dim")
        line = self.query_one("#log-why", Static)
        line.update(self._fitted(line, why))

    def _fitted(self, line: Static, why: Text) -> Text:
        """`why` wrapped at the line's width: the line grows to its rows (never past WHY_ROWS, never shrinking
        while the run's rows are shown: the table keeps its height), and a text longer still is cut to fit,
        ending in "…" and the hint. A one-row line (a short screen: no wrap, an ellipsis) is left to its CSS."""
        width = line.content_size.width
        if width < 8 or line.styles.text_wrap == "nowrap":
            return why
        rows = len(why.wrap(self.app.console, width))
        if rows > max(self._why_rows, 2):  # two rows are the CSS's own minimum
            self._why_rows = min(rows, WHY_ROWS)
            line.styles.min_height = self._why_rows
        if rows <= WHY_ROWS:
            return why
        cut = why[:len(why) - len(WHY_HINT)]
        hint = Text(f"… {WHY_WORDS}", style="dim")
        while len(cut) and len((cut + hint).wrap(self.app.console, width)) > WHY_ROWS:
            cut = cut[:len(cut) - max(1, width // 4)]
        return cut + hint

    # -- the cursor and follow mode ---------------------------------------------------------------

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if not self._programmatic and event.cursor_row < len(self.shown) - 1:
            self.follow = False  # the user moved up: stay there
        elif not self._programmatic and event.cursor_row == len(self.shown) - 1:
            self.follow = True
        self._show_why()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if 0 <= event.cursor_row < len(self.shown):
            self.post_message(self.Opened(self, event.cursor_row))

    def _scrolled(self, old: float, new: float) -> None:
        """A scroll up pauses following; a scroll that leaves the table at its end does not (a taller window
        lowers the end, and the table's scroll with it: not the user's doing)."""
        if self._programmatic:
            return
        if new < old and new < self.lines.max_scroll_y:
            self.follow = False

    def on_resize(self) -> None:
        """A shorter window raises the table's end above the view: a following log moves back to it."""
        if self.follow and self.shown:
            self.call_after_refresh(self._move_to, len(self.shown) - 1)

    def resume_follow(self) -> None:
        self.follow = True
        self._move_to(len(self.shown) - 1)

    def watch_follow(self, follow: bool) -> None:
        self._show_follow()

    def _show_follow(self) -> None:
        self.border_subtitle = ("following · enter details · ctrl+f find · ctrl+g step" if self.follow
                                else "paused · f5 follows again")

    # -- filters -----------------------------------------------------------------------------------

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        key = event.select.id.removeprefix("filter-")
        value = None if event.value == Select.NULL else event.value
        if self.filters[key] != value:
            self.filters[key] = value
            self._rebuild()

    def clear_filters(self) -> None:
        for key in self.filters:
            self.query_one(f"#filter-{key}", Select).clear()

    # -- find and go to step -------------------------------------------------------------------------

    def open_bar(self, mode: str) -> None:
        """`find` (text in any column) or `step` (a step number), in the bar under the table."""
        self.bar_mode = mode
        bar, box = self.query_one("#log-bar"), self.query_one("#log-bar-input", Input)
        bar.display = True
        box.value = ""
        box.placeholder = ("find: text in any column (enter: next match, escape: close)" if mode == "find" else
                           "go to step: a step number, then enter (escape: close)")
        box.restrict = r"[0-9]*" if mode == "step" else None
        self._bar_status("")
        box.focus()

    def close_bar(self) -> None:
        self.bar_mode = None
        self.query_one("#log-bar").display = False
        self.lines.focus()

    def _bar_status(self, text: str, refused: bool = False) -> None:
        status = self.query_one("#log-bar-status", Static)
        status.update(text)
        status.set_class(refused, "-refused")

    def find(self, text: str, start: int | None = None) -> int | None:
        """Move to the first shown row at or after `start` (the cursor) whose text holds `text`, wrapping."""
        needle = text.strip().lower()
        if not needle or not self.shown:
            self._bar_status("")
            return None
        hits = [index for index, entry in enumerate(self.shown) if needle in entry.searchable()]
        if not hits:
            self._bar_status(f"no row holds {text.strip()!r}", refused=True)
            return None
        origin = self.lines.cursor_row if start is None else start
        row = next((index for index in hits if index >= origin), hits[0])
        self.follow = False
        self._move_to(row)
        self._bar_status(f"match {hits.index(row) + 1} of {len(hits)}")
        return row

    def go_to_step(self, text: str) -> int | None:
        if not text.strip().isdigit():
            self._bar_status("give a step number, e.g. 12", refused=True)
            return None
        step = int(text)
        row = next((index for index, entry in enumerate(self.shown) if entry.record["step"] == step), None)
        if row is None:
            steps = sorted({entry.record["step"] for entry in self.shown})
            shown = f"steps {steps[0]}–{steps[-1]} are shown" if steps else "no rows are shown"
            self._bar_status(f"no step {step}: {shown}", refused=True)
            return None
        self.follow = False
        self._move_to(row)
        self._bar_status(f"step {step}: row {row + 1} of {len(self.shown)}")
        return row

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "log-bar-input" and self.bar_mode == "find":
            event.stop()
            self.find(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "log-bar-input":
            return
        event.stop()
        if self.bar_mode == "find":
            self.find(event.value, self.lines.cursor_row + 1)
        elif self.bar_mode == "step" and self.go_to_step(event.value) is not None:
            self.close_bar()

    def on_key(self, event) -> None:
        if event.key == "escape" and self.bar_mode is not None:
            event.stop()
            event.prevent_default()
            self.close_bar()
