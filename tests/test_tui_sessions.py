"""Sessions and the bench in the TUI, driven through Pilot on `tiny` (CPU, seconds).

The round trip of a session (record in the TUI -> save as -> `run` headless -> `replay` headless),
opening a session (a malformed one refused in place), the replay screen (steps, both sides, a
verdict per step, a tampered recording found), and the bench screen (rows and the
progress bar, a refused measurement).
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from textual.widgets import DataTable, Input, ProgressBar

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector import events
from inspector.app import InspectorApp
from inspector.cli import main
from inspector.screens.bench import BenchScreen
from inspector.screens.replay import DIFFERS, MATCH, ReplayScreen
from inspector.screens.session_path import SessionPathScreen
from inspector.screens.tile_fill import TileFillScreen
from inspector.session import BenchStep, CurveStep, PromptStep, load_session
from inspector.session_runner import read_results, results_path_for
from inspector.tui import TuiSession
from inspector.widgets.dispatch_log import DispatchLog

SIZE = (200, 50)
REPOSITORY = Path(__file__).resolve().parent.parent
FIXTURES = REPOSITORY / "tests" / "fixtures" / "sessions"
LONGER_THAN_TINY_WINDOW = "The quick brown fox jumps over the lazy dog"  # 43 bytes > tiny's window of 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


pytestmark = pytest.mark.usefixtures("pinned_environment")  # conftest: no calibration, no MOEI_*


def synchronously(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return run


def make_app(engine: Engine, session_path: Path) -> InspectorApp:
    flags = flag_registry.resolve([], environ={})
    session = TuiSession.start(session_path, engine, {"model": "tiny", "device": "cpu", "seed": 0}, flags)
    app = InspectorApp(engine, session.starting_flags() if session_path.exists() else flags, timed=False,
                       session=session)
    app.messages = []
    return app


async def wait_until(pilot, condition, timeout: float = 30.0) -> None:
    waited = 0.0
    while not condition():
        assert waited < timeout, "timed out waiting for the app"
        await pilot.pause(0.05)
        waited += 0.05


async def run_prompt(pilot, app: InspectorApp, prompt: str, max_tokens: int) -> None:
    main_screen = app.main_screen
    main_screen.query_one("#max-tokens").value = str(max_tokens)
    main_screen.query_one("#prompt").value = prompt
    main_screen.query_one("#prompt").focus()
    await pilot.press("enter")
    await wait_until(pilot, lambda: main_screen.current_run is not None and not main_screen.current_run.running)
    await pilot.pause()


async def type_path(pilot, app: InspectorApp, key: str, path: str) -> SessionPathScreen:
    await pilot.press(key)
    await pilot.pause()
    dialog = app.screen
    assert isinstance(dialog, SessionPathScreen)
    dialog.query_one(Input).value = path
    await pilot.press("enter")
    await pilot.pause()
    return dialog


def text_of(widget) -> str:
    """What a Static shows, as plain text (rich renderables such as Group included)."""
    content = widget.content
    if isinstance(content, str):
        return content
    console = Console(record=True, width=240, file=io.StringIO())
    console.print(content)
    return console.export_text()


@synchronously
async def test_round_trip_record_in_the_tui_save_run_and_replay_headless(engine, tmp_path, capsys):
    autosave = tmp_path / "autosave.toml"
    app = make_app(engine, autosave)
    async with app.run_test(size=SIZE, message_hook=app.messages.append) as pilot:
        main_screen = app.main_screen
        main_screen.set_flag("fused_mask", "drop")  # before any step: the session's starting [flags]
        await pilot.pause()
        await run_prompt(pilot, app, LONGER_THAN_TINY_WINDOW, 6)
        main_screen.set_flag("tile_m", 32)  # after a step: the next step's config
        await pilot.pause()
        await run_prompt(pilot, app, "hello", 4)
        for _ in range(2):  # the curve screen opened twice with the same state: one curve step
            await pilot.press("f2")
            await pilot.pause()
            assert isinstance(app.screen, TileFillScreen)
            await pilot.press("escape")
            await pilot.pause()
        assert "autosave.toml · 3 steps" in text_of(main_screen.query_one("#status"))
        saved = load_session(autosave)  # autosaved after every action
        assert [type(step) for step in saved.steps] == [PromptStep, PromptStep, CurveStep]
        assert saved.flags["fused_mask"] == "drop" and saved.steps[1].config == "tile_m=32"
        assert saved.steps[2].tile_m == 32

        mine = tmp_path / "mine.toml"
        dialog = await type_path(pilot, app, "ctrl+s", str(tmp_path / "not-a-session.txt"))
        assert app.screen is dialog and ".toml" in dialog.refusal  # refused in place
        dialog.query_one(Input).value = str(mine)
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is main_screen and app.session.path == mine
        assert "mine.toml · 3 steps" in text_of(main_screen.query_one("#status"))
        steps_seen = of_type(app, events.SessionChanged)
        assert steps_seen and steps_seen[-1].steps == 3
        # the dispatch log's export never writes over the open session or its recording, asked twice or not
        recording = results_path_for(mine).read_bytes()
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.screen.query_one(Input).value == str(tmp_path / "dispatch-log.csv")  # beside the session
        await pilot.press("escape")
        await pilot.pause()
        dialog = await type_path(pilot, app, "ctrl+t", str(results_path_for(mine)))
        assert "the open session's results file, which this command must not overwrite" in dialog.refusal  # at once,
        await pilot.press("enter")  # and again at the Enter that would replace another existing file
        await pilot.pause()
        assert app.screen is dialog and "the open session's results file, which this command must not overwrite" \
            in dialog.refusal, dialog.refusal
        await pilot.press("escape")
        await pilot.pause()
        assert results_path_for(mine).read_bytes() == recording
        # a name of no export format is refused before the question about replacing an existing file
        precious = tmp_path / "precious.toml"
        precious.write_text("kept = true\n")
        dialog = await type_path(pilot, app, "ctrl+t", str(precious))
        assert "'.toml' names no format" in dialog.refusal, dialog.refusal
        assert "Enter again" not in str(dialog.query_one("#session-refusal").render())
        await pilot.press("escape")
        await pilot.pause()

    # What the TUI saw is the recording: a headless replay of it matches, tokens, counters and decisions.
    header, lines = read_results(results_path_for(mine), str(mine))
    assert header["device"] == "cpu" and [line["step"] for line in lines] == [1, 2, 3]
    assert len(lines[0]["runs"]) == 2 and lines[0]["numbers"]["first_divergence"] is not None  # drop vs honor
    assert main(["replay", str(mine)]) == 0, capsys.readouterr().err
    assert main(["run", str(mine)]) == 0, capsys.readouterr().err
    assert main(["replay", str(mine)]) == 0, capsys.readouterr().err


def of_type(app, kind: type) -> list:
    unique = {id(message): message for message in app.messages if isinstance(message, kind)}
    return list(unique.values())


@synchronously
async def test_open_refuses_a_malformed_session_in_place_and_keeps_the_current_one(engine, tmp_path):
    app = make_app(engine, tmp_path / "current.toml")
    async with app.run_test(size=SIZE) as pilot:
        current = app.session
        dialog = await type_path(pilot, app, "ctrl+o", str(FIXTURES / "unknown_key.toml"))
        assert app.screen is dialog and app.session is current
        shown = text_of(dialog.query_one("#session-refusal"))
        assert "step 2 (prompt)" in shown and "unknown key 'promt'" in shown  # the parser's own message
        nameless = tmp_path / "nameless.toml"
        nameless.write_text('[session]\nversion = 1\n[engine]\nmodel = "tiny"\n')
        dialog.query_one(Input).value = str(nameless)
        await pilot.press("enter")
        await pilot.pause()
        shown = str(dialog.query_one("#session-refusal").render())
        assert "[session]: missing key 'name'" in shown, shown  # the table's name is text, not markup
        dialog.query_one(Input).value = str(REPOSITORY / "sessions" / "gate-policies.toml")  # a demo session
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is dialog and "a session for model demo" in dialog.refusal and app.session is current
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.main_screen and app.session is current


def recorded_quickstart(tmp_path: Path, capsys) -> Path:
    """sessions/quickstart.toml (tiny: a prompt, a side-by-side prompt, a curve), run headless."""
    path = tmp_path / "quickstart.toml"
    path.write_text((REPOSITORY / "sessions" / "quickstart.toml").read_text())
    assert main(["run", str(path), "--device", "cpu"]) == 0
    capsys.readouterr()
    return path


async def open_and_replay(pilot, app: InspectorApp, path: Path) -> ReplayScreen:
    await type_path(pilot, app, "ctrl+o", str(path))
    assert app.session.path == path and app.screen is app.main_screen
    await pilot.press("f7")
    await pilot.pause()
    assert isinstance(app.screen, ReplayScreen)
    return app.screen


@synchronously
async def test_replay_screen_steps_forward_and_back_with_both_sides_and_a_verdict(engine, tmp_path, capsys):
    path = recorded_quickstart(tmp_path, capsys)
    app = make_app(engine, tmp_path / "current.toml")
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_and_replay(pilot, app, path)
        assert app.main_screen.flags["moe_gate"] == "tile-fill"  # A where the session left off
        await wait_until(pilot, lambda: 1 in screen.results)
        await pilot.pause()
        assert screen.verdict(1) == MATCH and "step 1: match" in text_of(screen.query_one("#replay-verdict"))
        recorded, rerun = text_of(screen.query_one("#replay-recorded")), text_of(screen.query_one("#replay-rerun"))
        for side in (recorded, rerun):
            assert "config base" in side and "8 tokens after" in side and "ran (counters): reference" in side
        await pilot.press("right")
        await wait_until(pilot, lambda: 2 in screen.results)
        await pilot.pause()
        assert screen.index == 2 and screen.verdict(2) == MATCH
        assert "config unfused" in text_of(screen.query_one("#replay-rerun"))
        await pilot.press("n")
        await wait_until(pilot, lambda: 3 in screen.results)
        await pilot.pause()
        assert screen.verdict(3) == MATCH and "m-tiles amortize from 64" in text_of(screen.query_one("#replay-rerun"))
        await pilot.press("right")  # the last step stays the last
        await pilot.press("left", "p")
        await pilot.pause()
        assert screen.index == 1 and "step 1: match" in text_of(screen.query_one("#replay-verdict"))
        assert "1✓" in text_of(screen.query_one("#replay-overview"))


@synchronously
async def test_opening_a_session_clears_the_last_runs_panes_and_a_flag_change_retitles_a(engine, tmp_path, capsys):
    """After ctrl+o the A pane was cleared but B kept the last run's tokens and 'A and B agree on all 48 tokens';
    a flag changed in the panel left A's title naming the flags of its shown tokens."""
    path = recorded_quickstart(tmp_path, capsys)
    app = make_app(engine, tmp_path / "current.toml")
    async with app.run_test(size=SIZE) as pilot:
        main_screen = app.main_screen
        await run_prompt(pilot, app, "hello", 4)
        assert main_screen.query_one("#pane-b").tokens and main_screen.query_one(DispatchLog).shown
        main_screen.set_flag("tile_m", 32)
        await pilot.pause()
        pane_a = main_screen.query_one("#pane-a")
        assert "tile_m=32" in pane_a.border_title and "before this configuration" in pane_a.border_subtitle
        await type_path(pilot, app, "ctrl+o", str(path))
        assert app.session.path == path and app.screen is main_screen
        assert not main_screen.query_one("#pane-a").tokens and not main_screen.query_one("#pane-b").tokens
        assert not main_screen.query_one(DispatchLog).shown and main_screen.current_run is None
        assert "no run yet" in text_of(main_screen.query_one("#divergence-line"))


