"""The A/B screen: an `moe-inspector ab` report (its --json-out file): one line per row (each side's median, B/A
with its interval, the verdict or the refusal) and the highlighted row's rounds as a plot, A and B per round
(textual-plotext). It reads a saved report; it runs nothing, so it never competes with the engine for the GPU
(an A/B needs the device to itself: `moe-inspector ab` runs it headless)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static
from textual_plotext import PlotextPlot

from engine.ab_report import row_cells
from engine.errors import UserError

COLUMNS = ("row", "unit", "A median (MAD)", "B median (MAD)", "B/A", "95 % interval", "verdict")


def load_report(path: str) -> dict:
    """An A/B report JSON, or a UserError naming what is wrong with the file."""
    where = Path(path).expanduser()
    try:
        report = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; write one with `moe-inspector ab ... --json-out {shlex.quote(str(path))}`") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"{path}: not a JSON A/B report ({type(error).__name__})") from None
    if not isinstance(report, dict) or report.get("kind") != "ab" or not isinstance(report.get("rows"), list):
        raise UserError(f"{path}: not an A/B report (no kind \"ab\" with rows); `moe-inspector ab --json-out` writes one")
    problem = shape_problem(report)
    if problem is not None:
        raise UserError(f"{path}: not an A/B report as `moe-inspector ab --json-out` writes one: {problem}")
    return report


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_problem(row) -> str | None:
    """What in one row the screen cannot show (None: nothing): the fields engine.ab_report.row_cells and the plot
    read, with their types."""
    if not isinstance(row, dict) or not isinstance(row.get("row"), str):
        return "not an object with a \"row\" name"
    if not isinstance(row.get("unit", ""), str):
        return "its \"unit\" is not text"
    values = row.get("values", {})  # plotted for a refused row too
    if not isinstance(values, dict) or any(not isinstance(values.get(side, []), list)
                                           or not all(v is None or _number(v) for v in values.get(side, []))
                                           for side in ("A", "B")):
        return "its \"values\" are not lists of numbers per side"
    refused = row.get("refused")
    for side in ("a", "b"):  # a refused row may lack them; where present, they are drawn as the medians
        data = row.get(side)
        if (data is not None or not refused) and (
                not isinstance(data, dict) or not _number(data.get("median")) or not _number(data.get("mad_rel"))):
            return f"its side {side!r} has no numeric median and mad_rel"
    if refused:
        return None if isinstance(refused, str) else "its \"refused\" is not text"
    if not _number(row.get("ratio")) or not isinstance(row.get("verdict"), str) or "unit" not in row:
        return "it lacks a numeric \"ratio\", a \"verdict\" or a \"unit\""
    interval = row.get("interval")
    if interval is not None and not (isinstance(interval, list) and len(interval) == 2 and all(map(_number, interval))):
        return "its \"interval\" is not two numbers"
    return None


def shape_problem(report: dict) -> str | None:
    """The first field of an A/B report the screen could not show, in words (None: every one it reads is
    there, with its type): a hand-edited or foreign JSON is refused in place instead of failing as it is drawn."""
    for index, row in enumerate(report["rows"]):
        problem = _row_problem(row)
        if problem is not None:
            return f"rows[{index}]: {problem}"
    sides = report.get("sides", {})
    if not isinstance(sides, dict) or not all(isinstance(sides.get(name, {}), dict)
                                              and isinstance(sides.get(name, {}).get("overrides", {}), dict)
                                              for name in ("A", "B")):
        return "\"sides\" is not an object of sides A and B with their overrides"
    runs = report.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(run, dict) and isinstance(run.get("round"), int)
                                             for run in runs):
        return "\"runs\" is not a list of runs with their rounds"
    failure = report.get("failure")
    if failure and not (isinstance(failure, dict) and "side" in failure and "line" in failure):
        return "\"failure\" names no side and line"
    if not isinstance(report.get("workload", {}), dict):
        return "\"workload\" is not an object"
    return None


class AbScreen(Screen):
    DEFAULT_CSS = """
    #ab-path-row { height: auto; max-height: 10; }
    #ab-path { width: 2fr; }
    #ab-status { width: 1fr; padding-left: 1; height: auto; }
    #ab-sides { height: auto; max-height: 4; }
    #ab-rows { height: 1fr; max-height: 12; }
    #ab-plot { height: 2fr; min-height: 10; }
    """
    BINDINGS = [Binding("escape,f9", "app.pop_screen", "Back"),
                Binding("ctrl+l", "focus_path", "Report file", show=False)]

    def __init__(self, path: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.report: dict | None = None
        self.plotted: tuple[str, dict] | None = None  # the plot's title and points per side (what tests read)

    def compose(self) -> ComposeResult:
        with Horizontal(id="ab-path-row"):
            yield Input(self.path or "", placeholder="A/B report JSON (ab --json-out FILE): path, then Enter",
                        compact=True, id="ab-path")
            yield Static("", id="ab-status", markup=False)
        yield Static("", id="ab-sides")
        yield DataTable(id="ab-rows", cursor_type="row", zebra_stripes=True)
        yield PlotextPlot(id="ab-plot")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ab-rows", DataTable).add_columns(*COLUMNS)
        if self.path:
            self.load(self.path)
        else:
            self.query_one("#ab-path", Input).focus()

    def action_focus_path(self) -> None:
        self.query_one("#ab-path", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.load(event.value.strip())

    def load(self, path: str) -> None:
        status = self.query_one("#ab-status", Static)
        try:
            report = load_report(path)
        except UserError as error:
            status.update(f"refused: {error}")
            return
        self.path, self.report = path, report
        sides = report.get("sides", {})
        lines = [f"{report.get('workload', {}).get('describe', '')}"]
        for name in ("A", "B"):
            side = sides.get(name, {})
            flags = ", ".join(f"{key}={value}" for key, value in side.get("overrides", {}).items()) or "no overrides"
            lines.append(f"{name}: {side.get('tree', '?')}; {flags}")
        if report.get("failure"):
            lines.append(f"stopped: side {report['failure']['side']}: {report['failure']['line']}")
        self.query_one("#ab-sides", Static).update("\n".join(lines))
        rows, rounds = len(report["rows"]), len({run["round"] for run in report.get("runs", [])})
        status.update(f"{rows} row{'' if rows == 1 else 's'}, {rounds} round{'' if rounds == 1 else 's'}")
        table = self.query_one("#ab-rows", DataTable)
        table.clear()
        for index, row in enumerate(report["rows"]):
            table.add_row(*(Text(cell) for cell in row_cells(row)), key=str(index))  # as typed: "[/x]" is no markup
        if report["rows"]:
            table.move_cursor(row=0)
            self.draw(0)
            table.focus()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if self.report is not None and event.row_key is not None and event.row_key.value is not None:
            self.draw(int(event.row_key.value))

    def draw(self, index: int) -> None:
        """Row `index`'s rounds: A and B's time per round, each side's median as a line."""
        row = self.report["rows"][index]
        plt = self.query_one("#ab-plot", PlotextPlot).plt
        plt.clear_figure()
        values = row.get("values", {})
        title = row["row"] + (f": refused ({row['refused']})" if row.get("refused") else
                              f": {row['verdict']}, B/A {row['ratio']:.4f}")
        plt.title(title + " · A blue, B orange, lines at the medians")
        counts = {}
        for side, color in (("A", "blue"), ("B", "orange")):
            points = [(number + 1, value) for number, value in enumerate(values.get(side, [])) if value is not None]
            counts[side] = len(points)
            if points:
                plt.plot([x for x, _ in points], [y for _, y in points], marker="dot", color=color)
                if row.get(side.lower()):
                    plt.hline(row[side.lower()]["median"], color)
        self.plotted = (title.split(", B/A")[0], counts)
        plt.xlabel(f"x: round · y: {row.get('unit') or 'time'}")  # one line: plotext's y label covers the x one
        self.query_one("#ab-plot", PlotextPlot).refresh()
