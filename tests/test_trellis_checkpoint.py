"""Trellis checkpoint directories: `quantize` writes one from a tiny Mixtral-format checkpoint, every command
loads it, a killed run resumes to the same bytes, and a directory whose tensors do not match its config.json
is refused in one line naming the file and the tensor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import dispatch, flags
from engine.errors import UserError
from engine.runtime import Engine
from engine.trellis_checkpoint import DENSE_FILE, layer_file
from engine.trellis_job import parse_experts, partial_directory, quantize_model
from inspector import cli
from kernels.trellis_reference import TrellisMatrix, dequantize

REPOSITORY = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, EXPERTS, LAYERS = 32, 16, 2, 3  # the smallest shape with a tile on every side


def write_tiny_mixtral(directory: Path, layers: int = LAYERS) -> Path:
    """A Mixtral-format checkpoint of random bf16 weights, no tokenizer (byte tokens, vocab 256)."""
    directory.mkdir(parents=True)
    heads, kv_heads, head_dim, vocab = 2, 1, 16, 256
    config = dict(architectures=["MixtralForCausalLM"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_local_experts=EXPERTS, num_experts_per_tok=2, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, max_position_embeddings=128,
                  num_hidden_layers=layers, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu")
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return (torch.randn(*shape, generator=generator) * 0.2).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": draw(vocab, HIDDEN), "lm_head.weight": draw(vocab, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                        p + "self_attn.q_proj.weight": draw(heads * head_dim, HIDDEN),
                        p + "self_attn.k_proj.weight": draw(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.v_proj.weight": draw(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.o_proj.weight": draw(HIDDEN, heads * head_dim),
                        p + "block_sparse_moe.gate.weight": draw(EXPERTS, HIDDEN)})
        for expert in range(EXPERTS):
            q = p + f"block_sparse_moe.experts.{expert}."
            tensors.update({q + "w1.weight": draw(INTERMEDIATE, HIDDEN), q + "w3.weight": draw(INTERMEDIATE, HIDDEN),
                            q + "w2.weight": draw(HIDDEN, INTERMEDIATE)})
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_tiny_mixtral(tmp_path_factory.mktemp("source") / "mixtral")


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quantized") / "hyb2"
    quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cpu")
    return out


def _run(argv, capsys):
    code = cli.main([str(part) for part in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def test_the_directory_holds_what_docs_trellis_md_says(quantized):
    names = sorted(path.name for path in quantized.iterdir())
    assert names == sorted(["config.json", DENSE_FILE, "quantization.json"] + [layer_file(layer) for layer in range(LAYERS)])
    config = json.loads((quantized / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["quant_method"] == "trellis" and quantization["code"] == "hyb"
    assert (quantization["bits_per_weight"], quantization["weights_per_step"], quantization["state_bits"]) == (2, 2, 16)
    assert config["moe_inspector"]["format"] == "trellis-experts" and config["moe_inspector"]["tokenizer"] == "none"
    w13 = quantization["matrices"]["layers.0.w13"]
    assert w13["shape"] == [EXPERTS, 2 * INTERMEDIATE, HIDDEN] and w13["left_block"] == INTERMEDIATE
    experts = load_file(str(quantized / layer_file(1)))
    assert experts["layers.1.w13.trellis_codes"].dtype == torch.int32
    assert tuple(experts["layers.1.w13.trellis_codes"].shape) == (EXPERTS, 2 * INTERMEDIATE // 16, HIDDEN // 16, 16)
    assert tuple(experts["layers.1.w2.trellis_scales"].shape) == (EXPERTS, HIDDEN)
    assert tuple(experts["layers.1.trellis_table"].shape) == (512, 2)
    report = json.loads((quantized / "quantization.json").read_text())
    assert [item["name"] for item in report["matrices"]] == [f"layers.{layer}.{m}" for layer in range(LAYERS)
                                                             for m in ("w13", "w2")]
    assert all(0.03 < item["relative_mse"] < 0.12 for item in report["matrices"])  # K = 2 on random weights


def test_a_loaded_directory_runs_with_the_trellis_experts(source, quantized):
    original = Engine.load(str(source), device="cpu")
    engine = Engine.load(str(quantized), device="cpu")
    w13 = engine.weights["layers.0.w13"]
    assert isinstance(w13, TrellisMatrix) and w13.code.describe() == "trellis hyb K=2 V=2 L=16"
    for name, tensor in original.weights.items():  # dense tensors unchanged (bf16 both sides)
        if not name.endswith((".w13", ".w2")):
            assert torch.equal(engine.weights[name], tensor), name
    error = dequantize(w13) - original.weights["layers.0.w13"]
    assert float(error.pow(2).mean() / original.weights["layers.0.w13"].pow(2).mean()) < 0.12
    result = engine.generate([104, 105, 33], 3, flags.resolve([]))  # token ids: the source has no tokenizer.json
    record = result.steps[0]["moe"][0]
    assert record["weight_format"] == "trellis hyb K=2 V=2 L=16" and record["executed_arm"] == "reference"
    assert "dequantizes the woken experts" in record["execution_note"]
    assert record["bits_per_weight"] == round(8 * record["expert_bytes"] / (3 * HIDDEN * INTERMEDIATE), 4)  # K + scales
    assert record["expert_bytes"] == (2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE) * 2 // 8 \
        + 4 * (2 * INTERMEDIATE + HIDDEN)
    plain = original.generate([104, 105, 33], 3, flags.resolve([])).steps[0]["moe"][0]
    assert plain["weight_format"] == "fp32" and plain["bits_per_weight"] == 32  # the CPU engine's dtype
    pytest.importorskip("textual")
    from inspector.widgets.dispatch_log import LogEntry

    shown = LogEntry("A", "moe", record).reason()
    assert f"moves {dispatch._megabytes(record['bytes_moved'])} of weights" in record["reason"]  # one figure
    assert f"[trellis hyb K=2 V=2 L=16, {record['bits_per_weight']:.2f} b/w, {record['bytes_moved'] / 1e6:.3g} MB]" \
        in shown
    assert "trellis" not in LogEntry("A", "moe", plain).reason()  # bf16 rows unchanged


def test_quantize_refuses_bad_input_in_one_line(source, quantized, tmp_path, capsys):
    out = tmp_path / "new"
    for experts, problem in (("trellis:K=5,code=hyb", "K=5"), ("trellis:K=2,code=qtip", "unknown code"),
                             ("trellis:K=2,code=1mad,V=2", "V=1"), ("int4", "must be trellis")):
        code, _, err = _run(["quantize", source, "--experts", experts, "--out", out], capsys)
        assert code == 2 and problem in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(["quantize", source, "--experts", "trellis:K=2,code=hyb", "--out", quantized], capsys)
    assert code == 2 and "exists" in err
    assert not out.exists() and not partial_directory(out).exists()  # nothing half-written


def _damaged(quantized: Path, tmp_path: Path, change) -> Path:
    copy = tmp_path / "damaged"
    copy.mkdir()
    for path in quantized.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    change(copy)
    return copy


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("case, problem", [
    ("codes shape", "tensor layers.1.w13.trellis_codes has shape [2, 2, 2, 8]"),
    ("codes dtype", "tensor layers.0.w2.trellis_codes is I64"),
    ("scales missing", "tensor layers.2.w2.trellis_scales is missing"),
    ("extra tensor", "tensor layers.0.w13.trellis_signs is not part of"),
    ("bad code", "K=7"),
    ("nan scale", "layers.1.w13.trellis_scales holds 1 NaN"),
])
def test_a_damaged_directory_is_refused_naming_file_and_tensor(quantized, tmp_path, capsys, case, problem):
    def change(copy: Path) -> None:
        if case == "codes shape":
            _rewrite(copy / layer_file(1), lambda t: t.update({"layers.1.w13.trellis_codes":
                                                               t["layers.1.w13.trellis_codes"][..., :8].contiguous()}))
        elif case == "codes dtype":
            _rewrite(copy / layer_file(0), lambda t: t.update({"layers.0.w2.trellis_codes":
                                                               t["layers.0.w2.trellis_codes"].long()}))
        elif case == "scales missing":
            _rewrite(copy / layer_file(2), lambda t: t.pop("layers.2.w2.trellis_scales"))
        elif case == "extra tensor":
            _rewrite(copy / layer_file(0), lambda t: t.update({"layers.0.w13.trellis_signs": torch.ones(32)}))
        elif case == "bad code":
            values = json.loads((copy / "config.json").read_text())
            values["quantization_config"]["bits_per_weight"] = 7
            (copy / "config.json").write_text(json.dumps(values))
        else:
            _rewrite(copy / layer_file(1), lambda t: t["layers.1.w13.trellis_scales"].view(-1)[3].fill_(float("nan")))

    copy = _damaged(quantized, tmp_path, change)
    # bench reads token ids: the source has no tokenizer.json, which generate's text prompt would be refused for first
    code, out, err = _run(["bench", "--model", copy, "--pp", "4", "--tg", "none", "--batch", "1", "--reps", "1",
                           "--device", "cpu", "--no-progress"], capsys)
    message = [line for line in err.splitlines() if line.startswith("moe-inspector: error")]
    assert code == 2 and len(message) == 1 and problem in message[0], err
    assert "Traceback" not in err and out == ""


def test_a_resume_with_other_settings_is_refused(source, tmp_path):
    out = tmp_path / "other"
    partial = partial_directory(out)
    partial.mkdir()
    (partial / "job.json").write_text(json.dumps({"code": "1mad"}))
    with pytest.raises(UserError, match="other settings"):
        quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cpu")
    assert not out.exists()


@pytest.mark.slow  # two processes that import torch, and the model quantized once more
def test_a_killed_run_leaves_no_output_and_resumes_to_the_same_bytes(source, quantized, tmp_path):
    out = tmp_path / "resumed"
    command = [sys.executable, "-m", "inspector", "quantize", str(source), "--experts", "trellis:K=2,code=hyb",
               "--out", str(out), "--device", "cpu"]
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    process = subprocess.Popen(command, cwd=REPOSITORY, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    first_layer = partial_directory(out) / "experts-00000.json"
    deadline = time.monotonic() + 300
    while not first_layer.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first_layer.exists(), process.communicate()
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists() and partial_directory(out).is_dir()  # no output directory, only the hidden partial one
    finished = subprocess.run(command, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    assert "kept layers 0" in finished.stdout
    assert not partial_directory(out).exists()
    resumed, whole = _tensors(out), _tensors(quantized)
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name


def test_check_quant_finds_the_rotated_arm_on_the_dequantized_reference(quantized, capsys):
    code, out, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--tokens", "1,7", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["config"]["arm"] == "rotated-torch" and result["ok"] and result["discriminates"]
    for row in result["rows"]:
        assert row["verdict"] == "dequantized"
        assert row["errors"]["dequantized"] <= 16 * row["control"]
        # 2 bits per weight on random weights: the layer's output moves by tens of percent
        assert 0.1 < row["discrimination"]["dequantized_vs_original"] < 0.8
        assert row["errors"]["original"] > 1e5 * row["control"]


def test_check_quant_catches_an_arm_that_computes_the_original_weights(quantized, source, monkeypatch, capsys):
    """An arm that never decodes (it reads the bf16 weights it was quantized from) sits on the original."""
    from engine import quant_check
    from kernels.reference import moe_reference

    original = Engine.load(str(source), device="cpu").weights
    layer = 1

    def undecoded(x, w13, w2, ids, weights):
        return moe_reference(x, original[f"layers.{layer}.w13"], original[f"layers.{layer}.w2"], ids, weights)

    monkeypatch.setattr(quant_check, "trellis_arms", lambda device: {"undecoded": undecoded})
    code, out, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--layer", layer], capsys)
    assert code == 1, err
    assert "original" in out.splitlines()[4] and "does not sit on the dequantized reference" in out


def test_check_quant_reads_only_the_checked_layers_experts_of_its_source(quantized, source, monkeypatch, capsys):
    """The source model is not loaded whole: a 30B source would not fit beside its quantized copy."""
    from engine.checkpoint import Checkpoint
    from engine.hf_loader import load_some

    whole = Engine.load(str(source), device="cpu").weights
    some = load_some(source, ["layers.2.w13", "layers.2.w2"], torch.device("cpu"), torch.float32)
    assert torch.equal(some["layers.2.w13"], whole["layers.2.w13"]) and torch.equal(some["layers.2.w2"], whole["layers.2.w2"])
    read, reading = [], Checkpoint.read

    def recorded(self, name, *args):
        read.append(name)
        return reading(self, name, *args)

    monkeypatch.setattr(Checkpoint, "read", recorded)
    code, out, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--layer", 2, "--tokens", 3],
                          capsys)
    assert code == 0, err
    source_reads = [name for name in read if name.startswith("model.")]  # the trellis directory's are layers.*
    assert sorted(set(source_reads)) == sorted(f"model.layers.2.block_sparse_moe.experts.{e}.{w}.weight"
                                               for e in range(EXPERTS) for w in ("w1", "w2", "w3"))
    with pytest.raises(UserError, match="has no tensor layers.9.w13"):
        load_some(source, ["layers.9.w13"], torch.device("cpu"), torch.float32)


def test_check_quant_refuses_a_layer_the_model_lacks_before_loading_it(quantized, capsys, monkeypatch):
    from engine.runtime import Engine as Loaded

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before --layer was checked")

    monkeypatch.setattr(Loaded, "load", never)
    code, _, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--layer", 99], capsys)
    assert code == 2 and "--layer 99" in err and "has layers 0.." in err and "Traceback" not in err


def test_quantize_refuses_a_trellis_checkpoint_before_loading_it(quantized, tmp_path, capsys, monkeypatch):
    from engine.runtime import Engine as Loaded

    def never(*args, **kwargs):
        raise AssertionError("the trellis checkpoint was loaded before it was refused")

    monkeypatch.setattr(Loaded, "load", never)
    out = tmp_path / "again"
    code, _, err = _run(["quantize", quantized, "--experts", "trellis:K=2,code=hyb", "--out", out], capsys)
    assert code == 2 and "trellis-coded already" in err and "Traceback" not in err and not out.exists()


def test_check_quant_refuses_a_model_without_trellis_experts(source, capsys):
    code, _, err = _run(["check-quant", "--model", source, "--device", "cpu"], capsys)
    assert code == 2 and "not trellis-coded" in err and "Traceback" not in err


def test_a_session_step_runs_check_quant(quantized, tmp_path, capsys):
    session = tmp_path / "quant.toml"
    session.write_text(f'[session]\nversion = 1\nname = "quant"\n\n[engine]\nmodel = "{quantized}"\ndevice = "cpu"\n\n'
                       f'[[step]]\naction = "check-quant"\nlayer = 2\ntokens = [3]\nexpect = "dequantized"\n')
    code, out, err = _run(["run", session], capsys)
    assert code == 0, err
    results = [json.loads(line) for line in (tmp_path / "quant.results.jsonl").read_text().splitlines()]
    step = next(line for line in results if line.get("kind") == "step")
    assert step["action"] == "check-quant" and step["check"]["held"]
    assert [row["verdict"] for row in step["numbers"]["rows"]] == ["dequantized"]
    code, out, err = _run(["replay", session], capsys)
    assert code == 0, err + out


def test_a_shape_only_directory_loads_random_valid_codes(tmp_path, capsys):
    out = tmp_path / "tiny-shape"
    code, stdout, err = _run(["quantize", "tiny", "--experts", "trellis:K=3,code=1mad", "--out", out, "--shape-only"],
                             capsys)
    assert code == 0 and sorted(path.name for path in out.iterdir()) == ["config.json"], err
    code, _, err = _run(["generate", "--model", out, "--device", "cpu", "--prompt", "x", "--max-tokens", "1"], capsys)
    assert code == 2 and "--weights random" in err  # no tensors: said in one line
    engine = Engine.load(str(out), device="cpu", weights="random")
    w2 = engine.weights["layers.1.w2"]
    assert isinstance(w2, TrellisMatrix) and w2.code.describe() == "trellis 1mad K=3 V=1 L=16"
    layout = json.loads((out / "config.json").read_text())["quantization_config"]["matrices"]["layers.1.w2"]
    assert (w2.left_seed, w2.right_block) == (layout["left_seed"], layout["right_block"])
    weights = dequantize(w2)
    assert torch.isfinite(weights).all() and 0.5 < float(weights.std() * 32 ** 0.5) < 2  # about N(0, 1/C)
    assert len(engine.generate("hi", 2, flags.resolve([])).tokens) == 2


def test_calibration_hessians_weigh_the_error_they_measure(source):
    """The collected Hessians are sums of the routed inputs' outer products; LDLQ with them lowers the
    calibration-weighted error tr(E H E^T) against the plain search."""
    from engine.trellis_job import _usable, calibration_hessians
    from engine.trellis_quantizer import quantize_stack

    engine = Engine.load(str(source), device="cpu")
    tokens = list(torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(4)).tolist())
    hessians = calibration_hessians(engine, tokens, window=100)
    w13 = hessians["layers.0.w13"]  # [E, D, D]
    assert w13.shape == (EXPERTS, HIDDEN, HIDDEN) and torch.allclose(w13, w13.transpose(1, 2))
    # every token is routed to top-2 of 2 experts: each expert saw all 300 normed inputs, trace = sum |h|^2
    assert float(w13[0].trace()) == pytest.approx(float(w13[1].trace()), rel=1e-4)
    assert hessians["layers.2.w2"].shape == (EXPERTS, INTERMEDIATE, INTERMEDIATE)
    weights = engine.weights["layers.0.w13"]
    code = parse_experts("trellis:K=2,code=hyb")

    def weighted(matrix) -> float:
        error = (dequantize(matrix) - weights).double()
        return float(sum(torch.trace(error[e] @ w13[e].double() @ error[e].t()) for e in range(EXPERTS)))

    plain = quantize_stack(weights, code, left_seed=1, right_seed=2, left_block=INTERMEDIATE)
    fed_back = quantize_stack(weights, code, left_seed=1, right_seed=2, left_block=INTERMEDIATE,
                              hessian=_usable(w13))
    assert weighted(fed_back) < weighted(plain)
    empty = _usable(torch.zeros(2, 3, 3))
    assert torch.equal(empty[1], torch.eye(3))


def test_quantize_with_a_calibration_text(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    directory = write_tiny_mixtral(tmp_path / "one-layer", layers=1)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())  # 256 byte symbols: byte tokens
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    text = tmp_path / "calibration.txt"
    text.write_text("The if statement is used for conditional execution. " * 8)
    out = tmp_path / "calibrated"
    code, stdout, err = _run(["quantize", directory, "--experts", "trellis:K=2,code=3inst", "--out", out,
                              "--calibration", text, "--calibration-tokens", "200", "--device", "cpu"], capsys)
    assert code == 0, err
    source = json.loads((out / "config.json").read_text())["moe_inspector"]["source"]
    assert source["calibration"]["tokens"] == 200 and len(source["calibration"]["sha256"]) == 64
    assert (out / "tokenizer.json").is_file()
    code, _, err = _run(["quantize", directory, "--experts", "trellis:K=2,code=3inst", "--out", tmp_path / "x",
                         "--calibration", tmp_path / "missing.txt", "--device", "cpu"], capsys)
    assert code == 2 and "cannot read it" in err and not (tmp_path / "x").exists()


def test_a_loaded_directory_is_named_as_the_quantized_form_of_its_source(source, quantized, tmp_path, capsys):
    from engine.trellis_checkpoint import source_of

    original = Engine.load(str(source), device="cpu")
    engine = Engine.load(str(quantized), device="cpu")
    assert original.config.name == "mixtral:mixtral"
    assert engine.config.name == "mixtral:mixtral+trellis-hyb-K2" and engine.provenance()["name"] == engine.config.name
    assert source_of(quantized)["model"] == str(source.resolve())  # the source stays recorded
    # on disk, the model config keeps the source's name: the mark is added on reading
    on_disk = json.loads((quantized / "config.json").read_text())
    assert on_disk["moe_inspector"]["model"]["name"] == "mixtral:mixtral"
    # a directory whose config already carries the mark (written by hand, or by a later version) is not marked twice
    marked = tmp_path / "marked"
    marked.mkdir()
    for path in quantized.iterdir():
        (marked / path.name).write_bytes(path.read_bytes())
    on_disk["moe_inspector"]["model"]["name"] = "mixtral:mixtral+trellis-hyb-K2"
    (marked / "config.json").write_text(json.dumps(on_disk))
    assert Engine.load(str(marked), device="cpu").config.name == "mixtral:mixtral+trellis-hyb-K2"


def test_generate_names_a_quantized_preset_by_its_code(tmp_path, capsys):
    out = tmp_path / "tiny-shape"
    assert _run(["quantize", "tiny", "--experts", "trellis:K=3,code=1mad", "--out", out, "--shape-only"], capsys)[0] == 0
    code, stdout, err = _run(["generate", "--model", out, "--weights", "random", "--device", "cpu", "--prompt", "hi",
                              "--max-tokens", "1", "--no-progress", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["model"] == "tiny+trellis-1mad-K3"


def _copy(directory: Path, to: Path) -> Path:
    to.mkdir()
    for path in directory.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def _change_an_expert(directory: Path) -> None:
    """The same shapes and dtypes, one expert weight moved: only the bytes tell the files apart."""
    def edit(tensors):
        tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"][0, 0] += 1

    _rewrite(directory / "model.safetensors", edit)


def _point_source_at(quantized: Path, to: Path, tmp_path: Path, drop_fingerprint: bool = False) -> Path:
    copy = _copy(quantized, tmp_path / "pointed")
    values = json.loads((copy / "config.json").read_text())
    values["moe_inspector"]["source"]["model"] = str(to)
    if drop_fingerprint:
        del values["moe_inspector"]["source"]["fingerprint"]
    (copy / "config.json").write_text(json.dumps(values))
    return copy


def test_check_quant_refuses_a_source_whose_experts_changed_since(source, quantized, tmp_path, capsys):
    changed = _copy(source, tmp_path / "changed")
    _change_an_expert(changed)
    pointed = _point_source_at(quantized, changed, tmp_path)
    code, out, err = _run(["check-quant", "--model", pointed, "--device", "cpu"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "is not the model" in err and "model.safetensors's bytes differ" in err and "Traceback" not in err


def test_check_quant_refuses_an_original_that_is_another_model(quantized, tmp_path, capsys):
    """The same shapes and tensor names, other weights: silently it would report their difference."""
    other = write_tiny_mixtral(tmp_path / "other")
    _change_an_expert(other)
    code, out, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--original", other], capsys)
    assert code == 2 and out == "" and f"--original {other} is not the model" in err, err
    code, out, err = _run(["check-quant", "--model", quantized, "--device", "cpu", "--original", "tiny"], capsys)
    assert code == 2 and "this is a preset" in err, err


def test_a_directory_without_a_fingerprint_is_checked_with_a_note(source, quantized, tmp_path, capsys):
    """Directories quantized before fingerprints were recorded still check, saying they cannot be verified."""
    pointed = _point_source_at(quantized, source, tmp_path, drop_fingerprint=True)
    code, out, err = _run(["check-quant", "--model", pointed, "--device", "cpu", "--tokens", "1"], capsys)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "cannot verify" in line]
    assert len(notes) == 1 and "records no fingerprint" in notes[0]


def _edit_source(quantized: Path, to: Path, **values) -> Path:
    copy = _copy(quantized, to)
    config = json.loads((copy / "config.json").read_text())
    config["moe_inspector"]["source"].update(values)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_a_relative_source_is_read_beside_the_directory_not_the_cwd(source, quantized, tmp_path, capsys,
                                                                     monkeypatch):
    """A hand-edited relative source ("../mixtral" beside the checkpoint) names the config's neighbour wherever the
    command runs from."""
    (tmp_path / "models").mkdir()
    _copy(source, tmp_path / "models" / "mixtral")
    pointed = _edit_source(quantized, tmp_path / "models" / "hyb2", model="../mixtral")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, err = _run(["check-quant", "--model", pointed, "--device", "cpu", "--tokens", "1"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("seed", [-1, 2**63, "0", 1.5, True])
def test_a_recorded_source_seed_out_of_range_is_one_line(quantized, tmp_path, capsys, seed):
    pointed = _edit_source(quantized, tmp_path / "q", seed=seed)
    code, out, err = _run(["check-quant", "--model", pointed, "--device", "cpu", "--tokens", "1"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "config.json's source seed is" in err and "Traceback" not in err


def _interrupted_after_layer_0(source: Path, experts: str, out: Path, monkeypatch) -> None:
    """A quantize run stopped by Ctrl-C once layer 0 is written: a partial directory to resume."""
    from engine import trellis_job

    quantize_layer = trellis_job._quantize_layer

    def interrupted(engine, layer, *args, **kwargs):
        if layer > 0:
            raise KeyboardInterrupt
        return quantize_layer(engine, layer, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(trellis_job, "_quantize_layer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            quantize_model(str(source), parse_experts(experts), out, device="cpu")
    assert (partial_directory(out) / layer_file(0)).is_file()


@pytest.mark.parametrize("cut", [5000, 0])
def test_a_resume_redoes_a_kept_layer_whose_file_was_cut(source, quantized, tmp_path, monkeypatch, cut):
    """A kept layer is trusted only whole: one truncated or emptied since is quantized again, so the finished
    directory equals an uninterrupted run's, not a checkpoint that fails at its first load."""
    out = tmp_path / "out"
    _interrupted_after_layer_0(source, "trellis:K=2,code=hyb", out, monkeypatch)
    kept = partial_directory(out) / layer_file(0)
    with kept.open("r+b") as handle:
        handle.truncate(cut)
    quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cpu")
    assert (out / layer_file(0)).read_bytes() == (quantized / layer_file(0)).read_bytes()