@synchronously
async def test_replay_screen_shows_a_tampered_recording_as_differs(engine, tmp_path, capsys):
    path = recorded_quickstart(tmp_path, capsys)
    results = results_path_for(path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    tokens = lines[2]["runs"][1]["tokens"]  # step 2, config unfused
    tokens[3] = (tokens[3] + 1) % 256
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    app = make_app(engine, tmp_path / "current.toml")
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_and_replay(pilot, app, path)
        await pilot.press("right")
        await wait_until(pilot, lambda: 2 in screen.results)
        await pilot.pause()
        assert screen.verdict(2) == DIFFERS
        verdict = text_of(screen.query_one("#replay-verdict"))
        assert "step 2: differs" in verdict and "config unfused: generated token 3 differs" in verdict
        assert "first differing token: 3" in text_of(screen.query_one("#replay-recorded"))


@synchronously
async def test_bench_screen_runs_rows_fills_the_progress_bar_and_records_a_step(engine, tmp_path):
    app = make_app(engine, tmp_path / "bench.toml")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f8")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, BenchScreen)
        assert "kernel shares need a GPU" in text_of(screen.query_one("#bench-shares-note"))
        for name, value in (("pp", "16"), ("tg", "8"), ("batch", "1,2"), ("reps", "1")):
            screen.query_one(f"#bench-{name}", Input).value = value
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: screen.report is not None)
        await pilot.pause()
        bar = screen.query_one("#bench-progress", ProgressBar)
        assert bar.total == 4 * 2 and bar.progress == bar.total  # 4 rows x (warm-up + 1 rep)
        table = screen.query_one("#bench-rows", DataTable)
        assert table.row_count == 4 and [row["test"] for row in screen.rows] == ["pp16", "pp16 @ b2", "tg8", "tg8 @ b2"]
        assert "tiny (float32) on cpu" in text_of(screen.query_one("#bench-footer"))
        (step,) = app.session.session.steps
        assert step == BenchStep(pp=[16], tg=[8], batch=[1, 2], reps=1)
        _, (line,) = read_results(app.session.results_path, "bench")
        assert [row["test"] for row in line["numbers"]["rows"]] == ["pp16", "pp16 @ b2", "tg8", "tg8 @ b2"]


