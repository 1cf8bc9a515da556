"""Snapshots (pytest-textual-snapshot) of the main screen and the tile-fill screen.

Deterministic on purpose: the tiny preset with seed 0, a fixed terminal size, untimed runs (the
µs column stays empty), no clock on screen, cursors that do not blink, and the run finished
before the picture is taken. Regenerate with `pytest tests/test_tui_snapshots.py --snapshot-update`
and look at the SVGs under tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import pytest
from textual.widgets import Input

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector.app import InspectorApp

SIZE = (180, 50)
PROMPT = "The quick brown fox jumps over"  # 30 bytes: longer than tiny's attention window of 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


def make_app(engine: Engine) -> InspectorApp:
    return InspectorApp(engine, flag_registry.resolve([], environ={}), timed=False)


async def steady(pilot) -> None:
    for box in pilot.app.screen.query(Input):
        box.cursor_blink = False
    await pilot.pause()


async def drop_the_mask_and_run(pilot) -> None:
    """fused_mask=drop in A, then one 12-token run: the panes diverge and the log fills."""
    main = pilot.app.main_screen
    main.set_flag("fused_mask", "drop")
    main.query_one("#prompt").value = PROMPT
    main.query_one("#max-tokens").value = "12"
    assert main.start_run(PROMPT, "12")
    for _ in range(600):
        if not main.current_run.running:
            break
        await pilot.pause(0.05)
    assert not main.current_run.running
    lines = main.query_one("#log-lines")
    for _ in range(100):  # the log scrolls to its end after a refresh
        await pilot.pause(0.02)
        if lines.scroll_y == lines.max_scroll_y > 0:
            break
    await steady(pilot)


def test_main_screen_after_a_diverging_run(snap_compare, engine):
    assert snap_compare(make_app(engine), terminal_size=SIZE, run_before=drop_the_mask_and_run)


def test_tile_fill_screen(snap_compare, engine):
    async def run_then_open_tile_fill(pilot) -> None:
        await drop_the_mask_and_run(pilot)
        await pilot.press("f2")
        await pilot.pause(0.2)
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZE, run_before=run_then_open_tile_fill)
