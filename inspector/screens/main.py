"""The main screen: flags (A), prompt, A and B side by side, divergence, dispatch log, counters.

A run generates the prompt at temperature 0 through A (the flags panel) and then B (A's flags
with B's overrides) in one thread worker. The worker's `on_step` only puts events on the
screen's `EngineQueue`; a timer drains it on the UI thread and posts batched messages, whose
handlers below update the widgets. Nothing here blocks the UI thread on the engine.

A run is recorded into the session when it finishes (with both generations, as the step's
recorded results); a cancelled or failed run is not, since replaying it would ask for tokens
the user never saw.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, TextArea

from engine.errors import UserError
from engine.flags import DEFAULT, SPECS, ResolvedFlags
from engine.layer_timing import PROFILED
from engine.printable import printable
from engine.runtime import Engine
from engine.sidebyside import compare, first_divergence
from inspector import events
from inspector.events import A, B, EngineQueue
from inspector.widgets.config_b_row import ConfigBRow, describe_overrides
from inspector.widgets.counters_table import CountersTable
from inspector.widgets.dispatch_log import DispatchLog
from inspector.widgets.divergence_bar import DivergenceBar, common_prefix_divergence
from inspector.widgets.flags_panel import FlagsPanel
from inspector.widgets.output_pane import OutputPane, tokenizer_token_text
from inspector.widgets.prompt_bar import MAX_TOKENS_LABEL, PromptBar
from inspector.widgets.status_bar import StatusBar

B_SOURCE = "B override"


@dataclass
class Run:
    """One side-by-side run, as the UI has seen it so far."""

    id: int
    prompt: str
    max_tokens: int
    flags: dict[str, ResolvedFlags]  # side -> flags
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: dict[str, list[int]] = field(default_factory=lambda: {A: [], B: []})
    steps: dict[str, list[dict]] = field(default_factory=lambda: {A: [], B: []})
    generations: dict[str, Any] = field(default_factory=dict)
    comparison: dict | None = None
    running: bool = True
    cancelled: bool = False
    action: dict = field(default_factory=dict)  # what the session records once the run finishes
    walls: dict[str, float] = field(default_factory=dict)  # side -> seconds its generation took

    def moe_observations(self) -> list[tuple[int, float]]:
        """(n_tokens, observed pairs per woken expert) of every MoE layer of every step, A and B."""
        return sorted({(record["n_tokens"], record["pairs_per_woken_observed"])
                       for side in (A, B) for step in self.steps[side] for record in step["moe"]
                       if record.get("pairs_per_woken_observed") is not None})


def emitting_steps(steps: list[dict]) -> list[int]:
    """The dispatch log's steps that emitted a side's generated tokens, in order: entry i emitted token i (a prefill
    chunk before the prompt's last emits none, so with a prompt longer than prefill_chunk the two numberings part)."""
    return [step["step"] for step in steps if step.get("token") is not None]


def token_step(steps: list[dict], index: int) -> int | None:
    """The dispatch log's step that emitted generated token `index` of a side; None if not there."""
    emitting = emitting_steps(steps)
    return emitting[index] if index < len(emitting) else None


def parse_max_tokens(text: str) -> int:
    text = text.strip()
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{MAX_TOKENS_LABEL} {text!r}: give a whole number >= 1 (e.g. 48)")
    return int(text)


def describe_changed(flags: ResolvedFlags) -> str:
    """A's title: the flags whose values are not their defaults, or that it runs on defaults (a session the TUI
    saved sets every flag, most to its default: those are not changes)."""
    changed = {name: flags[name] for name, source in flags.sources.items()
               if source != DEFAULT and flags[name] != SPECS[name].default}
    return describe_overrides(changed) if changed else "default flags"


WIDE = 140  # columns from which the flags panel and the counters table sit beside the rest
# The footer's keys by width: every screen key the README lists from WIDE columns; under FOOTER_NARROW the
# follow key (f5) gives its place so that f7, f8 and Quit stay on an 80-column line (help and palette list all).
FOOTER_WIDE_KEYS = ("f4", "f9", "f10", "ctrl+s", "ctrl+o")
FOOTER_NARROW = 100
FOOTER_NARROW_HIDDEN = ("f5",)


def _show_keys(node, shown: dict[str, bool]) -> None:
    """Set `show` of `node`'s bindings of the given keys, in a copy of its map (the class's stays as declared)."""
    from dataclasses import replace

    node._bindings = node._bindings.copy()
    for key, show in shown.items():
        node._bindings.key_to_bindings[key] = [replace(binding, show=show)
                                               for binding in node._bindings.key_to_bindings.get(key, [])]


class MainScreen(Screen):
    # Short words: at 80 columns the footer shows the keys that fit (show_footer_keys; help and palette list all).
    BINDINGS = [
        # One key, two meanings: the first enabled binding wins (check_action), so escape closes the flags panel
        # lying over a narrow screen and only otherwise cancels the running generation.
        Binding("escape", "close_flags", "Close"),
        Binding("escape", "cancel", "Cancel"),
        Binding("f1", "app.help", "Help"),  # here too, so the footer shows it before the screen's keys
        Binding("f2", "tile_fill", "Fill"),
        Binding("f3", "attention_check", "Attn"),
        Binding("f4", "edit_b", "Edit B", show=False),  # said where B is shown: its row and its pane's title
        Binding("f5", "follow", "Follow"),
        Binding("f6", "focus_flags", "Flags"),
        Binding("f7", "replay", "Replay"),
        Binding("f8", "bench", "Bench"),
        Binding("f9", "ab", "A/B", show=False),  # in the help and the palette; the footer keeps its width
        Binding("f10", "routing", "Routing", show=False),
        Binding("ctrl+q", "app.quit", "Quit"),
        Binding("ctrl+n", "prompt_file", "Prompt file", show=False),
        Binding("ctrl+f", "find_in_log", "Find", show=False),
        Binding("ctrl+g", "go_to_step", "Go to step", show=False),
        Binding("ctrl+t", "export_log", "Export log", show=False),
        Binding("ctrl+l", "focus_prompt", "Prompt", show=False),
        Binding("ctrl+s", "app.save_session", "Save as", show=False),  # the app's, here for the footer
        Binding("ctrl+o", "app.open_session", "Open", show=False),
    ]
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]

    def __init__(self, engine: Engine, flags: ResolvedFlags, b_overrides: dict[str, Any], max_tokens: int,
                 timed: bool, history=None, prompt: str = "", engine_b: Engine | None = None,
                 b_model: str | None = None) -> None:
        """`engine_b`: B's own model (`--b-model`, as written in `b_model`), else B runs on `engine` too."""
        super().__init__()
        self.engine, self.initial_flags, self.timed = engine, flags, timed
        self.engine_b, self.b_model = engine_b, b_model
        self.b_overrides = dict(b_overrides)
        self.default_max_tokens = max_tokens
        self.history, self.initial_prompt = history, prompt
        self.queue = EngineQueue()
        self.current_run: Run | None = None
        self._next_run_id = 1

    # -- layout ------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StatusBar(self.engine, id="status")
        with Horizontal(id="body"):
            yield FlagsPanel(self.initial_flags, id="flags")
            with Vertical(id="work"):
                yield PromptBar(self.default_max_tokens, self.history, self.initial_prompt, id="prompt-bar")
                yield ConfigBRow(self.b_overrides, id="b-row")
                with Horizontal(id="outputs"):
                    shown = tokenizer_token_text(self.engine.tokenizer)
                    yield OutputPane(A, id="pane-a", shown=shown)
                    yield OutputPane(B, id="pane-b", hint="f4 edits", shown=shown)
                yield DivergenceBar(id="divergence")
                with Horizontal(id="lower"):
                    yield DispatchLog(self.engine.config.n_layers, id="log")
                    yield CountersTable(id="counters")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#pane-a", OutputPane).reset(self.a_title(self.initial_flags))
        self.query_one("#pane-b", OutputPane).reset(self.b_title())
        self.query_one("#prompt").focus()
        self.set_interval(events.DRAIN_INTERVAL, self.drain)

    def on_resize(self, event) -> None:
        narrow = self.size.width < WIDE
        self.query_one(CountersTable).set_compact(narrow)
        if not narrow and self.has_class("-flags-open"):
            self.overlay_flags(False)
        self.show_footer_keys(self.size.width)

    def show_footer_keys(self, width: int) -> None:
        """Show or hide the width-dependent footer keys (FOOTER_WIDE_KEYS, FOOTER_NARROW_HIDDEN; the prompt's
        new-line key, which its placeholder names, under FOOTER_NARROW)."""
        shown = {key: width >= WIDE for key in FOOTER_WIDE_KEYS} | {key: width >= FOOTER_NARROW
                                                                    for key in FOOTER_NARROW_HIDDEN}
        if getattr(self, "_footer_width_shown", None) == shown:
            return
        self._footer_width_shown = shown
        _show_keys(self, shown)
        _show_keys(self.query_one("#prompt"), {"ctrl+j": width >= FOOTER_NARROW})
        self.refresh_bindings()

    @property
    def narrow(self) -> bool:
        return self.has_class("-narrow")

    @property
    def flags(self) -> ResolvedFlags:
        """Configuration A, as the flags panel holds it now."""
        return self.query_one(FlagsPanel).flags

    def flags_b(self, flags_a: ResolvedFlags) -> ResolvedFlags:
        return flags_a.with_overrides(self.b_overrides, B_SOURCE)

    def engine_for(self, side: str) -> Engine:
        """The engine a pane's runs use: B's own model where --b-model gave one, else A's."""
        return self.engine_b if side == B and self.engine_b is not None else self.engine

    def _title(self, side: str, flags_text: str) -> str:
        """A pane's title: its flags, after its model's name when B runs on a model of its own."""
        if self.engine_b is None:
            return flags_text
        return printable(f"{self.engine_for(side).config.name} · {flags_text}", 60)

    def a_title(self, flags: ResolvedFlags) -> str:
        return self._title(A, describe_changed(flags))

    def b_title(self) -> str:
        return self._title(B, describe_overrides(self.b_overrides))

    @property
    def running(self) -> bool:
        return self.current_run is not None and self.current_run.running

    # -- starting and stopping a run ---------------------------------------------------------------

    def on_prompt_bar_run(self, message: PromptBar.Run) -> None:
        self.start_run(message.prompt, message.max_tokens_text)

    def start_run(self, prompt: str, max_tokens_text: str) -> bool:
        status = self.query_one(StatusBar)
        try:
            max_tokens = parse_max_tokens(max_tokens_text)
            tokens = self.engine.encode_prompt(prompt)
            self.engine.check_length(tokens, max_tokens, max_tokens_name=MAX_TOKENS_LABEL)
            if self.engine_b is not None:
                tokens_b = self.engine_b.encode_prompt(prompt)
                if tokens_b != tokens:
                    raise UserError(f"B's model {self.engine_b.config.name} reads this prompt as other tokens than "
                                    f"A's: side by side needs one tokenizer")
                self.engine_b.check_length(tokens_b, max_tokens, max_tokens_name=MAX_TOKENS_LABEL)
        except UserError as error:
            status.set_activity(f"not run: {error}", running=False, alert=True)
            self.notify(str(error), title="not run", severity="error", markup=False)
            return False
        if self.history is not None:
            self.history.add(prompt)
        if self.running:  # a new prompt replaces the running one
            self.current_run.cancel.set()
        flags_a = self.flags
        flags_b = self.flags_b(flags_a)
        run = Run(self._next_run_id, prompt, max_tokens, {A: flags_a, B: flags_b})
        self._next_run_id += 1
        self.current_run = run
        self.clear_results(flags_a, "A running; B waits")
        lock = getattr(self.app, "engine_lock", None)
        waiting = " (waiting for the engine: a replayed step, a bench or an attention check holds it)" if lock and lock.locked() else ""
        status.set_activity(f"running A: 0/{max_tokens}{waiting}", running=True)
        self.refresh_bindings()
        run.action = {
            "action": "prompt", "prompt": prompt, "max_tokens": max_tokens,
            "flags": dict(flags_a.values),
            "compare": {"name": B, "overrides": dict(self.b_overrides), "flags": dict(flags_b.values)},
        }
        if self.engine_b is not None:  # a session step that names B's model: a compare step with b_model
            run.action = {"action": "compare", "prompt": prompt, "max_tokens": max_tokens,
                          "a": {"flags": dict(flags_a.values)},
                          "b": {"name": B, "flags": dict(flags_b.values)}, "b_model": self.b_model}
        self.post_message(events.RunStarted(run.id, prompt, max_tokens, flags_a, flags_b))
        self.generate(run, getattr(self.app, "engine_lock", None) or threading.Lock())
        return True

    @work(thread=True, exclusive=True, group="generation")
    def generate(self, run: Run, engine_lock: threading.Lock) -> None:
        """A then B on the worker thread. Only puts events on the queue; never touches a widget."""
        results = {}
        with engine_lock:  # a replayed step or a bench on the other screens finishes first
            for side in (A, B):
                if run.cancel.is_set():
                    break

                def on_step(record: dict, token: int, side: str = side) -> None:
                    self.queue.put(events.StepEvent(run.id, side, record, token))

                started = time.perf_counter()
                try:
                    generation = self.engine_for(side).generate(run.prompt, run.max_tokens, run.flags[side],
                                                                on_step=on_step, cancel=run.cancel, timed=self.timed)
                except UserError as error:
                    self.queue.put(events.RunErrorEvent(run.id, str(error)))
                    return
                results[side] = generation
                self.queue.put(events.SideDoneEvent(run.id, side, generation, time.perf_counter() - started))
            comparison = compare(results[A], results[B]) if len(results) == 2 else None
        self.queue.put(events.RunDoneEvent(run.id, comparison, run.cancel.is_set()))

    def cancel_run(self) -> bool:
        if not self.running:
            return False
        self.current_run.cancel.set()
        self.query_one(StatusBar).set_activity("cancelling…", running=True)
        return True

    def on_unmount(self) -> None:
        if self.current_run is not None:
            self.current_run.cancel.set()

    # -- the queue -----------------------------------------------------------------------------------

    def drain(self) -> None:
        for message in self.queue.drain():
            self.post_message(message)

    def _current(self, run_id: int) -> Run | None:
        return self.current_run if self.current_run is not None and self.current_run.id == run_id else None

    def on_steps_arrived(self, message: events.StepsArrived) -> None:
        run = self._current(message.run_id)
        if run is None:
            return
        side = message.side
        run.tokens[side].extend(message.tokens)
        run.steps[side].extend(message.steps)
        self.query_one(f"#pane-{side.lower()}", OutputPane).extend(message.tokens)
        self.query_one(DispatchLog).add_steps(side, message.steps)
        self.query_one(CountersTable).add_steps(side, message.steps)
        self.query_one(StatusBar).set_activity(
            f"running {side}: {len(run.tokens[side])}/{run.max_tokens}"
            + (" (cancelling…)" if run.cancel.is_set() else ""), running=True)
        if side == B:
            self._show_divergence(run, common_prefix_divergence(run.tokens[A], run.tokens[B]), final=False)

    def on_side_finished(self, message: events.SideFinished) -> None:
        run = self._current(message.run_id)
        if run is None:
            return
        generation = message.generation
        run.generations[message.side] = generation
        if message.wall_s is not None:
            run.walls[message.side] = message.wall_s
        self.query_one(CountersTable).set_final(message.side, generation.counters)
        if any(record.get("us_method") == PROFILED for step in generation.steps
               for record in step.get("moe", []) + step.get("attention", [])):
            self.query_one(DispatchLog).refresh_values()  # the profile's µs arrived with the run's end
        count = len(generation.tokens)
        note = f"cancelled after {count} tokens" if generation.cancelled else f"{count} tokens"
        self.query_one(f"#pane-{message.side.lower()}", OutputPane).set_note(note)
        if message.side == A and not generation.cancelled:
            self.query_one(DivergenceBar).show_line("B running; A done")

    def on_run_finished(self, message: events.RunFinished) -> None:
        run = self._current(message.run_id)
        if run is None:
            return
        run.running, run.cancelled, run.comparison = False, message.cancelled, message.comparison
        bar = self.query_one(DivergenceBar)
        if message.comparison is not None:
            bar.show_errors(message.comparison["logit_rel_err"], emitting_steps(run.steps[A]))
        if message.cancelled:
            index = common_prefix_divergence(run.tokens[A], run.tokens[B])
            if B in run.generations and run.tokens[B]:
                self._show_divergence(run, index, final=False)
            else:
                bar.show_line("cancelled before B ran: nothing to compare")
            activity = "cancelled"
        else:
            self._show_divergence(run, first_divergence(run.tokens[A], run.tokens[B]), final=True)
            activity = f"done: A {len(run.tokens[A])} + B {len(run.tokens[B])} tokens"
        self.query_one(StatusBar).set_activity(activity, running=False)
        self.refresh_bindings()
        if message.cancelled:
            self.notify("a cancelled run is not recorded in the session", title="session", timeout=4)
        elif run.action and A in run.generations and B in run.generations:
            outcome = {"generations": [run.generations[A], run.generations[B]],
                       "walls": [run.walls.get(A, 0.0), run.walls.get(B, 0.0)], "comparison": message.comparison}
            if self.engine_b is not None:
                from inspector.session_steps import b_model_about

                outcome["b_model"] = b_model_about(self.engine_b)
            self.app.record_action(run.action, outcome)

    def on_run_failed(self, message: events.RunFailed) -> None:
        run = self._current(message.run_id)
        if run is None:
            return
        run.running = False
        self.query_one(StatusBar).set_activity(f"failed: {message.message}", running=False, alert=True)
        self.notify(message.message, title="run failed", severity="error", markup=False)
        self.refresh_bindings()

    def _show_divergence(self, run: Run, index: int | None, final: bool) -> None:
        for side in (A, B):
            self.query_one(f"#pane-{side.lower()}", OutputPane).mark_divergence(index)
        bar = self.query_one(DivergenceBar)
        compared = min(len(run.tokens[A]), len(run.tokens[B]))
        if index is None:
            suffix = "" if final else " so far"
            bar.show_line(f"A and B agree on all {compared} tokens{suffix}")
            return
        shown = tokenizer_token_text(self.engine.tokenizer)
        token_a = shown(run.tokens[A][index])[0] if index < len(run.tokens[A]) else "(ended)"
        token_b = shown(run.tokens[B][index])[0] if index < len(run.tokens[B]) else "(ended)"
        step = token_step(run.steps[A], index)
        where = "" if step is None else f" (dispatch log step {step})"
        bar.show_line(f"diverges at generated token {index}{where}: A '{token_a}' vs B '{token_b}'", diverged=True)

    # -- flags and configuration B --------------------------------------------------------------------

    def on_flag_changed(self, message: events.FlagChanged) -> None:
        self.app.record_action({"action": "flag", "config": A, "flag": message.name, "value": message.value,
                                "flags": dict(message.flags.values)})
        self.query_one("#pane-a", OutputPane).retitle(self.a_title(message.flags))  # as B's edit retitles B
        self.query_one("#pane-b", OutputPane).retitle(self.b_title())  # B is A's flags + its own

    def on_session_changed(self, message: events.SessionChanged) -> None:
        from inspector.tui_session import shown_path

        steps = f" · {message.steps} step{'s' if message.steps != 1 else ''}" + (f" · {message.note}" if message.note
                                                                                else "")
        self.query_one(StatusBar).set_session(shown_path(message.path) + steps, Path(message.path).name + steps)

    def load_session_state(self, flags: ResolvedFlags, b_overrides: dict[str, Any] | None) -> None:
        """An opened session: A where it left off, and B as its last side-by-side step had it; the last run's
        tokens, log rows, counters and divergence are cleared (they belong to the session before)."""
        self.query_one(FlagsPanel).load(flags)
        if b_overrides is not None and b_overrides != self.b_overrides:
            self.b_overrides = dict(b_overrides)
            self.query_one(ConfigBRow).set_overrides(self.b_overrides)
        self.current_run = None
        self.clear_results(flags, "no run yet in this session")
        self.query_one(StatusBar).set_activity("session opened: no run yet", running=False)
        self.refresh_bindings()

    def clear_results(self, flags_a: ResolvedFlags, divergence_line: str) -> None:
        """Empty both panes (titled for A's flags and B's overrides), the log, the counters and the divergence
        bar: a run starts, or a session opens."""
        self.query_one("#pane-a", OutputPane).reset(self.a_title(flags_a))
        self.query_one("#pane-b", OutputPane).reset(self.b_title())
        self.query_one(DispatchLog).clear()
        self.query_one(CountersTable).reset()
        divergence = self.query_one(DivergenceBar)
        divergence.show_line(divergence_line)
        divergence.show_errors([])

    def on_flag_refused(self, message: events.FlagRefused) -> None:
        self.notify(message.message, title=f"{message.name}: refused", severity="warning", markup=False)

    def set_b_overrides(self, overrides: dict[str, Any] | None) -> None:
        if overrides is None or overrides == self.b_overrides:
            return
        self.b_overrides = dict(overrides)
        self.query_one(ConfigBRow).set_overrides(self.b_overrides)
        self.query_one("#pane-b", OutputPane).retitle(self.b_title())
        self.app.record_action({"action": "config", "name": B, "overrides": dict(self.b_overrides)})
        self.post_message(events.ConfigBChanged(dict(self.b_overrides)))

    # -- actions -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "cancel":
            return True if self.running else False  # in the footer only while something runs
        if action == "close_flags":
            return self.flags_overlaid
        return True

    def action_cancel(self) -> None:
        self.cancel_run()

    def action_run_prompt(self) -> None:
        bar = self.query_one(PromptBar)
        self.start_run(bar.prompt, bar.max_tokens_text)

    def action_clear_filters(self) -> None:
        self.query_one(DispatchLog).clear_filters()

    def action_clear_prompt(self) -> None:
        """Empty the prompt box, as an edit of its own: ctrl+z in the box brings the text back."""
        prompt = self.query_one("#prompt", TextArea)
        prompt.clear()
        prompt.focus()

    def set_flag(self, name: str, value: Any) -> None:
        """From the command palette: a value for a select/bool flag, or None to focus an int flag's box."""
        panel = self.query_one(FlagsPanel)
        if value is None:
            panel.row(name).query_one(f"#control-{name}").focus()
            return
        panel.set_flag(name, value)

    def action_follow(self) -> None:
        self.query_one(DispatchLog).resume_follow()

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt").focus()

    @property
    def flags_overlaid(self) -> bool:
        """Whether the flags panel is open over the work area (a narrow screen folds it away otherwise)."""
        return self.narrow and self.has_class("-flags-open")

    def overlay_flags(self, shown: bool) -> None:
        """Open or close the flags panel over a narrow screen. While it is open the footer says escape closes it
        in f6's place (f6 closes it too), so Quit keeps its place on an 80-column line."""
        self.set_class(shown, "-flags-open")
        _show_keys(self, {"f6": not shown})
        self.refresh_bindings()

    def action_close_flags(self) -> None:
        """Fold the flags panel away again on a narrow screen and go back to the prompt."""
        self.overlay_flags(False)
        self.action_focus_prompt()

    def action_focus_flags(self) -> None:
        """Focus the flags panel; on a narrow screen it is folded away, and f6 opens (and closes) it."""
        if self.narrow:
            if self.flags_overlaid:
                self.action_close_flags()
                return
            self.overlay_flags(True)
        panel = self.query_one(FlagsPanel)
        first = next(iter(panel.flags.values))
        control = panel.row(first).query_one(f"#control-{first}")
        if control.focusable:
            control.focus()
        else:  # just unfolded: focusable once its styles are applied, a frame later
            self.set_timer(0.05, control.focus)

    # -- the dispatch log: details, find, go to step, export -------------------------------------------

    def on_dispatch_log_opened(self, message: DispatchLog.Opened) -> None:
        from inspector.screens.record import RecordScreen

        run = self.current_run

        def flags_of(side: str) -> dict | None:
            return None if run is None or side not in run.flags else dict(run.flags[side].values)

        self.app.push_screen(RecordScreen(list(message.log.shown), message.index, flags_of, self.engine.device.type))

    def action_find_in_log(self) -> None:
        self.query_one(DispatchLog).open_bar("find")

    def action_go_to_step(self) -> None:
        self.query_one(DispatchLog).open_bar("step")

    def log_rows(self) -> list[dict]:
        """The dispatch log's shown rows (the filters apply), flat: inspector.records' columns."""
        from inspector.records import record_row

        device = self.engine.device.type
        return [record_row(entry.side, {"step": entry.record["step"], "phase": entry.record["phase"],
                                        "n_tokens": entry.record["n_tokens"]}, entry.op, entry.record, device,
                           self.engine_for(entry.side).model_spec)
                for entry in self.query_one(DispatchLog).shown]

    def export_log(self, text: str) -> str:
        """Write the shown rows to `text` (.csv, .json or .jsonl); UserError, shown in place, for another name."""
        from inspector import records
        from inspector.session import atomic_write_text

        path = text.strip()
        fmt = self.export_format(path)
        rows = self.log_rows()
        if not rows:
            raise UserError("the dispatch log is empty: run a prompt first")
        if fmt == "json":
            log = self.query_one(DispatchLog)
            about = {"model": self.engine.config.name, "device": self.engine.device_label,
                     "filters": {key: value for key, value in log.filters.items() if value is not None},
                     "flags": {side: dict(flags.values) for side, flags in
                               (self.current_run.flags.items() if self.current_run else ())}}
            content = records.to_json(rows, about)
        else:
            content = records.EXPORTS[fmt](rows)
        target = self.check_export_path(path)
        try:
            atomic_write_text(target, content)
        except OSError as error:
            raise UserError(f"{path}: cannot write it ({error.strerror}); pick a writable directory") from None
        self.notify(f"{len(rows)} rows written to {path} ({fmt})", title="export")
        return path

    @staticmethod
    def export_format(path: str) -> str:
        """The export's format from its name (csv, json or jsonl); UserError for an empty or another name."""
        from inspector.commands.output import format_for_path

        if not path:
            raise UserError("give a file name, e.g. dispatch-log.csv")
        return format_for_path(path, None, ("csv", "json", "jsonl"), "export", alternative="")

    def check_export_path(self, path: str) -> Path:
        """The export's path, checked (inspector.output_paths): a name of an export format, never the open
        session's file or its results (the dialog asks this before asking to replace a file)."""
        from inspector.output_paths import check_output_path

        self.export_format(path)

        session = getattr(self.app, "session", None)
        protect = {} if session is None else {"the open session's file": session.path,
                                              "the open session's results file": session.results_path}
        return check_output_path(path, "export", protect=protect)

    def action_export_log(self) -> None:
        from inspector.screens.session_path import SessionPathScreen

        session = getattr(self.app, "session", None)  # beside the session's files, not in the working directory
        initial = "dispatch-log.csv" if session is None else str(Path(session.path).parent / "dispatch-log.csv")
        self.app.push_screen(SessionPathScreen("export", initial, self.export_log, check=self.check_export_path))

    def load_prompt_file(self, text: str) -> str:
        from inspector.prompt_file import read_prompt_file

        path = text.strip()
        if not path:
            raise UserError("give the path of a text file")
        prompt = read_prompt_file(path, "prompt file")
        bar = self.query_one(PromptBar)
        bar.set_prompt(prompt)
        bar.area.focus()
        self.notify(f"{path}: {prompt.count(chr(10)) + 1} lines in the prompt box; Enter runs it", title="prompt")
        return path

    def action_prompt_file(self) -> None:
        from inspector.screens.session_path import SessionPathScreen

        self.app.push_screen(SessionPathScreen("prompt", "", self.load_prompt_file))

    def action_edit_b(self) -> None:
        from inspector.screens.edit_b import EditBScreen

        self.app.push_screen(EditBScreen(self.b_overrides), self.set_b_overrides)

    def action_tile_fill(self) -> None:
        from inspector.screens.tile_fill import TileFillScreen

        observations = self.current_run.moe_observations() if self.current_run is not None else []
        self.app.push_screen(TileFillScreen(self.engine, self.flags, observations, self.app.sweep_path))

    def action_attention_check(self) -> None:
        from inspector.screens.attention_check import AttentionCheckScreen

        self.app.push_screen(AttentionCheckScreen(self.engine, self.flags))

    def action_replay(self) -> None:
        from inspector.screens.replay import ReplayScreen

        session = getattr(self.app, "session", None)
        if session is None:
            self.notify("no session is open: nothing to replay", severity="warning")
            return
        self.app.push_screen(ReplayScreen(self.engine, session.session, str(session.path), dict(session.lines),
                                          self.app.engine_lock))

    def action_bench(self) -> None:
        from inspector.screens.bench import BenchScreen

        flags = self.flags
        self.app.push_screen(BenchScreen(self.engine, flags, getattr(self.app, "engine_lock", None),
                                         flags_b=self.flags_b(flags)))

    def action_ab(self) -> None:
        from inspector.screens.ab import AbScreen

        self.app.push_screen(AbScreen(getattr(self.app, "ab_path", None)))

    def action_routing(self) -> None:
        from inspector.screens.routing import RoutingScreen

        generation = self.current_run.generations.get(A) if self.current_run is not None else None
        self.app.push_screen(RoutingScreen(getattr(generation, "routing", None)))