@synchronously
async def test_bench_screen_shows_rows_as_they_are_timed_and_kernel_shares_after_every_row(engine, tmp_path):
    # run_bench profiles after every row is timed (a profiler session slows later CUDA calls): the screen gets
    # each row from on_row, then the shares. A CPU has no profile, so a wrapper adds one to each finished row.
    from engine import bench

    seen = []

    def profiled_bench(*args, on_row=None, **kwargs):
        def arrived(row):
            seen.append((row.spec.name, row.profile))
            on_row(row)

        report = bench.run_bench(*args, on_row=arrived, **kwargs)
        for index, row in enumerate(report.rows):
            row.profile = [{"kernel": f"k_{row.spec.name}", "device_us": 2.0, "calls": 4, "share": 0.5,
                            "launches_per_step": 1.0}]
            if index == 0:  # what the kernel adds to the step's span; a profile without step markers has none
                row.profile[0]["critical_us_per_step"] = 1.75
            row.profile_note = "stub shares"
        return report

    app = make_app(engine, tmp_path / "shares.toml")
    async with app.run_test(size=SIZE) as pilot:
        screen = BenchScreen(engine, app.main_screen.flags, app.engine_lock, run_bench=profiled_bench)
        app.push_screen(screen)
        await pilot.pause()
        screen.query_one("#bench-pp", Input).value = "16"
        screen.query_one("#bench-tg", Input).value = "none"
        screen.query_one("#bench-batch", Input).value = "1,2"
        screen.query_one("#bench-reps", Input).value = "1"
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: not screen.running and screen.report is not None)
        await pilot.pause()
        assert seen == [("pp16", None), ("pp16 @ b2", None)]  # each row sent before any profile ran
        kernels = screen.query_one("#bench-kernels", DataTable)
        assert kernels.display and kernels.row_count == 2
        assert [kernels.get_row_at(i)[1] for i in range(2)] == ["k_pp16", "k_pp16 @ b2"]
        assert [kernels.get_row_at(i)[6] for i in range(2)] == ["1.75", "—"]  # the adds µs/step column
        assert "kernel shares, stub shares" in text_of(screen.query_one("#bench-shares-note"))
        assert [row["test"] for row in screen.rows] == ["pp16", "pp16 @ b2"]


