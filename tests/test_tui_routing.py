"""The TUI's routing screen (f10): the last run's routing (recorded with record_routing = on) as a layer x expert
heatmap and a line per MoE layer, for the whole run, the last step or a window; a routing file opened in place,
a bad one refused in place; the run's routing written to a new file."""

from __future__ import annotations

import numpy as np
from textual.widgets import DataTable, Input, Static

from engine import flags as flag_registry
from engine import routing_file, routing_stats
from inspector.screens.palette import ACTIONS
from inspector.screens.help import KEYS
from inspector.screens.routing import RoutingScreen
from tests.test_tui import RecordingApp, engine, run_prompt, synchronously  # noqa: F401 - the fixture

SIZE = (160, 48)


def _status(screen) -> str:
    return str(screen.query_one("#routing-status", Static).render())


@synchronously
async def test_the_routing_screen_shows_the_last_runs_routing(engine, tmp_path):
    app = RecordingApp(engine, flag_registry.resolve(["record_routing=on"], environ={}), timed=False)
    async with app.run_test(size=SIZE) as pilot:
        main = await run_prompt(pilot, app, "hello routing", max_tokens=5)
        recording = main.current_run.generations["A"].routing
        assert recording is not None and recording.n_steps == 5  # a prefill step, then 4 decode steps
        await pilot.press("f10")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RoutingScreen)
        table = screen.query_one("#routing-layers", DataTable)
        assert table.row_count == engine.config.n_layers
        whole = screen.summary
        assert whole.steps == 5 and whole.tokens == recording.tokens == len(b"hello routing") + 4
        expected = np.stack([np.bincount(recording.ids[:, layer].reshape(-1), minlength=engine.config.n_experts)
                             for layer in range(engine.config.n_layers)])
        assert (whole.load == expected).all()
        heat = str(screen.query_one("#routing-map", Static).render())
        assert heat.count("\nL") == engine.config.n_layers and "█" in heat
        first = [str(cell) for cell in table.get_row_at(0)]
        assert first[1] == str(recording.tokens) and first[-1].count("%") == 3  # the three hottest, named
        await pilot.press("l")
        await pilot.pause()
        assert screen.summary.steps == 1 and screen.summary.tokens == 1  # the last decode step: one token
        await pilot.press("w")
        await pilot.pause()
        assert screen.summary.scope.kind == "window" and screen.summary.steps == 5  # 16 steps: all 5
        await pilot.press("minus", "minus", "minus")
        await pilot.pause()
        assert screen.window == 2 and screen.summary.steps == 2
        # a bad file is refused in place; the run's routing stays on screen
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"\x10\x00\x00")
        box = screen.query_one("#routing-path", Input)
        box.value = str(bad)
        box.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert _status(screen).startswith(f"refused: {bad}: 3 bytes: truncated")
        assert screen.summary.steps == 2
        # ctrl+r writes the run's routing to a new file; an existing file is not replaced
        written = tmp_path / "run.safetensors"
        box.value = str(written)
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert _status(screen).startswith(f"wrote {written}")
        again = routing_file.load(written)
        assert (again.ids == recording.ids).all() and (again.steps == recording.steps).all()
        size = written.stat().st_size
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert "exists" in _status(screen) and written.stat().st_size == size
        # and Enter opens it
        await pilot.press("enter")
        await pilot.pause()
        assert screen.source == str(written) and screen.summary.tokens == 2  # the window of 2 one-token steps
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, RoutingScreen)


@synchronously
async def test_without_a_recording_the_screen_says_how_to_make_one(engine):
    app = RecordingApp(engine, flag_registry.resolve([], environ={}), timed=False)
    async with app.run_test(size=SIZE) as pilot:
        await run_prompt(pilot, app, "hi", max_tokens=2)
        await pilot.press("f10")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RoutingScreen) and screen.recording is None
        assert "record_routing = on" in _status(screen)
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert _status(screen).startswith("refused: no routing recorded")


def test_palette_and_help_offer_the_routing_screen():
    assert any(action == "screen.routing" and key == "f10" for _, key, _, action in ACTIONS)
    assert any(key == "f10" for key, _ in KEYS)


def test_the_heatmap_bins_wide_expert_axes_by_their_maximum():
    load = np.zeros(256, np.int64)
    load[200] = 9  # one hot expert among 256, shown in 64 cells: its cell keeps its value
    binned = routing_stats.bin_load(load, 64)
    assert binned.shape == (64,) and binned.max() == 9 and np.count_nonzero(binned) == 1
    assert routing_stats.heat_strip(load, 64).strip() == "█"
