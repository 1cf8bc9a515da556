"""Hostile input to every parser, generated: session files (as TOML text and as parsed values),
safetensors headers, results lines, calibration files and JSON in general. Each may only return
its value or raise UserError (one line for the user), never anything else, within bounded time.
A failure the generator finds becomes a named fixture under tests/fixtures/hostile/ (checked by
`test_named_fixtures_are_refused_in_one_line`), so it stays found on every machine.

Examples per property are bounded by the hypothesis profile in conftest.py (fewer on CI).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, strategies as st  # noqa: E402

from engine import calibration  # noqa: E402
from engine.checkpoint import read_header  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.json_input import parse_json  # noqa: E402
from engine.printable import printable, unprintable_characters  # noqa: E402
from inspector.session import Session, dumps_session, load_session, loads_session, parse_session  # noqa: E402
from inspector.session_runner import diff_step, read_results  # noqa: E402
from inspector.session_report import render, render_replay  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent
SESSIONS = REPOSITORY / "sessions"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hostile"

# JSON-like values: what tomllib and json.loads can hand a parser (TOML adds nothing a parser sees
# differently), including the awkward ones: huge and negative integers, non-finite floats, control
# characters and lone surrogates in strings, nesting.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["prompt", "curve", "bench", "check-attention", "honor", "drop", "base", "tiny", "\x1b[2J",
                     "\udcff", "\u202e", "", "a" * 300]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["action", "prompt", "max_tokens", "name", "tokens", "k", "experts", "tile_m", "seq_len",
                     "mode", "pp", "tg", "batch", "reps", "config", "compare", "a", "b", "x"]) | st.text(max_size=6),
    inner, max_size=5), max_leaves=12)


def only_user_errors(function, *args):
    """Call `function`; a UserError is fine (and must read as one line), anything else fails the test."""
    try:
        return function(*args)
    except UserError as error:
        message = str(error)
        assert "\n" not in printable(message, limit=None)
        return error


# --------------------------------------------------------------------------------------------
# Session files
# --------------------------------------------------------------------------------------------

VALID_STEP = {"action": "prompt", "prompt": "hi", "max_tokens": 2}


@given(session=st.dictionaries(st.sampled_from(["session", "engine", "flags", "config", "step", "extra"]), VALUES,
                               max_size=5),
       step=st.dictionaries(st.sampled_from(list(VALID_STEP) + ["config", "tokens", "seq_len", "mode", "reps"]),
                            VALUES, max_size=4))
def test_the_session_parser_accepts_or_refuses_any_values(session, step):
    session = {"session": {"version": 1, "name": "x"}, **session}
    only_user_errors(parse_session, session, "x.toml")
    only_user_errors(parse_session, {"session": {"version": 1, "name": "x"}, "step": [{**VALID_STEP, **step}]},
                     "x.toml")


QUICKSTART = (SESSIONS / "quickstart.toml").read_text()


@given(position=st.integers(min_value=0, max_value=len(QUICKSTART)), junk=st.text(max_size=40) | st.sampled_from(
    ["[" * 600, "{a=" * 600, "9" * 5000, "inf", "nan", "\x00", "\"\\u001b\"", "[[step]]\n", "= =", "\udcff"]))
def test_session_text_with_anything_inserted_parses_or_is_refused(position, junk):
    text = QUICKSTART[:position] + junk + QUICKSTART[position:]
    result = only_user_errors(loads_session, text, "quickstart.toml")
    if isinstance(result, Session):  # what parses must be printable where it is shown, and round-trip
        assert not unprintable_characters(result.name)
        assert loads_session(dumps_session(result), "rewritten") == result


@given(data=st.binary(max_size=200))
def test_session_bytes_that_are_not_utf8_are_refused(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("bytes") / "s.toml"
    path.write_bytes(b'[session]\nversion = 1\nname = "x"\n' + data)
    only_user_errors(load_session, path)


# --------------------------------------------------------------------------------------------
# JSON, safetensors headers, results lines, calibration files
# --------------------------------------------------------------------------------------------

@given(text=st.text(max_size=60) | st.sampled_from(["[" * 5000, '{"a":' * 3000, "9" * 400, "NaN", "1e999",
                                                    "-Infinity", '"\\ud800"', "[1,]"]))
def test_the_json_reader_returns_finite_values_or_refuses(text):
    value = only_user_errors(parse_json, text, "f.json")

    def finite(item):
        if isinstance(item, float):
            assert math.isfinite(item)
        elif isinstance(item, list):
            for element in item:
                finite(element)
        elif isinstance(item, dict):
            for element in item.values():
                finite(element)

    if not isinstance(value, UserError):
        finite(value)


HEADER_ENTRIES = st.dictionaries(
    st.text(max_size=8) | st.just("__metadata__"),
    st.fixed_dictionaries({}, optional={
        "dtype": st.sampled_from(["F32", "BF16", "U8", "F8", ""]) | VALUES,
        "shape": st.lists(st.integers(min_value=-2, max_value=2**40), max_size=9) | VALUES,
        "data_offsets": st.lists(st.integers(min_value=-8, max_value=64), min_size=2, max_size=2) | VALUES,
    }) | VALUES, max_size=4)


@given(header=HEADER_ENTRIES | VALUES, data=st.binary(max_size=64), claimed=st.none() | st.integers(0, 2**64 - 1))
@example(header={"": {"dtype": "", "data_offsets": [0, 0], "shape": []}}, data=b"", claimed=None)  # an empty dtype
def test_the_safetensors_header_reader_never_trusts_a_number(header, data, claimed, tmp_path_factory):
    raw = json.dumps(header).encode()
    length = len(raw) if claimed is None else claimed
    path = tmp_path_factory.mktemp("header") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", length) + raw + data)
    result = only_user_errors(read_header, path)
    if isinstance(result, dict):
        size = path.stat().st_size - 8 - len(raw)
        for entry in result.values():  # every entry the reader kept lies inside the file
            assert all(isinstance(extent, int) and extent >= 0 for extent in entry.shape)
            assert entry.dtype and isinstance(entry.dtype, str)
        assert length == len(raw) and size >= 0
    else:
        assert str(length) not in str(result) or length < 2**20  # a hostile length is never printed


@given(data=st.binary(max_size=64))
def test_any_bytes_as_a_safetensors_file_are_refused_or_read(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("raw") / "model.safetensors"
    path.write_bytes(data)
    only_user_errors(read_header, path)


@given(document=VALUES)
def test_a_calibration_file_of_anything_never_breaks_a_lookup(document, tmp_path_factory):
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    path.write_text(json.dumps(document))
    result = calibration.find_crossover("cpu", 2, 8, 64, 32, 16, path)
    assert result is None or (isinstance(result, int) and result >= 1)
    only_user_errors(calibration.check_writable, path)


# --------------------------------------------------------------------------------------------
# Results lines: mutations of a real recording, then everything replay and the reports do with it
# --------------------------------------------------------------------------------------------

RECORDED = """[session]
version = 1
name = "recorded"
[engine]
model = "tiny"
[[config]]
name = "unfused"
flash_512 = false
[[step]]
action = "prompt"
prompt = "hi"
max_tokens = 2
compare = "unfused"
[[step]]
action = "curve"
tokens = [1, 64]
[[step]]
action = "bench"
pp = [4]
reps = 1
"""


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """A small session's results, recorded once: one side-by-side prompt, a curve, a bench row."""
    import torch

    from inspector.session_runner import dumps_results, run_session

    directory = tmp_path_factory.mktemp("recording")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outcome = run_session(loads_session(RECORDED, "recorded.toml"), "recorded.toml", "cpu")
    finally:
        torch.set_num_threads(threads)
    return directory, dumps_results(outcome.header, outcome.steps), outcome


