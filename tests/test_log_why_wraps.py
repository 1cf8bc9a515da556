"""The dispatch log's reason line shows the cursor row's whole reason: at 200x50 a DeepSeek MoE layer's reason
(the gate's words, the execution note, the shared experts' path and why: ~300 characters) wraps over as many
rows as it needs, read here from the rendered line; the line does not shrink when the cursor moves to a shorter
reason (the table keeps its height); a reason longer than WHY_ROWS rows ends in "…" and the hint; on a short
screen (80x24) the line is one row and Enter shows the whole reason.

The model: a tiny DeepSeek-V2-Lite-shaped config.json with random weights, three tokens on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.geometry import Region

from engine.runtime import Engine
from inspector.screens.record import RecordScreen
from inspector.widgets.dispatch_log import WHY_ROWS, DispatchLog
from test_check_mla_model import _tiny_deepseek
from test_tui import make_app, run_prompt, synchronously


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    directory = _tiny_deepseek(Path(tmp_path_factory.mktemp("why")) / "dsv2-tiny")
    return Engine.load(str(directory), "cpu", 0, "random")


def _rendered(widget) -> str:
    """The widget's text as drawn at its size, whitespace squashed (a wrap turns a space into a line break)."""
    strips = widget.render_lines(Region(0, 0, *widget.outer_size))  # padding included: the line as drawn
    return " ".join(" ".join("".join(segment.text for segment in strip).split()) for strip in strips).strip()


def _squashed(text: str) -> str:
    return " ".join(text.split())


def _longest(log: DispatchLog) -> int:
    """The shown row with the longest reason."""
    return max(range(len(log.shown)), key=lambda row: len(log.shown[row].reason()))


async def _at(pilot, log: DispatchLog, row: int) -> None:
    log.follow = False
    log._move_to(row)
    await pilot.pause()


@synchronously
async def test_every_reason_is_shown_whole_at_200x50(engine):
    app = make_app(engine)
    async with app.run_test(size=(200, 50)) as pilot:
        main = await run_prompt(pilot, app, "why so long", max_tokens=3)
        log = main.query_one(DispatchLog)
        line = log.query_one("#log-why")
        longest = _longest(log)
        reason = log.shown[longest].reason()
        assert log.shown[longest].op == "moe" and "shared experts apart" in reason
        assert len(reason) > 2 * line.content_size.width  # more than the two rows the line used to have
        await _at(pilot, log, longest)
        assert _squashed(reason) in _rendered(line) and "enter: the whole decision" in _rendered(line)
        assert line.region.bottom <= log.content_region.bottom  # drawn inside the log, not under its border
        rows = line.size.height
        assert 3 <= rows <= WHY_ROWS
        for row in range(len(log.shown)):  # every row's reason, whole; the line never shrinks under the cursor
            await _at(pilot, log, row)
            assert _squashed(log.shown[row].reason()) in _rendered(line), row
            assert line.size.height == rows


@synchronously
async def test_a_reason_longer_than_the_line_ends_in_an_ellipsis(engine):
    app = make_app(engine)
    async with app.run_test(size=(200, 50)) as pilot:
        main = await run_prompt(pilot, app, "x", max_tokens=1)
        log = main.query_one(DispatchLog)
        record = dict(next(entry.record for entry in log.shown if entry.op == "moe"))
        record.update(step=99, reason="a reason of many words " * 60)
        log.add_steps("A", [{"moe": [record], "attention": []}])
        await _at(pilot, log, len(log.shown) - 1)
        line = log.query_one("#log-why")
        shown = _rendered(line)
        assert line.size.height == WHY_ROWS and shown.endswith("… enter: the whole decision")
        assert shown.startswith("why (A step 99 L") and "a reason of many words" in shown


@synchronously
async def test_a_short_screen_keeps_one_row_and_enter_shows_the_reason_whole(engine):
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        main = await run_prompt(pilot, app, "why so long", max_tokens=2)
        log = main.query_one(DispatchLog)
        longest = _longest(log)
        await _at(pilot, log, longest)
        line = log.query_one("#log-why")
        assert line.size.height == 1 and _rendered(line).endswith("…")
        log.lines.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RecordScreen)
        entry = log.shown[longest]
        body = _rendered(app.screen.query_one("#record-body"))
        for part in (entry.record["reason"], entry.record["execution_note"], entry.record["shared_reason"]):
            assert _squashed(part) in body, part
