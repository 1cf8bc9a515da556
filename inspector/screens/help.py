"""Every key, and what each panel shows."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("enter", "in the prompt (or max tokens) box: run the prompt through A, then B, at temperature 0"),
    ("escape", "main screen: cancel the running generation (the engine stops at its next step)"),
    ("f1  ?", "this help (? only outside text boxes)"),
    ("f2", "tile-fill screen: predicted pairs per woken expert against n, TILE_M, the policy's boundary, "
           "this run's observed points; a sweep file's µs per arm"),
    ("f3", "attention check screen: fused vs masked / causal / unmasked references"),
    ("f4", "edit configuration B (A's flags with overrides)"),
    ("f5", "dispatch log: follow the newest rows again"),
    ("f6", "focus the flags panel (then tab / shift+tab between flags; enter opens a select or applies a box)"),
    ("ctrl+l", "focus the prompt box (on the tile-fill screen: the sweep file box)"),
    ("f7", "replay screen: step through the open session's steps, each re-run beside its recording "
           "(on the attention check screen, f7 runs the check; Enter in a size box does too)"),
    ("←/p  →/n  r", "replay screen: previous / next step, re-run the step in view again"),
    ("f8", "bench screen: llama-bench pp/tg rows on this engine under A, with a progress bar, the trajectory "
           "and (on a GPU, profiled) kernel shares"),
    ("ctrl+r", "bench screen: run the bench (Enter in a plan box does too)"),
    ("f9", "A/B screen: an `moe-inspector ab --json-out` report's rows and verdicts, each row's rounds plotted"),
    ("f10", "routing screen: the last run's routing (with record_routing = on) or a routing file's: a layer x expert "
            "heatmap of load, per layer max/mean, cv, woken experts against uniform, the hottest experts; l last "
            "step, w window, a whole run, ctrl+r writes the run's routing to the path box"),
    ("ctrl+s", "save the session as (a path; recording continues into the new file, results beside it)"),
    ("ctrl+o", "open a session (a malformed file is refused in place; the current session stays)"),
    ("escape", "on the tile-fill, attention check, replay, bench, help and dialog screens: back"),
    ("tab / shift+tab", "move between the prompt, the flags, the log filters and the tables"),
    ("ctrl+p", "command palette: every action, and every flag value"),
    ("ctrl+q", "quit (a running generation is cancelled first)"),
)

PANELS = (
    ("status bar", "model, device ('cpu: reference arms' without a GPU: every layer runs its torch reference, "
                   "which computes the decided arm's semantics), what is running, and the session recorded into"),
    ("A: flags", "configuration A: every dispatch flag, its effective value and where it came from "
                 "(default, environment, session, command line, tui). A refused value keeps the previous one "
                 "and says what is allowed"),
    ("B", "configuration B: A's flags with overrides (default flash_512=off, moe_gate=reference: every layer "
          "on its reference arm)"),
    ("A / B panes", "the generated tokens as they stream; printable bytes as text, others as \\xNN; "
                    "from the first divergent token on, reverse video"),
    ("divergence line", "the first token where A and B differ, and the per-step relative error of A's logits "
                        "against B's as a sparkline"),
    ("dispatch log", "one row per MoE layer and attention layer per step: phase, n tokens, woken experts "
                     "predicted/observed, pairs per woken expert predicted/observed, m-tile fill, decided→executed "
                     "arm, variant, mask → applied mask, µs, reason. Filter by configuration, layer, arm, phase"),
    ("launch counters", "per arm, A and B: live from the records, then the engine's own counters (and Triton "
                        "kernel launches, where kernels ran)"),
    ("session", "every finished run, curve (once per distinct k, E, TILE_M), attention check and bench is a step "
                "of the session named in the status bar (--session FILE, else an autosave under "
                "~/.cache/moe-inspector/sessions/), saved atomically with its results after each; flag changes "
                "become the next step's config. Cancelled runs are not recorded. `moe-inspector run FILE` runs "
                "it headless, `moe-inspector replay FILE` diffs a re-run against the recording"),
    ("replay", "left: the recorded results, right: the re-run; tokens from the first difference in reverse "
               "video; ✓ match, ✗ differs, ? no recording, ! could not re-run. Timings are shown, not compared"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,question_mark,q", "dismiss(None)", "Close help")]

    def compose(self) -> ComposeResult:
        keys = Table(title="keys", show_header=False, expand=True, box=None, padding=(0, 1))
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for key, meaning in KEYS:
            keys.add_row(key, meaning)
        panels = Table(title="panels", show_header=False, expand=True, box=None, padding=(0, 1))
        panels.add_column(style="bold", no_wrap=True)
        panels.add_column()
        for panel, meaning in PANELS:
            panels.add_row(panel, meaning)
        with VerticalScroll(id="help", classes="dialog"):
            yield Static(keys)
            yield Static(panels)
            yield Static(Text("escape closes this help", style="dim"))
