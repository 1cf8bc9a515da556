"""The decode check (engine.compare_decode) and `check-attention --decode`: the real decode kernel sits on `ok`
for causal and sliding-window layers, with GQA, sinks and every split count; a kernel fed a wrong argument
through a deliberately wrong wrapper (a position off by one, the newest key padded out, the window dropped or
off by one, the GQA mapping, the sink, the mask dropped, a wrong merge, one position for every sequence) is
caught and named; bad options exit 2 in one line before anything runs. Triton under the interpreter, small
shapes (a second or two a check)."""

from __future__ import annotations

import json

import pytest
import torch

import engine.compare_decode as compare_decode
from engine.errors import UserError
from inspector.cli import main
from kernels.reference import MaskSpec

CAUSAL = dict(seq_len=160, batch=4, head_dim=64, heads=4, kv_heads=2)  # 3 key tiles: splits merge; GQA 2
# A window of two key tiles (it merges), with sinks; kv heads 1: no interleaving to check, a group of 4 rows.
WINDOW = dict(seq_len=160, batch=4, head_dim=64, heads=4, kv_heads=1, window=70, sinks=True)
WINDOW_GQA = dict(seq_len=96, batch=3, head_dim=64, heads=4, kv_heads=2, window=16)  # one tile: no merge


@pytest.fixture(scope="module")
def causal():
    return compare_decode.check_decode(**CAUSAL, device="cpu", seed=1)


@pytest.fixture(scope="module")
def window():
    return compare_decode.check_decode(**WINDOW, device="cpu", seed=2)


def test_the_real_kernel_sits_on_ok_for_causal_gqa_and_every_split_count(causal):
    assert causal["ok"] and causal["verdict"] == "ok", causal["sentence"]
    assert [(run["run"], run["splits"], run["verdict"]) for run in causal["runs"]] == [
        ("step", 3, "ok"), ("one split", 1, "ok"), ("merged by the last split", 3, "ok"),
        ("merged by the combine kernel", 3, "ok")]
    # the step's GQA group merges with the combine kernel (flash_decode's default for rows > 1)
    assert causal["launches"] == {"flash_decode_split": 4, "flash_decode_combine": 2}
    modes = causal["discrimination"]["modes"]
    assert set(modes) == {"reads_stale", "misses_newest", "off_by_one_ahead", "kv_heads_interleaved"}
    assert all(row["ratio"] > 1e5 for row in modes.values())  # fp32: far past the 100 the verdict needs
    assert 1e-8 < causal["control"] < 1e-6  # one fp32 ULP, not a tolerance in disguise
    assert causal["config"]["positions"] == [159, 81, 1, 53]  # the last slot, the middle, two keys, a third


def test_the_real_kernel_sits_on_ok_for_a_window_with_sinks(window):
    assert window["ok"] and window["verdict"] == "ok", window["sentence"]
    assert window["merged"] and {run["splits"] for run in window["runs"]} == {1, 2}
    assert set(window["discrimination"]["modes"]) == {
        "reads_stale", "misses_newest", "off_by_one_behind", "off_by_one_ahead", "window_ignored", "window_wide",
        "window_narrow", "sink_ignored"}
    assert window["config"]["positions"] == [159, 81, 70, 69]  # with p = W and p = W - 1: key 0 either side


def test_positions_are_distinct_and_cover_the_edges():
    assert compare_decode.decode_positions(4, 160, None) == [159, 81, 1, 53]
    assert compare_decode.decode_positions(6, 40, 8)[:4] == [39, 21, 8, 7]
    assert compare_decode.decode_positions(5, 6, None) == [5, 4, 1, 2, 3]
    positions = compare_decode.decode_positions(64, 100, 10)
    assert len(set(positions)) == 64 and min(positions) >= 1 and max(positions) == 99


def _wrong(transform):
    """A kernel launcher that hands flash_decode what `transform(q, k, v, sinks, spec, q_start, combine)` returns
    (q, sinks, spec, q_start, key_padding, and an output permutation or None) instead of the right arguments."""
    from kernels.attention_decode import flash_decode

    def launch(q, k, v, sinks, spec, q_start, num_splits=None, combine=None, out=None):
        q2, sinks2, spec2, q_start2, padding, unpermute = transform(q, k, v, sinks, spec, q_start, combine)
        result = flash_decode(q2, k, v, sinks2, spec2, q_start2, padding, num_splits=num_splits, combine=combine)
        return result if unpermute is None else result[:, :, unpermute]

    return lambda device: launch


def _newest_padded(q, k, v, sinks, spec, q_start, combine):
    padding = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool, device=k.device)
    padding[torch.arange(k.shape[0]), q_start.long()] = True  # key p not read
    return q, sinks, spec, q_start, padding, None


def _shift(by):
    return lambda q, k, v, sinks, spec, q_start, combine: (q, sinks, spec, q_start + by, None, None)


