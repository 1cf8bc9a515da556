"""The TUI's A/B screen (f9): it opens an `ab --json-out` report, lists its rows with their verdicts or
refusals, plots the highlighted row's rounds, and refuses a file that is not a report in place."""

from __future__ import annotations

import asyncio
import json

import pytest
from textual.widgets import DataTable, Input, Static

from engine import ab, ab_stats
from engine import flags as flag_registry
from engine.runtime import Engine
from inspector.app import InspectorApp
from inspector.screens.ab import AbScreen
from tests.test_ab import REPO, StubProcess, bench_json


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load("tiny", "cpu", 0)


def stub_report(path) -> dict:
    made = {}
    for name, overrides in (("A", {"moe_gate": "tile-fill"}), ("B", {"moe_gate": "floor"})):
        flags = dict(flag_registry.from_environment({}).with_overrides(overrides, "command line").values)
        made[name] = ab.Side(name, ab.Tree(REPO, "x", "this tree"), overrides, flags, [])

    def outputs(side, call):
        rows = json.loads(bench_json(100.0 + (12 if side.name == "B" else 0) + (call or 0) * 0.1))["rows"]
        rows.append(dict(rows[0], test="tg64", state="admitting" if side.name == "B" else "steady",
                         tps_device={"mean": 1e4}, tps_wall={"mean": 1e4}))
        return json.dumps({"rows": rows})

    report = ab.run_ab(made, ab.Workload("bench", "bench tg32, tg64", []), 6, 0,
                       launcher=lambda side: StubProcess(side, outputs)).to_json()
    path.write_text(json.dumps(report))
    return report


def test_the_ab_screen_shows_rows_verdicts_and_rounds(engine, tmp_path):
    report_path = tmp_path / "ab.json"
    report = stub_report(report_path)
    assert report["rows"][0]["verdict"] == ab_stats.SLOWER and report["rows"][1]["refused"]

    async def scenario():
        app = InspectorApp(engine, flag_registry.resolve([], environ={}), timed=False)
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.press("f9")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, AbScreen)
            screen.query_one("#ab-path", Input).value = "/no/such/report.json"
            await pilot.press("enter")
            await pilot.pause()
            assert "refused: /no/such/report.json: no such file" in str(screen.query_one("#ab-status", Static).render())
            screen.query_one("#ab-path", Input).value = str(report_path)
            screen.query_one("#ab-path", Input).focus()
            await pilot.press("enter")
            await pilot.pause()
            table = screen.query_one("#ab-rows", DataTable)
            assert table.row_count == 2
            first = [str(cell) for cell in table.get_row_at(0)]
            assert first[0] == "tg32" and first[-1] == "slower" and first[4].startswith("1.1")
            second = [str(cell) for cell in table.get_row_at(1)]
            assert second[-1].startswith("refused: ")
            assert screen.plotted == ("tg32: slower", {"A": 6, "B": 6})
            await pilot.press("down")
            await pilot.pause()
            assert screen.plotted[0].startswith("tg64: refused (")
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, AbScreen)

    asyncio.run(scenario())


def test_palette_and_help_offer_the_ab_screen():
    from inspector.screens.help import KEYS
    from inspector.screens.palette import ACTIONS

    assert any(action == "screen.ab" for _, _, _, action in ACTIONS)  # (title, key, help, action)
    assert any(key == "f9" for key, _ in KEYS)


def _accepted_renders(report: dict, tmp_path) -> bool:
    """load_report either refuses the file in one line or returns a report every row of which renders."""
    from engine.ab_report import row_cells
    from engine.errors import UserError
    from inspector.screens.ab import load_report

    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(report))
    try:
        loaded = load_report(str(path))
    except UserError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        return False
    for row in loaded["rows"]:
        row_cells(row)
    return True


def test_a_report_the_screen_cannot_show_is_refused_in_place(tmp_path):
    good = stub_report(tmp_path / "ab.json")
    assert _accepted_renders(good, tmp_path)
    hostile_rows = [{"name": 5}, "x", None, {"row": "tg32"}, dict(good["rows"][0], a={"median": "1"}),
                    dict(good["rows"][0], interval=[1]), dict(good["rows"][0], values={"A": ["x"]}),
                    dict(good["rows"][0], verdict=None), {"row": "tg32", "refused": 3},
                    {"row": "r", "refused": "gone", "values": {"A": ["x", "y"]}},
                    {"row": "r", "refused": "gone", "values": [1, 2]},
                    {"row": "r", "refused": "gone", "a": 5, "values": {"A": [1, 2]}},
                    {"row": "r", "refused": "gone", "a": {"median": "x"}, "values": {"A": [1, 2]}}]
    for row in hostile_rows:
        assert not _accepted_renders(dict(good, rows=[row]), tmp_path), row
    for key, value in (("sides", []), ("sides", {"A": {"overrides": 1}}), ("runs", [{"side": "A"}]),
                       ("failure", {"line": "x"}), ("workload", "bench")):
        assert not _accepted_renders(dict(good, **{key: value}), tmp_path), key


def test_generated_reports_are_refused_or_shown(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = stub_report(tmp_path / "ab.json")
    leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4)
    value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.sampled_from(["row", "unit", "a", "b", "median", "mad_rel", "ratio",
                                                            "interval", "verdict", "values", "A", "B", "refused"]),
                                           inner, max_size=4), max_leaves=12)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(index=st.integers(0, len(good["rows"]) - 1), field=st.sampled_from(sorted(good["rows"][0])), new=value)
    def one(index, field, new):
        rows = [dict(row) for row in good["rows"]]
        rows[index][field] = new
        _accepted_renders(dict(good, rows=rows), tmp_path)

    one()


def test_a_row_name_with_brackets_is_shown_as_written(engine, tmp_path):
    """A row named "[/x]" was read as markup by the table and ended the app."""
    report_path = tmp_path / "ab.json"
    report = stub_report(report_path)
    report["rows"][0]["row"] = "[/x]"
    report_path.write_text(json.dumps(report))

    async def scenario():
        app = InspectorApp(engine, flag_registry.resolve([], environ={}), timed=False)
        async with app.run_test(size=(160, 48)) as pilot:
            app.push_screen(AbScreen(str(report_path)))
            await pilot.pause()
            table = app.screen.query_one("#ab-rows", DataTable)
            assert str(table.get_row_at(0)[0]) == "[/x]"
            assert "2 rows" in str(app.screen.query_one("#ab-status", Static).render())

    asyncio.run(scenario())
