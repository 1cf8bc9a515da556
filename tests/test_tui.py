"""The Textual inspector driven through Pilot on the `tiny` preset (CPU, seconds).

Each test asserts on state and on the typed messages the app posts (captured with run_test's
message_hook), not on pixels; the pixels are in test_tui_snapshots.py.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import time

import pytest
from rich.console import Console
from textual.widgets import Input, Select, Switch

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector import events
from inspector.app import InspectorApp
from inspector.screens.attention_check import NOT_AVAILABLE, AttentionCheckScreen, render_result
from inspector.screens.edit_b import EditBScreen
from inspector.screens.help import HelpScreen
from inspector.screens.main import MainScreen, token_step
from inspector.screens.tile_fill import TileFillScreen, load_sweep
from inspector.widgets.dispatch_log import DispatchLog
from inspector.widgets.flag_row import FlagRow
from inspector.widgets.flags_panel import TUI, FlagsPanel
from inspector.widgets.output_pane import OutputPane

SIZE = (200, 50)
LONGER_THAN_TINY_WINDOW = "The quick brown fox jumps over the lazy dog"  # 43 bytes > tiny's window of 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


class RecordingApp(InspectorApp):
    """The app with the session hook recording, and every posted message kept."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.actions: list[dict] = []
        self.messages: list = []

    def record_action(self, action: dict, outcome: dict | None = None) -> None:
        self.actions.append(action)


def synchronously(test):
    """Run an async Pilot test with asyncio.run (no asyncio plugin for pytest is needed)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return run


def make_app(engine: Engine, **kwargs) -> RecordingApp:
    return RecordingApp(engine, flag_registry.resolve([], environ={}), timed=False, **kwargs)


async def wait_until(pilot, condition, timeout: float = 20.0) -> None:
    waited = 0.0
    while not condition():
        assert waited < timeout, "timed out waiting for the app"
        await pilot.pause(0.05)
        waited += 0.05


async def run_prompt(pilot, app: RecordingApp, prompt: str, max_tokens: int | None = None) -> MainScreen:
    main = app.main_screen
    if max_tokens is not None:
        main.query_one("#max-tokens").value = str(max_tokens)
    main.query_one("#prompt").value = prompt
    main.query_one("#prompt").focus()
    await pilot.press("enter")
    await wait_until(pilot, lambda: main.current_run is not None and not main.current_run.running)
    await pilot.pause()
    return main


def of_type(app: RecordingApp, kind: type) -> list:
    """Messages of one type, each once (the hook sees a bubbling message at every node it reaches)."""
    unique = {id(message): message for message in app.messages if isinstance(message, kind)}
    return list(unique.values())


@synchronously
async def test_run_fills_both_panes_and_the_log(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main = await run_prompt(pilot, app, "hello", max_tokens=6)
        run = main.current_run
        assert len(run.tokens[events.A]) == len(run.tokens[events.B]) == 6
        assert main.query_one("#pane-a", OutputPane).tokens == run.tokens[events.A]
        assert main.query_one("#pane-b", OutputPane).tokens == run.tokens[events.B]
        layers = engine.config.n_layers
        log = main.query_one(DispatchLog)
        assert len(log.entries) == len(log.shown) == 2 * 6 * 2 * layers  # 2 sides x 6 steps x (MoE + attention) x layers
        # Messages: one start, batched steps, both sides finished, one end; never one message per token.
        assert len(of_type(app, events.RunStarted)) == 1
        batches = of_type(app, events.StepsArrived)
        assert sum(len(batch.tokens) for batch in batches) == 12
        assert [message.side for message in of_type(app, events.SideFinished)] == [events.A, events.B]
        (finished,) = of_type(app, events.RunFinished)
        assert not finished.cancelled and len(finished.comparison["logit_rel_err"]) == 6
        # Counters are the engine's once a side finishes: B runs every layer on its reference arms.
        counters = main.query_one("#counters")
        assert counters.count(events.B, "reference") == 6 * layers and counters.count(events.B, "gemv") == 0
        assert counters.count(events.B, "unfused") == 6 * layers and counters.count(events.B, "fused") == 0
        # The session hook saw the prompt with both configurations, as plain values.
        (prompt_action,) = [action for action in app.actions if action["action"] == "prompt"]
        assert prompt_action["max_tokens"] == 6 and prompt_action["flags"]["fused_mask"] == "honor"
        assert prompt_action["compare"]["flags"]["moe_gate"] == "reference"
        json.dumps(prompt_action)  # plain data, ready for a session file
        # Filters rewrite the log from the kept records; follow mode stops on scrolling up, f5 resumes.
        main.query_one("#filter-arm").value = "fused"
        await pilot.pause()
        assert len(log.shown) == 6 * layers  # A's attention layers only: B runs unfused
        main.query_one("#filter-arm").clear()
        await pilot.pause()
        assert len(log.shown) == len(log.entries) and log.follow
        await wait_until(pilot, lambda: log.lines.scroll_y == log.lines.max_scroll_y > 0)  # settled at the end
        log.lines.scroll_to(y=0, animate=False)
        await pilot.pause()
        assert not log.follow
        await pilot.press("f5")
        await pilot.pause()
        assert log.follow and log.lines.scroll_y == log.lines.max_scroll_y
        await pilot.resize_terminal(SIZE[0] + 40, SIZE[1] + 30)  # a taller table lowers its end: not a scroll up
        await pilot.pause()
        assert log.follow
        await pilot.resize_terminal(*SIZE)  # a shorter one raises it above the view: a following log goes back
        await wait_until(pilot, lambda: log.lines.scroll_y == log.lines.max_scroll_y)
        assert log.follow and log.lines.cursor_row == len(log.shown) - 1


@synchronously
async def test_a_prompt_longer_than_a_prefill_chunk_runs_and_shows_only_generated_tokens(engine):
    """A prompt of several prefill chunks: the chunks before the last emit no token (the engine's on_step gives
    None); the panes show the generated tokens only, and every chunk's step still reaches the log."""
    app = RecordingApp(engine, flag_registry.resolve(["prefill_chunk=16"], environ={}), timed=False)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main = await run_prompt(pilot, app, LONGER_THAN_TINY_WINDOW, max_tokens=4)  # 43 bytes: 3 chunks of 16
        run = main.current_run
        assert not of_type(app, events.RunFailed)
        assert len(run.tokens[events.A]) == len(run.tokens[events.B]) == 4
        assert all(isinstance(token, int) for token in run.tokens[events.A] + run.tokens[events.B])
        assert main.query_one("#pane-a", OutputPane).tokens == run.tokens[events.A]
        assert [step["phase"] for step in run.steps[events.A]][:3] == ["prefill"] * 3
        assert len(run.steps[events.A]) == 3 + 3  # three chunks (the last emits the first token), three decodes
        # generated token i came from the log's step i + 2, and the error line names both numbers
        assert [token_step(run.steps[events.A], index) for index in range(5)] == [2, 3, 4, 5, None]
        label = str(main.query_one("#error-label").render())
        assert "logit rel err" in label and ("(log step" in label or "bit-identical" in label), label