@synchronously
async def test_bench_screen_shows_a_refused_measurement_instead_of_a_table(engine, tmp_path):
    app = make_app(engine, tmp_path / "refused.toml")
    async with app.run_test(size=SIZE) as pilot:
        screen = BenchScreen(engine, app.main_screen.flags, app.engine_lock, clock=lambda: 0.0)  # time stands still
        app.push_screen(screen)
        await pilot.pause()
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: not screen.running and screen.refused is not None)
        await pilot.pause()
        refusal = text_of(screen.query_one("#bench-refusal"))
        assert "refused: pp16, warm-up: zero time" in refusal and "no table" in refusal
        assert not screen.query_one("#bench-rows").display and screen.query_one("#bench-refusal").display
        assert app.session.session.steps == ()  # nothing measured, nothing recorded
        screen.query_one("#bench-reps", Input).value = "0"
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert "reps '0'" in text_of(screen.query_one("#bench-refusal"))  # bad input refused in place


@synchronously
async def test_palette_and_help_offer_the_session_screens(engine, tmp_path):
    from inspector.screens.help import KEYS

    keys = " ".join(key for key, _ in KEYS)
    assert all(key in keys for key in ("f7", "f8", "ctrl+s", "ctrl+o", "ctrl+r"))
    app = make_app(engine, tmp_path / "palette.toml")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"replay")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, ReplayScreen)
        assert "the session has no steps to compare yet" in text_of(app.screen.query_one("#replay-head"))
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"save ses")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert isinstance(app.screen, SessionPathScreen) and app.screen.mode == "save"