def _spec(make):
    return lambda q, k, v, sinks, spec, q_start, combine: (q, sinks, make(spec), q_start, None, None)


def _interleaved(q, k, v, sinks, spec, q_start, combine):
    perm = torch.tensor(compare_decode._interleaved_heads(q.shape[2], k.shape[2]), device=q.device)
    return q[:, :, perm].contiguous(), sinks, spec, q_start, None, torch.argsort(perm)


def _no_sink(q, k, v, sinks, spec, q_start, combine):
    return q, None, spec, q_start, None, None


def _unmasked(q, k, v, sinks, spec, q_start, combine):
    return q, sinks, MaskSpec("none"), q_start, None, None


@pytest.mark.parametrize("shape, transform, verdict", [
    (CAUSAL, _newest_padded, "misses_newest"),
    (CAUSAL, _shift(1), "off_by_one_ahead"),  # a count where a position belongs: stale entry p + 1 read
    (CAUSAL, _unmasked, "reads_stale"),
    (CAUSAL, _interleaved, "kv_heads_interleaved"),
    (WINDOW, _newest_padded, "misses_newest"),
    (WINDOW, _shift(-1), "off_by_one_behind"),
    (WINDOW, _shift(1), "off_by_one_ahead"),
    (WINDOW, _spec(lambda spec: MaskSpec("causal")), "window_ignored"),
    (WINDOW, _spec(lambda spec: MaskSpec("window", window=spec.window + 1)), "window_wide"),
    (WINDOW, _spec(lambda spec: MaskSpec("window", window=spec.window - 1)), "window_narrow"),
    (WINDOW, _no_sink, "sink_ignored"),
    (WINDOW_GQA, _interleaved, "kv_heads_interleaved"),
])
def test_a_kernel_fed_a_wrong_argument_is_named(monkeypatch, shape, transform, verdict):
    monkeypatch.setattr(compare_decode, "_kernel", _wrong(transform))
    result = compare_decode.check_decode(**shape, device="cpu", seed=3)
    assert result["verdict"] == verdict and not result["ok"], result["sentence"]
    assert all(run["verdict"] == verdict for run in result["runs"])
    assert verdict.upper() in result["sentence"]


def test_mode_drop_launches_without_a_mask_and_reads_stale():
    result = compare_decode.check_decode(**WINDOW_GQA, mode="drop", device="cpu")
    assert result["verdict"] == "reads_stale" and not result["ok"]
    assert result["worst"]["sits_on"] == ["reads_stale"]


def test_a_wrong_merge_alone_is_caught_and_named_with_its_run(monkeypatch):
    """Only the combine kernel's run gets the wrong position: the other runs stay ok, the verdict names the mode."""
    def merge_only(q, k, v, sinks, spec, q_start, combine):
        return q, sinks, spec, q_start + (1 if combine == "kernel" else 0), None, None

    monkeypatch.setattr(compare_decode, "_kernel", _wrong(merge_only))
    result = compare_decode.check_decode(**CAUSAL, device="cpu", seed=4)
    assert result["verdict"] == "off_by_one_ahead" and not result["ok"]
    assert [run["verdict"] for run in result["runs"]] == ["ok", "ok", "ok", "off_by_one_ahead"]
    assert "merged by the combine kernel" in result["sentence"] and result["worst"]["run"] == "merged by the combine kernel"


def test_one_position_for_every_sequence_is_caught_on_the_other_sequences(monkeypatch):
    """B > 1: a launch that reads sequence 0's position for every sequence sits on no reference."""
    def first_position(q, k, v, sinks, spec, q_start, combine):
        return q, sinks, spec, q_start[:1].expand_as(q_start).contiguous(), None, None

    monkeypatch.setattr(compare_decode, "_kernel", _wrong(first_position))
    result = compare_decode.check_decode(**CAUSAL, device="cpu", seed=5)
    assert result["verdict"] != "ok" and not result["ok"]
    assert result["worst"]["sequence"] != 0 and result["worst"]["controls"] > 1e3


def test_constants_kept_equal_to_the_kernels_and_the_session_formats():
    from inspector.session import DECODE_VERDICTS
    from kernels.attention_decode import MAX_ROWS

    assert compare_decode.MAX_ROWS == MAX_ROWS
    assert DECODE_VERDICTS == compare_decode.VERDICTS


def run_cli(capsys, *arguments):
    code = main(["check-attention", "--device", "cpu", *arguments])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_decode_runs_at_the_cpu_defaults_and_prints_the_verdict(capsys):
    code, out, err = run_cli(capsys, "--decode")
    assert code == 0, err
    assert "check-attention --decode  causal  cache 160  batch 4  hd 64  heads 4/2" in out
    assert "verdict: ok" in out and "merged by the combine kernel" in out


