"""A session's compare step with `b_model`: B on another model than [engine] model (a trellis checkpoint against
the model it was quantized from, as `compare --b-model` sets them), recorded, replayed, and refused with one line
naming the step where B cannot be set beside A. Built on a tiny Qwen2-MoE made with transformers and quantized to
2-bit hyb here (about a second on a CPU)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from engine.trellis_job import parse_experts, quantize_model  # noqa: E402
from inspector import cli  # noqa: E402
from test_trellis_families import _build, _with_other_tokenizer  # noqa: E402

PROMPT = "routed experts"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the directory holding source/ and hyb2/, source, hyb2): a Qwen2-MoE and its trellis checkpoint."""
    root = tmp_path_factory.mktemp("b-model")
    source = _build("qwen2-moe", root / "source")
    quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), root / "hyb2", device="cpu")
    return root, source, root / "hyb2"


def _run(argv, capsys):
    code = cli.main([str(part) for part in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _session(path, model: str, steps: list[dict], weights: str = "auto"):
    lines = ['[session]', 'version = 1', 'name = "b-model"', '', '[engine]', f'model = "{model}"', 'device = "cpu"',
             f'weights = "{weights}"']
    for step in steps:
        lines += ['', '[[step]]'] + [f'{key} = {json.dumps(value)}' for key, value in step.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _compare(b_model: str) -> dict:
    return {"action": "compare", "prompt": PROMPT, "max_tokens": 3, "a": "base", "b": "base", "b_model": b_model}


def test_a_session_compares_a_trellis_checkpoint_with_its_source_and_replays(models, tmp_path, capsys):
    root, source, target = models
    copy = tmp_path / "source-copy"  # B by path, beside the session; changed below to make replay refuse
    shutil.copytree(source, copy)
    session = _session(tmp_path / "s.toml", str(target), [_compare("source"), _compare("source-copy")])
    code, out, err = _run(["run", session], capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in (tmp_path / "s.results.jsonl").read_text().splitlines()]
    first, second = lines[1], lines[2]
    assert first["definition"]["b_model"] == "source" and "model" not in first["runs"][0]
    assert first["runs"][1]["model"]["checkpoint"]["path"] == str(source.resolve())
    assert second["runs"][1]["model"]["checkpoint"]["path"] == str(copy.resolve())
    assert first["runs"][1]["tokens"] == second["runs"][1]["tokens"]  # the same weights by either name
    code, alone, err = _run(["generate", "--model", source, "--device", "cpu", "--prompt", PROMPT, "--max-tokens", "3",
                             "--no-progress", "--json"], capsys)
    assert code == 0 and first["runs"][1]["tokens"] == json.loads(alone)["tokens"], err
    assert first["numbers"]["max_logit_rel_err"] > 1e-3  # A is the trellis model: the quantization's error

    code, out, err = _run(["replay", session, "--json"], capsys)
    assert code == 0 and json.loads(out)["matches"], err
    code, out, err = _run(["replay", session], capsys)
    assert code == 0 and f"| base on {source.resolve()} |" in out, out

    weights = next(copy.glob("*.safetensors"))
    before = (tmp_path / "s.results.jsonl").read_bytes()
    with weights.open("ab") as handle:  # another size: other weights than the recording's
        handle.write(b"\0" * 8)
    code, out, err = _run(["replay", session], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "step 2's b_model was recorded with weight files" in err and "nothing was re-run" in err
    assert (tmp_path / "s.results.jsonl").read_bytes() == before


def test_the_replay_screen_renders_a_b_model_step_whose_sides_share_a_config(models, tmp_path, capsys):
    """A compare step with b_model runs A and B as config base both: the F7 screen pairs each run with the same
    position in the other recording (by name it paired A with B, saw a divergence, and then crashed)."""
    from inspector.screens.replay import render_runs

    _, _, target = models
    session = _session(tmp_path / "s.toml", str(target), [_compare("source")])
    code, _, err = _run(["run", session], capsys)
    assert code == 0, err
    line = json.loads((tmp_path / "s.results.jsonl").read_text().splitlines()[1])
    assert [run["config"] for run in line["runs"]] == ["base", "base"]
    assert line["runs"][0]["tokens"] != line["runs"][1]["tokens"]  # A and B differ: a name pairing would say so
    text = "\n".join(part.plain for part in render_runs(line, line, {}))
    assert "first differing token" not in text and "config base on " in text  # B names its model
    changed = json.loads(json.dumps(line))
    changed["runs"][1]["tokens"][0] += 1
    text = "\n".join(part.plain for part in render_runs(line, changed, {}))
    assert text.count("first differing token: 0") == 1


@pytest.mark.parametrize("model, b_model, weights, said", [
    ("hyb2", "nowhere", "auto", "nowhere: does not exist"),
    ("hyb2", "tiny", "auto", "b_model tiny: its vocabulary has 256 tokens and A's 320"),
    ("source", "source", "auto", "b_model source: [engine] model"),
    ("hyb2", "source", "random", 'b_model source with [engine] weights = "random"'),
])
def test_a_b_model_that_cannot_stand_beside_a_is_refused_before_anything_loads(models, tmp_path, capsys, model,
                                                                               b_model, weights, said):
    root, _, _ = models
    session = _session(tmp_path / "s.toml", str(root / model), [_compare(b_model)], weights)
    before = session.read_bytes()
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert said in err and "step 1 (compare): b_model " in err and "loading" not in err, err
    assert session.read_bytes() == before and not (tmp_path / "s.results.jsonl").exists()


@pytest.mark.parametrize("value, said", [('""', "key 'b_model' must be a non-empty string"), ('" "', "b_model is blank"),
                                         ('"a\\u001b[2Jb"', "control or format characters"),
                                         ("3", "b_model")])
def test_a_malformed_b_model_is_a_parse_error(tmp_path, capsys, value, said):
    session = tmp_path / "s.toml"
    session.write_text('[session]\nversion = 1\nname = "x"\n[engine]\nmodel = "tiny"\n[[step]]\naction = "compare"\n'
                       f'prompt = "hi"\na = "base"\nb = "base"\nb_model = {value}\n')
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and said in err and "step 1 (compare)" in err, err


def test_a_check_quant_step_whose_source_moved_is_refused_before_any_step_and_original_fixes_it(models, tmp_path,
                                                                                              capsys):
    """The source a trellis checkpoint records, moved: the session stopped at its check-quant step, half-way, with
    advice to give --original, which `run` does not take. Now run's preflight names the step, and the step's own
    `original` key points at the moved source."""
    _, source, _ = models
    shutil.copytree(source, tmp_path / "src")
    quantize_model(str(tmp_path / "src"), parse_experts("trellis:K=2,code=hyb"), tmp_path / "hyb2", device="cpu")
    (tmp_path / "src").rename(tmp_path / "src-moved")
    capsys.readouterr()  # quantize's progress
    prompt = {"action": "prompt", "prompt": PROMPT, "max_tokens": 2}
    session = _session(tmp_path / "s.toml", "hyb2", [prompt, {"action": "check-quant", "tokens": [3]}])
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "step 2 (check-quant): the source" in err and "does not exist: was it moved?" in err
    assert 'Set original = "PATH" in the step' in err and not (tmp_path / "s.results.jsonl").exists()
    session = _session(tmp_path / "s.toml", "hyb2", [prompt, {"action": "check-quant", "tokens": [3],
                                                              "original": "src-moved", "expect": "dequantized"}])
    code, out, err = _run(["run", session], capsys)
    assert code == 0, err
    line = json.loads((tmp_path / "s.results.jsonl").read_text().splitlines()[2])
    assert line["status"] == "ok" and line["numbers"]["rows"][0]["verdict"] == "dequantized"
    session = _session(tmp_path / "s.toml", "hyb2", [{"action": "check-quant", "original": "tiny"}])
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and "step 1 (check-quant): original = tiny is not the model" in err, err


def test_the_tui_runs_b_on_its_own_model_and_records_a_replayable_compare_step(models, tmp_path, capsys):
    """`moe-inspector --model DIR --b-model source`: pane B runs the source's bf16 experts beside A's codes, and
    the session records the run as a compare step with b_model, which `replay` re-runs headless."""
    import asyncio

    from engine import flags as flag_registry
    from engine.runtime import Engine
    from inspector import b_model
    from inspector.app import InspectorApp
    from inspector.tui_session import TuiSession

    _, source, target = models
    engine = Engine.load(str(target), "cpu")
    plan = b_model.plan_for(str(target), "source", "auto", 0)
    engine_b = b_model.load_for(plan, "cpu", engine, None, progress=False, model_a=str(target))
    flags = flag_registry.resolve([], environ={})
    path = tmp_path / "tui.toml"
    session = TuiSession.start(path, engine, {"model": str(target), "device": "cpu", "seed": 0}, flags)
    app = InspectorApp(engine, flags, timed=False, session=session, engine_b=engine_b, b_model="source")
    seen = {}

    async def drive():
        async with app.run_test(size=(120, 40)) as pilot:
            main = app.main_screen
            main.query_one("#max-tokens").value = "3"
            main.query_one("#prompt").value = PROMPT
            main.query_one("#prompt").focus()
            await pilot.press("enter")
            for _ in range(600):
                await pilot.pause(0.05)
                if main.current_run is not None and not main.current_run.running:
                    break
            await pilot.pause()
            seen["title"] = str(main.query_one("#pane-b").border_title)
            seen["tokens"] = dict(main.current_run.tokens)
            seen["flags"] = dict(main.current_run.flags)

    asyncio.run(drive())
    assert seen["title"].startswith("B (f4 edits): qwen2-moe:source · "), seen
    assert seen["flags"]["B"] == seen["flags"]["A"]  # B differs by its model alone, as compare --b-model runs it
    assert seen["tokens"]["B"] == list(engine_b.generate(PROMPT, 3, seen["flags"]["B"]).tokens)
    assert seen["tokens"]["A"] == list(engine.generate(PROMPT, 3, seen["flags"]["A"]).tokens)
    steps = path.read_text()
    assert 'action = "compare"' in steps and 'b_model = "source"' in steps, steps
    line = json.loads(path.with_name("tui.results.jsonl").read_text().splitlines()[1])
    assert line["runs"][1]["model"]["checkpoint"]["path"] == str(source.resolve())
    code, out, err = _run(["replay", path, "--json"], capsys)
    assert code == 0 and json.loads(out)["matches"], err


def test_the_tui_refuses_a_b_model_before_anything_loads(models, capsys):
    from argparse import Namespace

    from inspector.tui import launch

    _, _, target = models
    args = Namespace(model=str(target), device="cpu", seed=0, session=None, set_flags=[], weights="auto",
                     b_model="tiny")
    assert launch(args) == 2
    err = capsys.readouterr().err
    assert "--b-model tiny: its vocabulary has 256 tokens and A's 320" in err and "loading" not in err


def test_the_tui_names_the_sessions_keys_not_options_nobody_typed(models, tmp_path, capsys):
    """A session whose [engine] weights are random, opened with --b-model source: the refusal names the session's
    key, not a --weights option the command line never had."""
    from argparse import Namespace

    from inspector.tui import launch

    _, _, target = models
    session = _session(tmp_path / "s.toml", str(target), [], weights="random")
    args = Namespace(model="demo", device="cpu", seed=0, session=str(session), set_flags=[], weights="auto",
                     b_model="source", given_globals=frozenset({"session", "b_model"}))
    assert launch(args) == 2
    err = capsys.readouterr().err
    assert f'with [engine] weights = "random" of {session}' in err and "--weights" not in err, err
    assert "loading" not in err


@pytest.mark.parametrize("forged", [None, "x", 7, {"checkpoint": {"family": "qwen2-moe", "weights": 7}},
                                    {"checkpoint": {"weights": {"source": "files", "files": "abc"}}}])
def test_a_forged_record_of_b_is_refused_not_matched(models, tmp_path, capsys, forged):
    _, source, target = models
    session = _session(tmp_path / "s.toml", str(target), [_compare("source")])
    code, _, err = _run(["run", session], capsys)
    assert code == 0, err
    results = tmp_path / "s.results.jsonl"
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    lines[1]["runs"][1]["model"] = forged
    results.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = _run(["replay", session], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "step 1" in err


def test_a_path_key_fixed_after_a_move_still_replays(models, tmp_path, capsys):
    _, source, target = models
    shutil.copytree(source, tmp_path / "b")
    session = _session(tmp_path / "s.toml", str(target), [_compare("b")])
    assert _run(["run", session], capsys)[0] == 0
    (tmp_path / "b").rename(tmp_path / "b-moved")
    session.write_text(session.read_text().replace('b_model = "b"', 'b_model = "b-moved"'))
    code, out, err = _run(["replay", session, "--json"], capsys)
    assert code == 0 and json.loads(out)["matches"], err
    code, out, err = _run(["replay", session], capsys)  # the table names where B loaded now, not the old path
    row = next(line for line in out.splitlines() if line.startswith("| 1 | compare | base on "))
    assert code == 0 and "/b-moved |" in row, row


def test_a_check_quant_step_on_a_model_that_is_not_trellis_is_refused_before_any_step(models, tmp_path, capsys):
    _, source, _ = models
    prompt = {"action": "prompt", "prompt": PROMPT, "max_tokens": 2}
    session = _session(tmp_path / "s.toml", str(source), [prompt, {"action": "check-quant"}])
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and out == "" and "step 2 (check-quant): [engine] model" in err and "not a trellis" in err, err


@pytest.mark.parametrize("key, value, said", [("layer", 7, "layer 7: "), ("arm", "bogus", "arm bogus: choose one of")])
def test_a_check_quant_steps_layer_and_arm_are_refused_before_any_step(models, tmp_path, capsys, key, value, said):
    _, _, target = models
    prompt = {"action": "prompt", "prompt": PROMPT, "max_tokens": 2}
    session = _session(tmp_path / "s.toml", str(target), [prompt, {"action": "check-quant", key: value}])
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and out == "" and "[run] step 1" not in err, err
    assert f"{session}: step 2 (check-quant): {said}" in err and "--" not in err.split(said)[0], err


def test_a_b_model_with_another_tokenizer_of_the_same_size_is_refused_before_any_step(models, tmp_path, capsys):
    _, source, target = models
    _with_other_tokenizer(source, tmp_path / "other")
    prompt = {"action": "prompt", "prompt": PROMPT, "max_tokens": 2}
    session = _session(tmp_path / "s.toml", str(target), [prompt, _compare("other")])
    code, out, err = _run(["run", session], capsys)
    assert code == 2 and out == "" and "step 2 (compare): b_model" in err and "other tokens" in err, err
    assert not (tmp_path / "s.results.jsonl").exists()


def test_every_report_format_carries_a_check_quant_step(models, tmp_path, capsys):
    """The CSV left check-quant steps out, with their checks; md, json and jsonl carry them."""
    _, _, target = models
    session = _session(tmp_path / "s.toml", str(target), [{"action": "check-quant", "tokens": [1],
                                                            "expect": "dequantized"}])
    code, out, err = _run(["run", session, "--format", "csv"], capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("check-quant,")]
    assert len(rows) == 1 and "dequantized" in rows[0] and "held" in rows[0], out
    code, out, err = _run(["replay", session], capsys)  # its verdicts are compared, and the table says so
    row = next(line for line in out.splitlines() if "| check-quant |" in line)
    assert code == 0 and "| match |" in row, out