def _paths(value, prefix=()):
    """Every path into a JSON value (keys and indexes)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


def _mutated(line: dict, path: tuple, replacement, delete: bool) -> dict:
    line = json.loads(json.dumps(line))
    if not path:
        return replacement if not delete else {}
    parent = line
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return line


@given(data=st.data())
def test_a_mutated_results_line_is_read_and_diffed_or_refused(recording, data):
    directory, text, outcome = recording
    lines = [json.loads(line) for line in text.splitlines()]
    index = data.draw(st.integers(0, len(lines) - 1), label="line")
    paths = list(_paths(lines[index]))
    path = data.draw(st.sampled_from(paths), label="path")
    replacement = data.draw(VALUES, label="replacement")
    delete = data.draw(st.booleans(), label="delete")
    lines[index] = _mutated(lines[index], path, replacement, delete)
    results = directory / f"mutated-{index}.results.jsonl"
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    read = only_user_errors(read_results, results, "recorded.toml")
    if isinstance(read, UserError):
        return
    header, recorded = read
    # What was read must carry every key the readers use: no KeyError or TypeError from here on.
    for old, new in zip(recorded, outcome.steps):
        if old.get("action") == new["action"]:
            diff_step(old, new)
    render_replay(header, recorded, outcome.header, outcome.steps, [])
    render(header, recorded, "md", None)


# --------------------------------------------------------------------------------------------
# Named fixtures: cases the generators (or the issue) found, kept as files
# --------------------------------------------------------------------------------------------

def _session_fixtures():
    return sorted((FIXTURES / "sessions").glob("*.toml"))


@pytest.mark.parametrize("path", _session_fixtures(), ids=lambda path: path.stem)
def test_named_session_fixtures_are_refused_in_one_line(path):
    """Refused by the parser, or (sizes that depend on the model and the machine) by the preflight
    `run` does before anything runs."""
    from inspector.session_runner import preflight

    with pytest.raises(UserError) as error:
        preflight(load_session(path), str(path), "cpu")
    message = str(error.value)
    assert str(path.name) in message and "\n" not in message and "\x1b" not in message


@pytest.mark.parametrize("path", sorted((FIXTURES / "results").glob("*.jsonl")), ids=lambda path: path.stem)
def test_named_results_fixtures_are_refused_in_one_line(path):
    with pytest.raises(UserError) as error:
        read_results(path, "session.toml")
    assert path.name in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("path", sorted((FIXTURES / "headers").glob("*.safetensors")), ids=lambda path: path.stem)
def test_named_header_fixtures_are_refused_in_one_line(path):
    with pytest.raises(UserError) as error:
        read_header(path)
    message = str(error.value)
    assert path.name in message and "\n" not in message
    (length,) = struct.unpack("<Q", path.read_bytes()[:8].ljust(8, b"\0"))
    assert length < 2**20 or str(length) not in message  # a text file's first 8 bytes are not a number to print


def test_a_counters_family_recorded_as_null_is_diffed_as_no_launches():
    """The schema lets a run's or a bench row's `arms` / `kernels` (and a row's counters) be null; the diff reads
    them as no launches. Hypothesis found `"arms": null` raising a TypeError in diff_step."""
    from inspector.session_runner import diff_bench, diff_step

    def step(arms):
        return {"step": 1, "action": "prompt", "runs": [{"config": "A", "tokens": [1, 2], "decisions": [],
                                                         "counters": {"arms": arms, "kernels": {"k": 1}}}]}

    assert diff_step(step(None), step({"gemv": 2})) == ["step 1 (prompt), config A: counters differ: "
                                                         "gemv recorded 0, now 2"]
    assert diff_step(step(None), step(None)) == []
    row = {"test": "tg8", "counters": {"arms": {"gemv": 3}, "kernels": None, "steps": 8}}
    assert diff_bench("step 2 (bench)", {"rows": [row]}, {"rows": [dict(row, counters=None)]}) == [
        "step 2 (bench), row tg8: gemv launches recorded 3, now 0; steps recorded 8, now None"]


def test_a_counters_family_recorded_as_null_reports_as_nothing_counted():
    """The report's "ran (counters)" column reads a null `arms` / `kernels` family as nothing counted. Hypothesis
    found `"kernels": null` raising an AttributeError in the markdown report."""
    from inspector.session_report import executed_summary

    assert executed_summary({"counters": {"arms": {"gemv": 2, "reference": 0}, "kernels": None}}) == "gemv 2"
    assert executed_summary({"counters": {"arms": None, "kernels": {"moe_gemv.down": 3}}}) == "; kernels moe_gemv.down 3"
    assert executed_summary({"counters": {}}) == ""


def test_optional_fields_recorded_as_null_are_read_as_absent():
    """A header's flags and a bench or sweep step's rows may be missing or null (the results schema): the report and
    the diff read null as absent, as they read a missing key."""
    from inspector.session_report import render_markdown
    from inspector.session_runner import diff_bench

    row = {"test": "tg8", "counters": {"arms": {"gemv": 3}, "steps": 8}}
    assert diff_bench("step 2 (bench)", {"rows": None}, {"rows": None}) == []
    assert diff_bench("step 2 (bench)", {"rows": [row]}, {"rows": [row]}) == []
    header = {"kind": "header", "schema": 1, "flags": None, "model": "tiny"}
    steps = [{"kind": "step", "step": 1, "action": "bench", "definition": {}, "status": "ok", "runs": [],
              "numbers": {"rows": None}, "check": None, "wall_s": 0.1}]
    report = render_markdown(header, steps)  # no AttributeError on the null flags, no TypeError on the null rows
    assert "1 step" in report and "flags: \n" in report