def test_cli_decode_takes_a_models_dims(capsys, tmp_path):
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300,
              "max_position_embeddings": 256, "sliding_window": 12}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "--decode", "--model", str(tmp_path), "--format", "json", "--mode", "drop")
    assert code == 1, err
    result = json.loads(out)
    assert {key: result["config"][key] for key in ("heads", "kv_heads", "head_dim", "window", "sinks")} == {
        "heads": 4, "kv_heads": 2, "head_dim": 64, "window": 12, "sinks": False}
    assert result["verdict"] == "reads_stale"


@pytest.mark.parametrize("arguments, fragment", [
    (["--batch", "3"], "--batch is an option of the decode check: add --decode"),
    (["--decode", "--mla"], "--decode and --mla are two checks"),
    (["--decode", "--block", "8"], "--block is an option of the sinks check"),
    (["--decode", "--kv-lora-rank", "32"], "--kv-lora-rank is an option of the latent (--mla) check"),
    (["--decode", "--seq-len", "1"], "--seq-len must be >= 3"),
    (["--decode", "--seq-len", "2"], "--seq-len must be >= 3"),
    (["--decode", "--seq-len", str(10**9)], "more than 1048576 keys"),
    (["--decode", "--window", "159", "--seq-len", "160"], "--window 159: the window must be in 1..seq_len - 2 = 158"),
    (["--decode", "--batch", "1"], "--batch must be in 2..159"),
    (["--decode", "--heads", "6", "--kv-heads", "4"], "must be a positive multiple of --kv-heads"),
    (["--decode", "--heads", "130", "--kv-heads", "1"], "at most 64"),
    (["--decode", "--head-dim", "96"], "--head-dim must be one of 64, 128, 256, 512"),
    (["--decode", "--dtype", "bf16"], "--dtype bf16 needs --device cuda"),
    (["--decode", "--model", "demo"], "runs a composite mask"),
    (["--decode", "--model", "no-such-model"], "unknown model"),
    (["--decode", "--seq-len", "1000000", "--batch", "256", "--heads", "64", "--kv-heads", "64", "--head-dim", "512"],
     "the decode check at seq_len 1000000"),
])
def test_cli_decode_refusals_are_one_line_exit_2_before_anything_runs(capsys, monkeypatch, arguments, fragment):
    monkeypatch.setattr(compare_decode, "check_decode", lambda **kw: pytest.fail("nothing may run"))
    code, out, err = run_cli(capsys, *arguments)
    assert code == 2 and out == ""
    lines = [line for line in err.strip().splitlines() if not line.startswith("usage:")]
    assert len(lines) == 1 and fragment in lines[0], err


def test_cli_decode_refuses_a_latent_model(capsys, tmp_path):
    from test_attention_screen import DEEPSEEK_V2

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2))
    code, out, err = run_cli(capsys, "--decode", "--model", str(tmp_path))
    assert code == 2 and "runs latent attention (MLA): check-attention --mla checks its kernel" in err
    assert len(err.strip().splitlines()) == 1


def test_config_refusals_name_the_option():
    with pytest.raises(UserError, match="--batch must be in 2"):
        compare_decode.check_decode(seq_len=32, batch=40, head_dim=64, heads=2, device="cpu")


# The GPU shapes: the CUDA defaults (Qwen3-30B-A3B's 32/4 heads at head_dim 128, a cache of 4096, 8 sequences),
# gpt-oss's window layers (64/8 heads, head_dim 64, W = 128, sinks), and head_dim 512 with one kv head (a group of 8
# rows: the short-walk config) and a window of 256 with sinks.
GPU_SHAPES = [
    dict(compare_decode.DEFAULTS["cuda"]),
    dict(seq_len=4096, batch=8, head_dim=64, heads=64, kv_heads=8, window=128, sinks=True),
    dict(seq_len=2048, batch=8, head_dim=512, heads=8, kv_heads=1, window=256, sinks=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["qwen3-30b", "gpt-oss-window", "hd512-window"])
def test_bf16_on_cuda_sits_on_ok_and_names_a_wrong_position(monkeypatch, shape):
    """bf16 on the GPU: the real kernel through the fused arm sits on ok with every mode discriminating; a dropped
    mask reads stale, and a position one ahead is named in bf16 as in fp32."""
    from inspector.commands.check_decode import format_decode_result

    result = compare_decode.check_decode(**shape, device="cuda", seed=0)
    assert result["config"]["dtype"] == "bf16"
    assert result["discrimination"]["fires"] and result["ok"], format_decode_result(result)
    assert result["merged"] and all(run["finite"] for run in result["runs"])
    dropped = compare_decode.check_decode(**shape, mode="drop", device="cuda", seed=1)
    assert dropped["verdict"] == "reads_stale", format_decode_result(dropped)
    monkeypatch.setattr(compare_decode, "_kernel", _wrong(_shift(1)))
    ahead = compare_decode.check_decode(**shape, device="cuda", seed=2)
    assert ahead["verdict"] == "off_by_one_ahead", format_decode_result(ahead)