def test_a_resume_with_other_settings_says_which_in_words(source, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted_after_layer_0(source, "trellis:K=3,code=hyb", out, monkeypatch)
    with pytest.raises(UserError) as refused:
        quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cpu", seed=5)
    message = str(refused.value)
    assert "K 3 then, 2 now" in message and "--seed 0 then, 5 now" in message and "{'" not in message
    assert f"`moe-inspector quantize {source} --experts trellis:K=3,code=hyb --out {out}`" in message
    assert f"rm -r {partial_directory(out)}" in message


def test_a_resume_refuses_a_source_that_changed_since(source, tmp_path, monkeypatch):
    copy = _copy(source, tmp_path / "source")
    out = tmp_path / "out"
    _interrupted_after_layer_0(copy, "trellis:K=2,code=hyb", out, monkeypatch)
    _change_an_expert(copy)
    with pytest.raises(UserError, match="model.safetensors's bytes differ"):
        quantize_model(str(copy), parse_experts("trellis:K=2,code=hyb"), out, device="cpu")
    assert not out.exists() and (partial_directory(out) / layer_file(0)).is_file()


def test_ctrl_c_says_where_the_partial_directory_is_and_how_to_resume(source, tmp_path, monkeypatch, capsys):
    from engine import trellis_job

    quantize_layer = trellis_job._quantize_layer

    def interrupted(engine, layer, *args, **kwargs):
        if layer > 0:
            raise KeyboardInterrupt
        return quantize_layer(engine, layer, *args, **kwargs)

    monkeypatch.setattr(trellis_job, "_quantize_layer", interrupted)
    out = tmp_path / "out"
    argv = ["quantize", source, "--experts", "trellis:K=2,code=hyb", "--out", out, "--seed", 3, "--device", "cpu"]
    code, _, err = _run(argv, capsys)
    line = [line for line in err.splitlines() if "interrupted" in line]
    assert code == 130 and len(line) == 1, err
    assert str(partial_directory(out)) in line[0]
    assert f"`moe-inspector quantize {source} --experts trellis:K=2,code=hyb --out {out} --seed 3 --device cpu`" in line[0]
    monkeypatch.setattr(trellis_job, "_quantize_layer", quantize_layer)
    code, out_text, err = _run(argv, capsys)  # the command it names finishes the run
    assert code == 0 and "kept layers 0 of an earlier run" in out_text, err


def test_check_quant_names_a_recorded_source_that_is_coded_too_as_recorded(quantized, tmp_path, capsys):
    """It said '--original DIR: its experts are trellis-coded too' of a source the user never gave."""
    edited = tmp_path / "edited"
    edited.mkdir()
    for path in quantized.iterdir():
        (edited / path.name).write_bytes(path.read_bytes())
    values = json.loads((edited / "config.json").read_text())
    values["moe_inspector"]["source"] = {"model": str(quantized), "weights": "auto", "seed": 0}
    (edited / "config.json").write_text(json.dumps(values))
    code, out, err = _run(["check-quant", "--model", edited, "--device", "cpu", "--tokens", 1], capsys)
    line = err.splitlines()[-1]
    assert code == 2 and f"recorded source {quantized}: its experts are trellis-coded too" in line, err
    assert not line.startswith("moe-inspector: error: --original")


def test_a_quantized_random_shape_reads_prompts_as_its_source_does(source, tmp_path, capsys):
    """A config.json-only directory with --weights random reads prompts as byte tokens; its trellis checkpoint
    recorded no tokenizer and refused every text prompt."""
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_bytes((source / "config.json").read_bytes())
    out = tmp_path / "q"
    quantize_model(str(shape), parse_experts("trellis:K=2,code=hyb"), out, device="cpu", weights="random")
    code, _, err = _run(["generate", "--model", out, "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                         "--no-progress"], capsys)
    assert code == 0, err
