"""A session's check-attention step with `mla = true`: the latent check (engine.compare_mla.check_mla, what
`check-attention --mla` and F3 on a DeepSeek model run), its dims from the model's latent attention unless the step
gives them; run, recorded, replayed by verdict; and the combinations it refuses before anything runs (one line,
exit 2): a sinks option or verdict beside mla, a latent option or the no_rope verdict without it, a model without
latent attention and no dims, a latent shape the fused kernel declines.

The model is a config.json-only DeepSeek-V2 directory with random weights; the check draws its own inputs and
runs the MLA kernel under the Triton interpreter (a few seconds at seq_len 16).
"""

from __future__ import annotations

import json

import pytest
from test_attention_screen import DEEPSEEK_V2

from inspector.cli import main
from inspector.session_runner import read_results


def check_step_session(tmp_path, name: str, config: dict, step: str, model: str | None = None) -> tuple:
    """(session file, results file) of one check-attention `step` on `model` (None: a config.json-only directory
    of `config`, random weights)."""
    if model is None:
        directory = tmp_path / config["model_type"]
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config))
        model = config["model_type"]
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[session]\nversion = 1\nname = "{name}"\n\n[engine]\nmodel = "{model}"\nweights = "random"\n\n'
                    f'[[step]]\naction = "check-attention"\n{step}\n')
    return path, tmp_path / f"{name}.results.jsonl"


def _session(tmp_path, step: str, model: str | None = None) -> tuple:
    return check_step_session(tmp_path, "latent", DEEPSEEK_V2, step, model)


def test_a_latent_check_step_runs_at_the_models_shape_and_replays(capsys, tmp_path):
    path, results = _session(tmp_path, 'mla = true\nseq_len = 16\nmode = "honor"\nexpect = "causal"')
    code = main(["run", str(path), "--results", str(results), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "[run] latent: 1 step on cpu, the check held; results in" in err  # one step, one check: no plurals
    _, steps = read_results(results, "latent.toml")
    numbers = steps[0]["numbers"]
    assert numbers["verdict"] == "causal" and steps[0]["check"]["held"]
    assert {key: numbers["config"][key] for key in ("kv_lora_rank", "rope_dim", "nope_dim", "v_dim", "heads")} == {
        "kv_lora_rank": 32, "rope_dim": 16, "nope_dim": 16, "v_dim": 12, "heads": 4}
    assert main(["replay", str(path), "--results", str(results), "--device", "cpu"]) == 0
    assert "match" in capsys.readouterr().out


@pytest.mark.parametrize("step, model, fragment", [
    ('mla = true\nseq_len = 16\nmode = "honor"\nwindow = 8', None, "window belongs to the sinks check"),
    ('mla = true\nseq_len = 16\nmode = "honor"\nexpect = "masked"', None, 'expect = "masked" belongs to the sinks'),
    ('seq_len = 16\nmode = "honor"\nkv_lora_rank = 32', None, "kv_lora_rank belongs to the latent check; add mla"),
    ('seq_len = 16\nmode = "honor"\nexpect = "no_rope"', "tiny", 'expect = "no_rope" belongs to the latent check'),
    ('mla = true\nseq_len = 16\nmode = "honor"', "tiny", "model tiny has no latent attention to take kv_lora_rank"),
    ('mla = true\nseq_len = 16\nmode = "honor"\nkv_lora_rank = 48', None, "declines this latent shape"),
    ('mla = true\nseq_len = 1\nmode = "honor"', None, "needs at least 2 positions"),
    ('mla = "yes"\nseq_len = 16\nmode = "honor"', None, "mla"),
])
def test_latent_check_steps_it_cannot_run_are_refused_in_one_line(capsys, tmp_path, step, model, fragment):
    assert_refused(capsys, *_session(tmp_path, step, model), fragment)


def assert_refused(capsys, path, results, fragment: str) -> None:
    """`run` refuses the session in one line naming `fragment`, exit 2, before anything runs or is written."""
    assert main(["run", str(path), "--results", str(results), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err
    assert not results.exists()  # nothing ran, nothing written