@synchronously
async def test_a_refused_prompt_keeps_its_whole_reason_in_the_status_bar_at_80_columns(engine):
    """The reason went to a fading popup and to a one-line bar that cut it at 'not run: the prompt (510'."""
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        main = app.main_screen
        main.query_one("#prompt").value = "x" * 600
        main.query_one("#prompt").focus()
        await pilot.press("enter")
        await pilot.pause()
        bar = main.query_one("#status")
        assert main.current_run is None and bar.has_class("-alert") and "longer than the" in bar.activity
        assert bar.size.height == 3  # the first line, then the reason's 1 + 79 characters on two more
        main.query_one("#prompt").value = "hello"
        main.query_one("#max-tokens").value = "2"
        await pilot.press("enter")
        await wait_until(pilot, lambda: main.current_run is not None and not main.current_run.running)
        assert not bar.has_class("-alert") and bar.size.height == 1


@synchronously
async def test_a_prompt_past_the_context_names_the_max_tokens_box_not_the_cli_option(engine):
    """The TUI's refusal said '--max-tokens', an option its user never types; it names the box's label."""
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        main = app.main_screen
        main.query_one("#prompt").value = "hello"
        main.query_one("#max-tokens").value = "9999"
        main.query_one("#prompt").focus()
        await pilot.press("enter")
        await pilot.pause()
        activity = main.query_one("#status").activity
        label = str(main.query_one("#max-tokens-label").render())
        assert main.current_run is None and "--max-tokens" not in activity
        assert f"plus {label} 9999 exceeds the tiny context of 512: ask for at most 507 tokens" in activity


