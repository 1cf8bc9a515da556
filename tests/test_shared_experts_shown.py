"""Where a MoE record's arm and reason are shown, a layer with shared experts (DeepSeek, Qwen2-MoE) shows their
path too (engine.dispatcher's `shared_path`: folded into the GEMV arm's launches, or apart after the arm) and,
where the reasons are, why (`shared_reason`): the dispatch log's arm cell and reason, the record screen, the
trace's MoE slices, `generate --records`. A layer without shared experts (the presets, Qwen3-MoE, Mixtral)
shows nothing more than before.

The records are real: a tiny DeepSeek-V2-Lite-shaped checkpoint made with transformers (test_hf_deepseek's
builder: 3 layers, the first dense, 2 shared experts) run for a few tokens on the CPU, beside the tiny preset.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from engine import flags as flag_registry  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from inspector import cli  # noqa: E402
from inspector.screens.record import render_entry  # noqa: E402
from inspector.widgets.dispatch_log import LogEntry  # noqa: E402

PATHS = {"apart": "shared apart", "routed launches": "shared folded"}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(directory, engine) of a tiny DeepSeek-V2-Lite-shaped checkpoint."""
    from test_hf_deepseek import _build

    directory = tmp_path_factory.mktemp("deepseek-v2-lite")
    _build("deepseek-v2-lite", directory, 11)
    return directory, Engine.load(str(directory), "cpu")


def _moe_records(engine: Engine, flags=None) -> list[dict]:
    flags = flags or flag_registry.resolve([], environ={})
    return [record for step in engine.generate("shared experts", 3, flags).steps for record in step["moe"]]


def _shown(renderable) -> str:
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("fold", ["off", "on"])
def test_log_rows_and_the_record_screen_show_the_shared_experts_path(deepseek, fold):
    _, engine = deepseek
    records = _moe_records(engine, flag_registry.resolve([f"shared_fold={fold}"], environ={}))
    assert records and all(record.get("shared_path") in PATHS for record in records)
    for record in records:
        entry = LogEntry("A", "moe", record)
        assert entry.arm_text().endswith(f" + {PATHS[record['shared_path']]}")
        assert entry.reason().startswith(record["reason"])
        assert entry.reason().endswith(f" · shared experts {PATHS[record['shared_path']].split()[1]}: "
                                       f"{record['shared_reason']}")
        assert entry.arm_text() in entry.cells() and entry.reason() in entry.cells()
        shown = _shown(render_entry(entry, {}, "cpu"))
        assert "shared experts" in shown and "why that path" in shown
        assert record["shared_reason"].split(":")[0] in shown


def test_a_layer_without_shared_experts_shows_nothing_more():
    tiny = Engine.load("tiny", "cpu", 0)
    for record in _moe_records(tiny):
        assert "shared_path" not in record
        entry = LogEntry("A", "moe", record)
        decided = record["decided_arm"] + (f" v{record['variant']}" if record["variant"] is not None else "")
        assert entry.arm_text() == (decided if record["decided_arm"] == record["executed_arm"]
                                    else f"{decided}→{record['executed_arm']}")
        assert "shared" not in entry.reason() and "shared" not in _shown(render_entry(entry, {}, "cpu"))


def _trace_moe_slices(argv, path, capsys) -> list[dict]:
    code = cli.main([str(part) for part in argv] + ["--trace", str(path)])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    return [event for event in json.loads(path.read_text())["traceEvents"] if event.get("cat") == "moe"]


def test_the_traces_moe_slices_carry_the_shared_experts_path(deepseek, tmp_path, capsys):
    directory, _ = deepseek
    slices = _trace_moe_slices(["generate", "--model", directory, "--device", "cpu", "--prompt", "hi",
                                "--max-tokens", "3"], tmp_path / "deepseek.json", capsys)
    assert slices and {event["args"]["shared_path"] for event in slices} <= set(PATHS)
    assert all(event["args"]["shared_reason"] for event in slices)
    tiny = _trace_moe_slices(["generate", "--model", "tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens",
                              "3"], tmp_path / "tiny.json", capsys)
    assert tiny and not any("shared_path" in event["args"] or "shared_reason" in event["args"] for event in tiny)


def test_generate_records_say_the_shared_experts_path(deepseek, capsys):
    directory, _ = deepseek
    code = cli.main(["generate", "--model", str(directory), "--device", "cpu", "--prompt", "hi", "--max-tokens",
                     "2", "--records"])
    out = capsys.readouterr().out
    assert code == 0 and "· shared experts apart: " in out


def test_the_tui_at_80x24_shows_the_path_in_the_arm_column(deepseek):
    """The arm column (with its path) lies inside the 80 columns; the why line is one row that ends in an
    ellipsis rather than at a hidden wrap."""
    from test_tui import make_app, run_prompt, synchronously

    from inspector.widgets.dispatch_log import DispatchLog

    _, engine = deepseek

    @synchronously
    async def drive():
        app = make_app(engine)
        async with app.run_test(size=(80, 24)) as pilot:
            main = await run_prompt(pilot, app, "shared", max_tokens=3)
            log = main.query_one(DispatchLog)
            row = log.find("shared apart")
            assert row is not None and log.cursor_entry.op == "moe"
            await pilot.pause()
            table = log.lines
            arm_end = sum(column.get_render_width(table) for column in list(table.columns.values())[:6])
            assert arm_end <= table.size.width, (arm_end, table.size.width)
            assert log.cursor_entry.arm_text() in [str(cell) for cell in table.get_row_at(row)]
            why = log.query_one("#log-why")
            assert why.size.height == 1
            assert why.styles.text_wrap == "nowrap" and why.styles.text_overflow == "ellipsis"
            assert "shared experts apart" in str(why.render())

    drive()


def test_the_csv_and_jsonl_rows_carry_the_shared_experts_path(deepseek, capsys):
    """generate --format csv|jsonl (and the TUI's export, the same rows): the last two columns, filled for the
    DeepSeek layers' MoE rows only."""
    directory, _ = deepseek
    code = cli.main(["generate", "--model", str(directory), "--device", "cpu", "--prompt", "hi", "--max-tokens",
                     "2", "--format", "jsonl"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert code == 0 and rows
    moe = [row for row in rows if row["family"] == "moe"]
    assert moe and all(row["shared_path"] == "apart" and row["shared_reason"] for row in moe)
    assert all(row["shared_path"] is None for row in rows if row["family"] == "attention")
    code = cli.main(["generate", "--model", str(directory), "--device", "cpu", "--prompt", "hi", "--max-tokens",
                     "2", "--format", "csv"])
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert code == 0 and header[-6:-4] == ["shared_path", "shared_reason"]