def test_launch_refuses_a_malformed_or_mismatched_session_before_the_app_starts(capsys):
    from argparse import Namespace

    from inspector.tui import launch

    def args(session: Path, model: str = "demo") -> Namespace:
        return Namespace(model=model, device="cpu", seed=0, session=str(session), set_flags=[])

    assert launch(args(FIXTURES / "not_toml.toml")) == 2
    error = capsys.readouterr().err
    assert "not valid TOML" in error and "loading" not in error
    assert launch(args(REPOSITORY / "sessions" / "gate-policies.toml", model="tiny")) == 2
    error = capsys.readouterr().err
    assert "records model demo, and --model says tiny" in error and "loading" not in error


def test_recorded_results_of_other_weights_are_set_aside_on_opening(engine, tmp_path, capsys):
    """The TUI's replay (f7) compares against the recorded results it loaded: recorded with other weights, they
    are set aside with the reason, as replay refuses them headless; the same weights keep them."""
    path = recorded_quickstart(tmp_path, capsys)
    kept = TuiSession.open(path, engine)
    assert sorted(kept.lines) == [1, 2, 3] and not kept.note
    results = results_path_for(path)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    lines[0]["weights"] = "random, seed 7"
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    opened = TuiSession.open(path, engine)
    assert opened.lines == {}
    assert "recorded results not used: recorded with weights 'random, seed 7', the model now loads " \
           "'random, seed 0'; replay re-runs only" in opened.note
    assert results.read_text().splitlines()[0] == json.dumps(lines[0])  # the file is left as it is


@synchronously
async def test_a_session_path_that_does_not_exist_opens_as_a_new_session(engine, tmp_path):
    """`--session typo.toml` starts a session rather than refusing, and says so where the user looks."""
    app = make_app(engine, tmp_path / "typo.toml")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        shown = [notification.message for notification in app._notifications]
        assert any(message.startswith(f"new session (no such file yet): recording into session {tmp_path}/typo.toml")
                   for message in shown), shown