@synchronously
async def test_fused_mask_drop_is_resolved_in_the_next_run(engine, tmp_path):
    app = make_app(engine)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main = app.main_screen
        select = main.query_one("#control-fused_mask")
        select.focus()
        await pilot.press("enter", "down", "down", "enter")  # honor -> decline -> drop
        await pilot.pause()
        panel = main.query_one(FlagsPanel)
        assert panel.flags["fused_mask"] == "drop" and panel.flags.sources["fused_mask"] == TUI
        assert [(m.name, m.value) for m in of_type(app, events.FlagChanged)] == [("fused_mask", "drop")]
        assert "drop · tui" in str(panel.row("fused_mask").query_one(".flag-status").render())

        run = (await run_prompt(pilot, app, LONGER_THAN_TINY_WINDOW, max_tokens=8)).current_run
        composite_layer = next(layer for layer, mask in enumerate(engine.config.layer_masks) if mask.kind != "causal")
        a_records = [r for step in run.steps[events.A] for r in step["attention"] if r["layer"] == composite_layer]
        b_records = [r for step in run.steps[events.B] for r in step["attention"] if r["layer"] == composite_layer]
        assert {r["decided_arm"] for r in a_records} == {"fused"}
        assert {r["applied_mask"] for r in a_records} == {"causal"}  # the mask was dropped
        assert {r["applied_mask"] for r in b_records} == {engine.config.layer_masks[composite_layer].describe()}
        assert run.flags[events.A].sources["fused_mask"] == TUI
        # A computes plain causal attention where B honours the mask: the panes part, visibly.
        assert max(run.comparison["logit_rel_err"]) > 1e-3
        index = main.query_one("#pane-a", OutputPane).divergence
        assert index is not None and main.query_one("#pane-b", OutputPane).divergence == index
        shown = str(main.query_one("#divergence-line").render())
        assert f"diverges at generated token {index} (dispatch log step {index})" in shown, shown  # one chunk
        flag_actions = [action for action in app.actions if action["action"] == "flag"]
        assert flag_actions[-1]["flag"] == "fused_mask" and flag_actions[-1]["value"] == "drop"
    # The session hook's payloads are what the session recorder reads.
    recorder_module = pytest.importorskip("inspector.session_recorder")
    recorder = recorder_module.SessionRecorder(tmp_path / "recorded.toml", {"model": "tiny", "seed": 0},
                                               flag_registry.resolve([], environ={}))
    for action in app.actions:
        recorder.append(action)
    (step,) = recorder.steps
    assert step.prompt == LONGER_THAN_TINY_WINDOW and step.max_tokens == 8
    assert recorder.session.flags["fused_mask"] == "drop"


@synchronously
async def test_invalid_flag_input_is_refused_in_place(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main = app.main_screen
        panel = main.query_one(FlagsPanel)
        box = main.query_one("#control-decode_floor")
        box.focus()
        box.value = "-3"
        await pilot.press("enter")
        await pilot.pause()
        (refused,) = of_type(app, events.FlagRefused)
        assert refused.name == "decode_floor" and "an integer >= 0" in refused.message  # names the allowed values
        assert panel.flags["decode_floor"] == 8 and panel.flags.sources["decode_floor"] == "default"
        assert box.value == "8"  # the previous valid value, kept
        row = panel.row("decode_floor")
        assert row.refusal is not None and "refused" in str(row.query_one(".flag-status").render())
        assert not of_type(app, events.FlagChanged)

        threshold = main.query_one("#control-moe_gate-threshold")
        threshold.focus()
        threshold.value = "0"
        await pilot.press("enter")
        await pilot.pause()
        assert panel.flags["moe_gate"] == "measured"
        assert "threshold:N (N >= 1)" in of_type(app, events.FlagRefused)[-1].message

        threshold.value = "24"
        await pilot.press("enter")
        await pilot.pause()
        assert panel.flags["moe_gate"] == "threshold:24" and panel.flags.sources["moe_gate"] == TUI
        assert main.query_one("#control-moe_gate").value == "threshold"

        box.focus()
        box.value = "3"
        await pilot.press("tab")  # leaving the box applies it too
        await pilot.pause()
        assert panel.flags["decode_floor"] == 3 and row.refusal is None


@synchronously
async def test_cancel_stops_a_long_generation(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main = app.main_screen
        # Started directly: Pilot's key presses wait for the app to go idle, which a run defers.
        assert main.start_run("hello", "400")
        await wait_until(pilot, lambda: len(main.current_run.tokens[events.A]) >= 3)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not main.current_run.running)
        run = main.current_run
        assert run.cancelled and run.cancel.is_set()
        assert 3 <= len(run.tokens[events.A]) < 400 and run.tokens[events.B] == []
        (finished,) = of_type(app, events.RunFinished)
        assert finished.cancelled and finished.comparison is None
        assert "cancelled" in str(main.query_one("#status").render())


@synchronously
async def test_ctrl_q_quits_and_cancels_the_running_generation(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main_screen
        assert main.start_run("hello", "400")
        await wait_until(pilot, lambda: main.current_run.tokens[events.A])
        run = main.current_run
        await pilot.press("ctrl+q")
        await pilot.pause()
        assert run.cancel.is_set()
    assert app.return_code == 0


@synchronously
async def test_edit_b_applies_and_refuses(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause()
        assert isinstance(app.screen, EditBScreen)
        box = app.screen.query_one("#b-overrides")
        box.value = "fused_mask=sideways"
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EditBScreen)  # refused in place
        assert "honor, decline or drop" in str(app.screen.query_one("#b-refusal").render())
        box.value = "flash_512=off,"  # refused as compare --b refuses it, not taken as flash_512=off
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, EditBScreen)
        assert "item 2 of 2 is empty" in str(app.screen.query_one("#b-refusal").render())
        box.value = "flash_512=off, fused_mask=decline"
        await pilot.press("enter")
        await pilot.pause()
        main = app.main_screen
        assert app.screen is main and main.b_overrides == {"flash_512": False, "fused_mask": "decline"}
        assert "fused_mask=decline" in str(main.query_one("#b-row").render())
        assert "fused_mask=decline" in main.query_one("#pane-b", OutputPane).border_title  # at once, not next run
        assert app.actions[-1] == {"action": "config", "name": "B",
                                   "overrides": {"flash_512": False, "fused_mask": "decline"}}


@synchronously
async def test_tile_fill_help_and_palette(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await run_prompt(pilot, app, "hello", max_tokens=3)
        await pilot.press("f2")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, TileFillScreen)
        assert any(n == 5 for n, _ in screen.observations)  # the 5-token prefill, observed
        assert any(n == 1 for n, _ in screen.observations)  # decode steps
        assert screen.min_tokens == 64 and screen.boundary == 16  # top-2 of 8 at TILE_M=16; measured -> threshold:16
        assert app.actions[-1]["action"] == "curve"
        # a refused sweep path shows its whole reason (wrapped), and the log-log plot redraws at every size
        screen.query_one("#sweep-path").value = "no-such-sweep.json"
        await pilot.press("enter")
        await pilot.pause()
        for size in ((80, 24), (120, 40), SIZE):
            await pilot.resize_terminal(*size)
            await pilot.pause()
            assert "give the path of a sweep JSON" in str(screen.query_one("#sweep-status").render()).replace("\n", " ")
            assert "pairs per woken expert" in str(screen.query_one("#fill-plot").render())
        await pilot.press("escape")
        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, MainScreen)
        # The palette offers every flag value; picking one sets it like the panel would.
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"decline")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.main_screen.flags["fused_mask"] == "decline"


