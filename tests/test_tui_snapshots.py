"""Snapshots (pytest-textual-snapshot) of the screens at the three sizes the inspector must read well
at: 80x24, 100x30 and 200x50.

Deterministic on purpose: the tiny preset with seed 0, untimed runs (the µs column stays empty),
no clock on screen, cursors that do not blink, and the run finished before the picture is taken.
Regenerate with `pytest tests/test_tui_snapshots.py --snapshot-update` and look at the SVGs under
tests/__snapshots__/ before committing them.
"""

from __future__ import annotations

import pytest

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector.app import InspectorApp

SIZES = {"80x24": (80, 24), "100x30": (100, 30), "200x50": (200, 50)}
PROMPT = "The quick brown fox jumps over"  # 30 bytes: longer than tiny's attention window of 16


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


def make_app(engine: Engine) -> InspectorApp:
    return InspectorApp(engine, flag_registry.resolve([], environ={}), timed=False)


async def steady(pilot) -> None:
    """No blinking cursor, and every scroll (focus scrolls a widget into view) finished."""
    for widget in pilot.app.screen.query("Input, TextArea"):
        widget.cursor_blink = False
    await pilot.pause(0.2)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


async def drop_the_mask_and_run(pilot) -> None:
    """fused_mask=drop in A, then one 12-token run: the panes diverge and the log fills."""
    main = pilot.app.main_screen
    for widget in main.query("Input, TextArea"):  # before the prompt is drawn again: a TextArea caches its lines
        widget.cursor_blink = False
    main.set_flag("fused_mask", "drop")
    main.query_one("#prompt").value = PROMPT
    main.query_one("#max-tokens").value = "12"
    assert main.start_run(PROMPT, "12")
    for _ in range(600):
        if not main.current_run.running:
            break
        await pilot.pause(0.05)
    assert not main.current_run.running
    await pilot.pause(0.2)
    await steady(pilot)


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_after_a_diverging_run(snap_compare, engine, size):
    assert snap_compare(make_app(engine), terminal_size=SIZES[size], run_before=drop_the_mask_and_run)


@pytest.mark.parametrize("size", ["80x24", "200x50"])
def test_main_screen_with_the_flags_open(snap_compare, engine, size):
    async def open_flags(pilot) -> None:
        await pilot.pause()
        await pilot.press("f6")
        await pilot.pause(0.3)
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZES[size], run_before=open_flags)


def test_a_log_row_in_full(snap_compare, engine):
    async def open_a_row(pilot) -> None:
        await drop_the_mask_and_run(pilot)
        log = pilot.app.main_screen.query_one("#log-lines")
        log.focus()
        log.move_cursor(row=2)  # the prefill's first attention layer: the dropped mask
        await pilot.press("enter")
        await pilot.pause(0.2)
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZES["100x30"], run_before=open_a_row)


def test_help_at_the_smallest_size(snap_compare, engine):
    async def open_help(pilot) -> None:
        await pilot.pause()
        await pilot.press("f1")
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZES["80x24"], run_before=open_help)


def test_tile_fill_screen(snap_compare, engine):
    async def run_then_open_tile_fill(pilot) -> None:
        await drop_the_mask_and_run(pilot)
        await pilot.press("f2")
        await pilot.pause(0.2)
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZES["100x30"], run_before=run_then_open_tile_fill)


def test_bench_screen_before_a_run(snap_compare, engine):
    async def open_bench(pilot) -> None:
        await pilot.pause()
        await pilot.press("f8")
        await pilot.pause(0.2)
        await steady(pilot)

    assert snap_compare(make_app(engine), terminal_size=SIZES["80x24"], run_before=open_bench)
