"""TUI defects a newcomer found, each driven through `App.run_test()` (CPU, tiny model)."""

from __future__ import annotations

import pytest
from test_tui_sessions import make_app, synchronously

from engine.errors import UserError
from engine.runtime import Engine
from inspector.widgets.status_bar import StatusBar

SIZE = (200, 50)
pytestmark = pytest.mark.usefixtures("pinned_environment")  # conftest: no calibration, no MOEI_*


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


@synchronously
async def test_a_failed_autosave_stays_in_the_status_bar_until_a_save_succeeds(engine, tmp_path, monkeypatch):
    """A recording that could not be saved was one toast among others; the status bar said nothing."""
    app = make_app(engine, tmp_path / "s.toml")
    notes = []
    original_notify = app.notify
    monkeypatch.setattr(app, "notify", lambda message, **kwargs: (notes.append((message, kwargs)),
                                                                   original_notify(message, **kwargs)))
    async with app.run_test(size=SIZE) as pilot:
        record = app.session.record

        def failing(action, outcome=None):
            raise UserError("s.toml: cannot write it")
        monkeypatch.setattr(app.session, "record", failing)
        app.record_action({"action": "curve"})
        await pilot.pause()
        bar = app.main_screen.query_one(StatusBar)
        assert "NOT SAVED: the last curve was not recorded" in bar.session
        assert any("not recorded in the session: s.toml: cannot write it" in message
                   and kwargs.get("severity") == "error" for message, kwargs in notes)
        monkeypatch.setattr(app.session, "record", record)
        app.record_action({"action": "curve"})
        await pilot.pause()
        assert "NOT SAVED" not in bar.session and "1 step" in bar.session


@synchronously
async def test_ctrl_s_refuses_a_name_without_toml_before_asking_to_replace_it(engine, tmp_path):
    """ctrl+s onto an existing notes.txt first asked `exists: Enter again to replace it`, then refused the name."""
    from textual.widgets import Input, Static

    from inspector.screens.session_path import SessionPathScreen

    notes = tmp_path / "notes.txt"
    notes.write_text("keep")
    app = make_app(engine, tmp_path / "s.toml")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+s")
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, SessionPathScreen)
        dialog.query_one(Input).value = str(notes)
        await pilot.press("enter")
        await pilot.pause()
        shown = str(dialog.query_one("#session-refusal", Static).content)
        assert "a session file ends in .toml" in shown and "exists" not in shown
        assert notes.read_text() == "keep"