@synchronously
async def test_attention_check_screen(engine):
    result = {  # the shape of engine.compare.check_attention's answer, for a dropped mask
        "discrimination": {"masked_vs_causal": 0.76, "masked_vs_unmasked": 0.9, "control": 8.8e-08,
                           "ratio": 8.6e6, "threshold": 100.0, "fires": True},
        "errors": {"masked": 0.83, "causal": 1.6e-07, "unmasked": 1.2},
        "control": 8.8e-08,
        "ablation": {"window_off": {"effect": 0.45, "fused": 0.5}, "summaries_off": {"effect": 0.18, "fused": 0.6},
                     "padding_off": {"effect": 0.59, "fused": 0.3}, "nearest": "padding_off"},
        "worst": {"query": 64, "head": 0, "key": 9, "why_masked_differs": "outside the window"},
        "sink_sweep": [{"sink": "-inf", "error": 0.8, "control": 8.8e-08, "finite": True, "ok": False}],
        "verdict": "causal", "sentence": "The fused output sits on the causal reference: the mask was dropped.",
        "ok": False,
    }
    calls = []

    def fake_check(**parameters):
        calls.append(parameters)
        return result

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(AttentionCheckScreen(engine, app.main_screen.flags, check=None))
        await pilot.pause()
        await pilot.press("f7")
        assert NOT_AVAILABLE in str(app.screen.query_one("#check-output").render())
        app.pop_screen()
        screen = AttentionCheckScreen(engine, app.main_screen.flags, check=fake_check)
        app.push_screen(screen)
        await pilot.pause()
        await pilot.press("f7")
        await wait_until(pilot, lambda: screen.result is not None)
        (parameters,) = calls
        assert parameters["head_dim"] == engine.config.head_dim and parameters["heads"] == engine.config.n_heads
        assert parameters["window"] == 16 and parameters["block"] == 8 and parameters["mode"] == "honor"
        assert parameters["device"] == "cpu" and parameters["dtype"] == engine.dtype
        assert app.actions[-1]["action"] == "check-attention" and app.actions[-1]["dtype"] == "torch.float32"
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render_result(result))
    shown = console.export_text()
    assert "verdict: causal" in shown and "check FAILED" in shown and "padding_off" in shown
    assert "causal reference      1.600e-07" in shown


