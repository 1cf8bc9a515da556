"""Every key, and what each panel shows."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

KEYS = (
    ("enter", "in the prompt (or max tokens) box: run the prompt through A, then B, at temperature 0"),
    ("ctrl+j", "in the prompt box: a new line (shift+enter too, where the terminal tells them apart); a pasted "
               "prompt keeps all its lines"),
    ("↑ / ↓", "in the prompt box, on its first / last line: earlier / later prompts (ctrl+↑ / ctrl+↓ anywhere)"),
    ("ctrl+n", "load a prompt from a text file into the prompt box (`moe-inspector --prompt-file F` at start)"),
    ("escape", "main screen: close the flags panel where it lies over a narrow screen; otherwise cancel the "
               "running generation (the engine stops at its next step)"),
    ("f1  ?", "this help (? only outside text boxes)"),
    ("f2", "tile-fill screen: predicted pairs per woken expert against n, TILE_M, the policy's boundary, "
           "this run's observed points; a sweep file's µs per arm"),
    ("f3", "attention check screen, for the attention the model runs: fused vs masked / causal / unmasked "
           "references (sinks, composite mask), or the latent kernel vs its references (MLA)"),
    ("f4", "edit configuration B (A's flags with overrides)"),
    ("f5", "dispatch log: follow the newest rows again"),
    ("f6", "the flags panel (then tab / shift+tab between flags; enter opens a select or applies a box); on a "
           "narrow screen it is folded away, f6 opens and closes it and escape closes it"),
    ("ctrl+l", "focus the prompt box (on the tile-fill screen: the sweep file box)"),
    ("enter  (log)", "on a dispatch-log row: its whole decision (inputs, reason, arms, µs and how they were "
                     "timed); ←/→ there walk the rows"),
    ("ctrl+f", "find text in the dispatch log's shown rows (enter: next match, escape: close)"),
    ("ctrl+g", "go to a step in the dispatch log"),
    ("ctrl+t", "export the dispatch log's shown rows to .csv, .json or .jsonl"),
    ("f7", "replay screen: step through the open session's steps, each re-run beside its recording "
           "(on the attention check screen, f7 runs the check; Enter in a size box does too)"),
    ("←/p  →/n  r", "replay screen: previous / next step, re-run the step in view again"),
    ("f8", "bench screen: llama-bench pp/tg rows on this engine under A, B, or A against B, with latency "
           "percentiles, a progress bar, the trajectory and (on a GPU, profiled) kernel shares"),
    ("ctrl+r", "bench screen: run the bench (Enter in a plan box does too)"),
    ("f9", "A/B screen: an `moe-inspector ab --json-out` report's rows and verdicts, each row's rounds plotted"),
    ("f10", "routing screen: the last run's routing (with record_routing = on) or a routing file's: a layer x expert "
            "heatmap of load, per layer max/mean, cv, woken experts against uniform, the hottest experts; l last "
            "step, w window, a whole run, ctrl+r writes the run's routing to the path box"),
    ("ctrl+s", "save the session as (a path; recording continues into the new file, results beside it)"),
    ("ctrl+o", "open a session (a malformed file is refused in place; the current session stays)"),
    ("escape", "on the tile-fill, attention check, replay, bench, help and dialog screens: back"),
    ("tab / shift+tab", "move between the prompt, the flags, the log filters and the tables"),
    ("ctrl+p", "command palette: every action with its key, and every flag value"),
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
    ("dispatch log", "one row per MoE layer and attention layer per step: phase, n tokens, decided→executed "
                     "arm and variant (a layer with shared experts adds their path: + shared folded / apart), woken "
                     "experts predicted/observed, pairs per woken expert predicted/observed, "
                     "m-tile fill (past one tile: the full tiles), mask → applied mask, µs, the whole reason. The "
                     "header and the first three columns stay put when it scrolls sideways. Filter by "
                     "configuration, layer, arm, phase; the line under it is the cursor row's reason"),
    ("launch counters", "per arm, A and B: live from the records, then the engine's own counters (and Triton "
                        "kernel launches, where kernels ran)"),
    ("session", "every finished run, curve (once per distinct k, E, TILE_M), attention check and bench is a step "
                "of the session named in the status bar (--session FILE, else an autosave under "
                "$MOEI_SESSION_DIR, or ~/.cache/moe-inspector/sessions/ where it is not set), saved atomically "
                "with its results after each; flag changes "
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
        yield Footer(compact=True)