@synchronously
async def test_attention_check_left_stops_after_its_part_and_sizes_are_checked_first(engine):
    """Leaving the screen stops a running check at its next part, unrecorded, and a check asked for meanwhile
    waits for the engine lock rather than running beside it (the interpreter runs one kernel at a time); a size
    this machine cannot hold is refused in place before anything is allocated."""
    import threading

    parts, running = [], threading.Event()

    def slow_check(progress=None, **parameters):
        for part in range(1000):
            running.set()
            time.sleep(0.01)
            parts.append(part)
            progress.advance(note=f"part {part}")
        return {"verdict": "masked", "ok": True}

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = AttentionCheckScreen(engine, app.main_screen.flags, check=slow_check)
        app.push_screen(screen)
        await pilot.pause()
        screen.query_one("#check-seq-len").value = str(10**6)
        await pilot.press("f7")
        await pilot.pause()
        assert "refused: the attention check: the reference attention at seq_len 1000000" in str(
            screen.query_one("#check-output").render()) and not screen.running and not parts
        screen.query_one("#check-seq-len").value = "64"
        recorded = len(app.actions)
        await pilot.press("f7")
        await wait_until(pilot, lambda: running.is_set() and screen.running)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.engine_lock.locked())
        stopped_at = len(parts)
        assert stopped_at < 1000 and not isinstance(app.screen, AttentionCheckScreen)
        await pilot.pause(0.1)
        assert len(parts) == stopped_at and len(app.actions) == recorded  # stopped, and nothing recorded
        app.engine_lock.acquire()  # a generation holds the engine: a new check waits for it
        again = AttentionCheckScreen(engine, app.main_screen.flags, check=lambda **_: {"verdict": "masked", "ok": True})
        app.push_screen(again)
        await pilot.pause()
        await pilot.press("f7")
        await wait_until(pilot, lambda: "waiting for the run before it" in str(again.query_one("#check-output").render()))
        assert again.result is None
        app.engine_lock.release()
        await wait_until(pilot, lambda: again.result is not None)
        assert app.actions[-1]["action"] == "check-attention"


def test_sweep_file_is_optional_and_checked(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": [
        {"n": 1, "us": {"gemv": 10.0, "grouped_v2": 30.0}},
        {"n": 16, "us": {"gemv": 40.0, "grouped_v2": 35.0}},
        {"n": 64, "us": {"gemv": 150.0, "grouped_v2": 60.0}},
    ]}))
    loaded = load_sweep(str(sweep))
    assert loaded["crossover"] == 16 and [n for n, _ in loaded["rows"]] == [1, 16, 64]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(Exception, match="not JSON"):
        load_sweep(str(tmp_path / "bad.json"))
    with pytest.raises(Exception, match="cannot read"):
        load_sweep(str(tmp_path / "missing.json"))


@synchronously
async def test_start_prompt_focused_and_every_flag_has_its_widget(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.focused is not None and app.focused.id == "prompt"
        assert "cpu: reference arms" in str(app.main_screen.query_one("#status").render())
        panel = app.main_screen.query_one(FlagsPanel)
        for name, spec in flag_registry.SPECS.items():
            assert isinstance(panel.row(name), FlagRow)
            control = panel.row(name).query_one(f"#control-{name}")
            assert isinstance(control, {"bool": Switch, "select": Select, "int": Input}[spec.kind]), name


def test_launch_refuses_bad_input_before_the_app_starts(capsys):
    from argparse import Namespace

    from inspector.tui import launch

    bad_flag = Namespace(model="tiny", device="cpu", seed=0, session=None, set_flags=["fused_mask=sideways"])
    assert launch(bad_flag) == 2
    assert "fused_mask" in capsys.readouterr().err
    bad_model = Namespace(model="huge", device="cpu", seed=0, session=None, set_flags=[])
    assert launch(bad_model) == 2
    error = capsys.readouterr().err
    assert "unknown model 'huge'" in error and "loading" not in error


# --------------------------------------------------------------------------------------------
# The prompt: several lines, pasted text, history, a file
# --------------------------------------------------------------------------------------------

@synchronously
async def test_the_prompt_takes_several_lines_and_enter_runs_them(engine):
    from textual import events as textual_events

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main_screen
        main.query_one("#max-tokens").value = "2"
        await pilot.press(*"first", "ctrl+j", *"second")
        area = main.query_one("#prompt")
        assert area.text == "first\nsecond" and main.current_run is None  # ctrl+j: a new line, no run
        app.post_message(textual_events.Paste("\nthird\nfourth"))  # as a terminal's bracketed paste arrives
        await pilot.pause()
        assert area.text == "first\nsecond\nthird\nfourth"  # a pasted prompt keeps every line
        bindings = {binding.key: binding.description for _, binding, _, _ in main.active_bindings.values()}
        assert bindings["enter"] == "Run" and bindings["ctrl+j"] == "Newline"  # both in the footer
        await pilot.press("enter")
        await wait_until(pilot, lambda: main.current_run is not None and not main.current_run.running)
        assert main.current_run.prompt == "first\nsecond\nthird\nfourth"
        assert main.current_run.generations[events.A].prompt_tokens == list(b"first\nsecond\nthird\nfourth")
        # History: up on the first line recalls it; down on the last returns to what was being typed.
        area.value = "draft"
        area.move_cursor((0, 0))
        await pilot.press("up")
        assert area.text == "first\nsecond\nthird\nfourth"
        area.move_cursor(area.document.end)
        await pilot.press("down")
        assert area.text == "draft"


def test_prompt_history_is_kept_in_its_file(tmp_path):
    from inspector.prompt_history import MAX_ENTRIES, PromptHistory

    path = tmp_path / "history" / "prompt-history.jsonl"
    history = PromptHistory(path)
    for prompt in ("one", "two\nlines", "one"):
        history.add(prompt)
    assert history.entries == ["two\nlines", "one"]  # once each, the newest last
    again = PromptHistory(path)
    assert again.entries == ["two\nlines", "one"]
    assert again.previous("typing") == "one" and again.previous("") == "two\nlines" and again.previous("") is None
    assert again.next() == "one" and again.next() == "typing" and again.next() is None
    for index in range(MAX_ENTRIES + 5):
        again.add(f"p{index}")
    assert len(PromptHistory(path).entries) == MAX_ENTRIES  # bounded
    path.write_text("{not json\n\"kept\"\n")
    assert PromptHistory(path).entries == ["kept"]  # a damaged line is skipped, never an error


@synchronously
async def test_a_prompt_file_loads_into_the_box_and_a_bad_one_is_refused_in_place(engine, tmp_path):
    from inspector.screens.session_path import SessionPathScreen

    prompt_file = tmp_path / "incident.txt"
    prompt_file.write_text("The \"if\" statement\n*****\n\nIt selects one suite.\n")
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+n")
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, SessionPathScreen)
        dialog.query_one("#session-path").value = str(tmp_path / "missing.txt")
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is dialog and "no such file" in str(dialog.query_one("#session-refusal").render())
        dialog.query_one("#session-path").value = str(prompt_file)
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is app.main_screen
        assert app.main_screen.query_one("#prompt").text == prompt_file.read_text()


# --------------------------------------------------------------------------------------------
# The dispatch log: a row's whole decision, find, go to step, export
# --------------------------------------------------------------------------------------------

@synchronously
async def test_a_log_row_opens_its_whole_decision(engine):
    from inspector.screens.record import RecordScreen, render_entry

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = await run_prompt(pilot, app, LONGER_THAN_TINY_WINDOW, max_tokens=3)
        log = main.query_one(DispatchLog)
        log.lines.focus()
        log.lines.move_cursor(row=0)
        await pilot.pause()
        assert not log.follow  # moved up: the log stays there
        await pilot.press("enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RecordScreen) and screen.index == 0
        entry = log.shown[0]
        console = Console(record=True, width=300, file=io.StringIO())
        console.print(render_entry(entry, screen.flags_of(entry.side), "cpu"))
        shown = console.export_text()
        assert entry.op == "moe" and entry.record["reason"] in shown  # whole, not cut
        assert screen.flags_of("A")["moe_gate"] == "measured"
        for words in ("decided arm", "executed arm", "what the gate read", "pairs per woken expert", "policy boundary",
                      "how it was timed", "not timed", "the record, every key"):
            assert words in shown, words
        bindings = {binding.description for _, binding, _, _ in screen.active_bindings.values() if binding.show}
        assert {"Close", "Next row"} <= bindings and "Fill" not in bindings  # the modal's keys, not the main's
        await pilot.press("right")
        await pilot.pause()
        assert screen.index == 1
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is main


@synchronously
async def test_find_go_to_step_and_the_reason_line_under_a_filter(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = await run_prompt(pilot, app, LONGER_THAN_TINY_WINDOW, max_tokens=5)
        log = main.query_one(DispatchLog)
        await pilot.press("ctrl+f")
        await pilot.pause()
        await pilot.press(*"composite")
        await pilot.pause()
        first = log.lines.cursor_row
        assert "composite" in log.shown[first].searchable() and not log.follow
        total = sum("composite" in entry.searchable() for entry in log.shown)
        assert f"match 1 of {total}" in str(log.query_one("#log-bar-status").render())
        await pilot.press("enter")
        await pilot.pause()
        assert log.lines.cursor_row > first and "composite" in log.shown[log.lines.cursor_row].searchable()
        await pilot.press("escape")
        await pilot.pause()
        assert log.bar_mode is None and app.focused is log.lines
        await pilot.press("ctrl+g")
        await pilot.pause()
        await pilot.press("9", "enter")
        await pilot.pause()
        assert "no step 9: steps 0–4 are shown" in str(log.query_one("#log-bar-status").render())
        log.query_one("#log-bar-input").value = ""
        await pilot.press("3", "enter")
        await pilot.pause()
        assert log.cursor_entry.record["step"] == 3 and log.bar_mode is None
        # A filter keeps the reason line: it is the cursor row's, whichever rows pass.
        main.query_one("#filter-arm").value = "fused"
        await pilot.pause()
        assert len(log.shown) == 5 * engine.config.n_layers  # A's attention layers (B decides unfused)
        assert "why (A step 4 L1 attn)" in str(log.query_one("#log-why").render())


@synchronously
async def test_the_log_exports_the_rows_it_shows(engine, tmp_path):
    from engine.errors import UserError
    from inspector.records import COLUMNS

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = await run_prompt(pilot, app, "hello", max_tokens=3)
        with pytest.raises(UserError, match="'.html' names no format"):
            main.export_log(str(tmp_path / "log.html"))
        main.export_log(str(tmp_path / "log.csv"))
        lines = (tmp_path / "log.csv").read_text().splitlines()
        assert lines[0].split(",") == list(COLUMNS) and len(lines) == 1 + 2 * 3 * 2 * engine.config.n_layers
        main.query_one("#filter-side").value = "A"
        await pilot.pause()
        main.export_log(str(tmp_path / "log.json"))
        exported = json.loads((tmp_path / "log.json").read_text())
        assert exported["filters"] == {"side": "A"} and len(exported["rows"]) == 3 * 2 * engine.config.n_layers
        assert {row["config"] for row in exported["rows"]} == {"A"} and exported["flags"]["B"]["moe_gate"] == "reference"
        main.export_log(str(tmp_path / "log.jsonl"))
        assert len((tmp_path / "log.jsonl").read_text().splitlines()) == len(exported["rows"])


# --------------------------------------------------------------------------------------------
# Sizes, footers, the palette
# --------------------------------------------------------------------------------------------

@synchronously
async def test_narrow_screens_fold_the_flags_and_the_counters(engine):
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        main = app.main_screen
        flags = main.query_one(FlagsPanel)
        assert main.narrow and not flags.display and main.query_one("#counters").compact
        assert main.query_one("#log").size.width >= 76  # the log gets the width
        await pilot.press("f6")
        await pilot.pause(0.2)
        assert flags.display and app.focused.id == "control-moe_gate"
        await pilot.press("f6")
        await pilot.pause()
        assert not flags.display and app.focused.id == "prompt"
    async with make_app(engine).run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        main = pilot.app.main_screen
        assert not main.narrow and main.query_one(FlagsPanel).display and not main.query_one("#counters").compact


@synchronously
async def test_escape_closes_the_narrow_flags_overlay_before_it_cancels_a_run(engine):
    """On a narrow screen escape did nothing to the flags panel lying over the log; it closes it, and only
    once it is closed does escape cancel the running generation."""
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        def footer_says(key: str) -> str | None:
            active = app.screen.active_bindings.get(key)
            return active.binding.description if active is not None and active.binding.show else None

        await pilot.pause()
        main = app.main_screen
        flags = main.query_one(FlagsPanel)
        assert footer_says("escape") is None
        await pilot.press("f6")
        await pilot.pause(0.2)
        assert flags.display and footer_says("escape") == "Close"
        assert footer_says("f6") is None  # in its place, so Quit still fits 80 columns (the snapshot shows it)
        await pilot.press("escape")
        await pilot.pause()
        assert not flags.display and app.focused.id == "prompt" and footer_says("escape") is None
        assert footer_says("f6") == "Flags"
        put = main.queue.put

        def slow_put(event):  # a run that outlasts the keys below however fast the machine generates
            if isinstance(event, events.StepEvent):
                time.sleep(0.02)
            put(event)

        main.queue.put = slow_put
        assert main.start_run("hello", "400")
        await wait_until(pilot, lambda: len(main.current_run.tokens[events.A]) >= 2)
        await pilot.press("f6")
        await pilot.pause(0.2)
        assert flags.display and footer_says("escape") == "Close"
        await pilot.press("escape")
        await pilot.pause()
        assert not flags.display and not main.current_run.cancel.is_set()  # the overlay only
        assert footer_says("escape") == "Cancel"
        await pilot.press("escape")
        await wait_until(pilot, lambda: not main.current_run.running)
        assert main.current_run.cancelled


@synchronously
async def test_every_screen_has_its_own_footer_keys(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        def shown() -> set[str]:
            return {binding.key for _, binding, _, _ in app.screen.active_bindings.values() if binding.show}

        await pilot.pause()
        # at 200 columns every screen key the README lists is in the footer
        assert {"f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8", "f9", "f10", "ctrl+q", "ctrl+s", "ctrl+o"} <= shown()
        assert "escape" not in shown()  # cancel: only while something runs
        await pilot.resize_terminal(80, 24)
        await pilot.pause()
        assert {"f1", "f2", "f3", "f6", "f7", "f8", "ctrl+q", "enter"} <= shown()  # what fits 80 columns, Quit too
        assert not {"f4", "f5", "f9", "f10", "ctrl+s", "ctrl+o", "ctrl+j"} & shown()
        await pilot.resize_terminal(*SIZE)
        await pilot.pause()
        for key, expected, absent in (("f1", {"escape"}, "f2"), ("f4", {"escape"}, "f2"), ("ctrl+o", {"escape"}, "f2"), ("ctrl+t", {"escape"}, "f2"),
                                      ("f2", {"escape"}, "f3"), ("f8", {"ctrl+r"}, "f2")):
            await pilot.press(key)
            await pilot.pause()
            assert app.screen is not app.main_screen, key
            assert expected <= shown() and absent not in shown(), (key, shown())
            assert app.screen.query("Footer"), key  # its own footer, not the main screen's
            await pilot.press("escape")
            await pilot.pause()


def test_every_palette_key_hint_is_a_real_binding():
    from inspector.screens.palette import ACTIONS
    from inspector.widgets.prompt_bar import PromptArea

    keys = set()
    for bindings in (MainScreen.BINDINGS, InspectorApp.BINDINGS, PromptArea.BINDINGS):
        for binding in bindings:
            keys.update(binding.key.split(","))
    for title, key, _, action in ACTIONS:
        if key and "/" not in key:
            assert key in keys or key == "enter", (title, key)
        name = action.split(".", 1)[1]
        owner = MainScreen if action.startswith("screen.") else InspectorApp
        assert hasattr(owner, f"action_{name}"), action


@synchronously
async def test_the_attention_check_says_in_place_when_triton_is_missing(engine, monkeypatch):
    from inspector.screens import attention_check

    monkeypatch.setattr(attention_check, "triton_installed", lambda: False)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, AttentionCheckScreen)
        shown = str(screen.query_one("#check-output").render())
        assert "triton cannot be imported here" in shown and "pip install triton" in shown
        await pilot.press("f7")
        await pilot.pause()
        assert not screen.running and app.screen is screen  # nothing ran, nothing crashed


@synchronously
async def test_bench_runs_a_against_b_and_is_there_on_the_next_visit(engine):
    from inspector.screens.bench import BenchScreen

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f8")
        await pilot.pause()
        screen = app.screen
        for name, value in (("pp", "8"), ("tg", "6"), ("batch", "1"), ("reps", "1")):
            screen.query_one(f"#bench-{name}").value = value
        screen.query_one("#bench-config").value = "A,B"
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: not screen.running and len(screen.reports) == 2, timeout=60)
        await pilot.pause()
        assert [(row["config"], row["test"]) for row in screen.rows] == [("A", "pp8"), ("A", "tg6"), ("B", "pp8"),
                                                                          ("B", "tg6")]
        assert screen.query_one("#bench-latency").row_count == 4
        assert "B / A, t/s (wall): pp8 " in str(screen.query_one("#bench-ratio").render())
        benches = [action for action in app.actions if action["action"] == "bench"]
        assert [action["flags"]["moe_gate"] for action in benches] == ["measured", "reference"]  # A, then B
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("f8")
        await pilot.pause()
        again = app.screen
        assert isinstance(again, BenchScreen) and again is not screen
        assert again.query_one("#bench-rows").row_count == 4 and len(again.rows) == 4
        assert again.query_one("#bench-config").value == "A,B" and again.query_one("#bench-tg").value == "6"
        assert "kept from your last visit" in str(again.query_one("#bench-status").render())


@synchronously
async def test_profiled_microseconds_that_arrive_with_the_end_of_a_side_reach_the_log(engine):
    """On a GPU under layer_timing=profile, replayed steps' µs are written into their records when the run
    ends (engine.layer_timing.attribute): the side's end renders the log's rows again from them."""
    from engine.layer_timing import PROFILED

    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        main = await run_prompt(pilot, app, "hello", max_tokens=3)
        log = main.query_one(DispatchLog)
        entry = next(entry for entry in log.shown if entry.side == events.A and entry.op == "moe")
        assert entry.cells()[10] == ""  # untimed run: no µs yet
        entry.record["us"], entry.record["us_method"] = 12.3, PROFILED  # what attribute() does, in place
        generation = main.current_run.generations[events.A]
        assert any(record is entry.record for step in generation.steps for record in step["moe"])
        main.on_side_finished(events.SideFinished(main.current_run.id, events.A, generation))
        await pilot.pause()
        row = log.shown.index(next(shown for shown in log.shown if shown.record is entry.record))
        assert str(log.lines.get_row_at(row)[10]) == "12.3"


def test_a_title_names_only_values_off_their_defaults():
    """A session the TUI saved sets every flag, most to its default: A's title names only what differs."""
    from inspector.screens.main import describe_changed

    every = {name: spec.default for name, spec in flag_registry.SPECS.items()}
    saved = flag_registry.resolve([], session={**{n: flag_registry.format_value(n, v) for n, v in every.items()},
                                               "tile_m": 32}, environ={})
    assert describe_changed(saved) == "tile_m=32"
    assert describe_changed(flag_registry.resolve([], session={"tile_m": 16}, environ={})) == "default flags"


@synchronously
async def test_the_palette_clears_a_long_prompt_and_ctrl_z_brings_it_back(engine):
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        prompt = app.main_screen.query_one("#prompt")
        long_prompt = "\n".join(f"line {index} of a pasted prompt" for index in range(16))
        prompt.value = long_prompt
        app.main_screen.action_clear_prompt()
        await pilot.pause()
        assert prompt.value == "" and app.focused is prompt
        await pilot.press("ctrl+z")
        await pilot.pause()
        assert prompt.value == long_prompt
