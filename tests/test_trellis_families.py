"""The trellis workflow on the Hugging Face families beyond Mixtral: DeepSeek-V3 with a dense first layer
(first_k_dense_replace = 1, as every released DeepSeek), DeepSeek-V2 without one, and Qwen2-MoE (the
sigmoid-gated shared expert, a dense layer from mlp_only_layers). Each tiny random model is built with
transformers, quantized, and its directory must load and run in every command: generate, compare, check-quant
and bench. Only the MoE layers' routed experts are coded; dense MLPs and shared experts stay bf16.

Sizes: 2 layers, hidden 64, vocabulary 320 (a byte-level BPE trained here), 4 experts top-2 of F = 16 (the smallest shapes with whole 16 x 16 tiles), so a
quantize takes about a second on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from engine.model_source import model_config  # noqa: E402
from engine.trellis_checkpoint import DENSE_FILE, config_from_json, config_to_json  # noqa: E402
from engine.trellis_job import parse_experts, quantize_model, write_shape_only  # noqa: E402
from inspector import cli  # noqa: E402

COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=320,
              num_experts_per_tok=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              max_position_embeddings=128)
LATENT = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=16,
              intermediate_size=48, n_routed_experts=4, n_shared_experts=1)
FAMILIES = {
    # layer 0 dense (its MLP stays bf16), layer 1 MoE with a shared expert; q through the bottleneck
    "deepseek-v3-dense-first": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                                dict(**LATENT, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32)),
    # every layer MoE: the nested latent-attention and shared-expert configs are all config.json adds
    "deepseek-v2-no-dense": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                             dict(**LATENT, first_k_dense_replace=0, q_lora_rank=None, topk_method="greedy")),
    # the sigmoid-gated shared expert; layer 1 dense (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
}


def _build(family: str, directory: Path) -> Path:
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights at a scale where the quantization error shows (transformers' 0.02 is tiny)
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tokenizer.train_from_iterator(["routed experts and a shared one"], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


def _with_other_tokenizer(source: Path, other: Path) -> Path:
    """`source` copied to `other` with a tokenizer trained on other text: the same vocabulary size, other tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    other.mkdir()
    for path in source.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["routed experts routed experts"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(other / "tokenizer.json"))
    return other


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """family -> its source directory."""
    torch.set_num_threads(1)
    return {family: _build(family, tmp_path_factory.mktemp(family) / "source") for family in FAMILIES}


@pytest.fixture(scope="module")
def quantized(sources) -> dict[str, tuple[Path, Path]]:
    """family -> (source directory, its 2-bit hyb trellis directory)."""
    out = {}
    for family, source in sources.items():
        target = source.parent / "hyb2"
        quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), target, device="cpu")
        out[family] = (source, target)
    return out


def _run(argv, capsys):
    code = cli.main([str(part) for part in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_only_routed_experts_of_moe_layers_are_coded(family, quantized):
    source, target = quantized[family]
    config = model_config(str(source))
    dense = load_file(str(target / DENSE_FILE))
    coded = sorted(path.name for path in target.glob("experts-*.safetensors"))
    assert coded == [f"experts-{layer:05d}.safetensors" for layer in config.moe_layers]
    for layer in config.dense_layers:  # the dense MLP as it was, in bf16
        assert dense[f"layers.{layer}.mlp_gate_up"].dtype == torch.bfloat16
    for layer in config.moe_layers:  # shared experts stay bf16 beside the coded routed ones
        assert dense[f"layers.{layer}.shared_gate_up"].dtype == torch.bfloat16
        assert f"layers.{layer}.w13" not in dense


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_command_runs_on_the_quantized_directory(family, quantized, capsys):
    _, target = quantized[family]
    base = ["--model", target, "--device", "cpu"]
    code, out, err = _run(["generate", *base, "--prompt", "hi", "--max-tokens", "2", "--no-progress"], capsys)
    assert code == 0, err
    code, out, err = _run(["compare", *base, "--prompt", "hi", "--max-tokens", "2", "--no-progress"], capsys)
    assert code == 0, err
    code, out, err = _run(["check-quant", *base, "--tokens", "1,7"], capsys)
    assert code == 0 and "sits on the dequantized reference" in out, err
    code, out, err = _run(["bench", *base, "--pp", "none", "--tg", "4", "--batch", "1", "--reps", "1"], capsys)
    assert code == 0 and "| tg4 |" in out, err


def test_compare_sets_the_coded_experts_against_their_source(quantized, capsys):
    """`compare --b-model source`: A the trellis directory, B the model it was quantized from (its bf16 experts)."""
    source, target = quantized["qwen2-moe"]
    argv = ["--device", "cpu", "--prompt", "routed experts", "--max-tokens", "3", "--no-progress"]
    code, out, err = _run(["compare", "--model", target, "--b-model", "source", *argv, "--json"], capsys)
    assert code == 0, err
    both = json.loads(out)
    assert both["models"]["b"]["model"] == str(source) and both["models"]["b"]["checkpoint"]["path"] == str(source)
    assert "trellis" in both["models"]["a"]["name"] and "trellis" not in both["models"]["b"]["name"]
    code, alone, err = _run(["generate", "--model", source, *argv, "--json"], capsys)
    assert code == 0 and both["b"]["tokens"] == json.loads(alone)["tokens"], err  # B is the source, as generate runs it
    formats = {side: {record["weight_format"] for step in both[side]["steps"] for record in step["moe"]}
               for side in ("a", "b")}
    assert formats == {"a": {"trellis hyb K=2 V=2 L=16"}, "b": {"fp32"}}
    assert 1e-3 < both["logit_rel_err"][0] < 1  # the quantization error of the first token's logits, not zero
    code, out, err = _run(["compare", "--model", target, "--b-model", "source", *argv], capsys)
    assert code == 0 and out.splitlines()[1].startswith(f"B: {both['models']['b']['name']} ("), err
    code, out, err = _run(["compare", "--model", target, "--b-model", "source", *argv, "--format", "jsonl"], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {(row["config"], row["model"]) for row in rows} == {("A", str(target)), ("B", str(source))}
    moe = {row["config"]: row for row in rows if row["family"] == "moe"}
    assert moe["A"]["weight_format"] == "trellis hyb K=2 V=2 L=16" and moe["A"]["bits_per_weight"] > 2
    assert moe["B"]["weight_format"] == "fp32" and moe["A"]["bytes_moved"] < moe["B"]["bytes_moved"]


def test_compare_runs_a_b_model_that_is_a_on_a_engine(quantized, capsys, monkeypatch):
    """--b-model naming A's own model (same weights and seed) loads it once: B is A's engine."""
    from engine.runtime import Engine

    _, target = quantized["qwen2-moe"]
    loads, load = [], Engine.load.__func__
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: loads.append(a[0]) or load(cls, *a, **k)))
    code, out, err = _run(["compare", "--model", target, "--b-model", target, "--device", "cpu", "--prompt", "hi",
                           "--max-tokens", "2", "--no-progress", "--json"], capsys)
    assert code == 0 and "loading" not in err, err  # --no-progress: no loading lines either
    both = json.loads(out)
    assert loads == [str(target)] and both["models"]["b"]["given"] == str(target)
    assert both["logit_rel_err"] == [0.0, 0.0]


def test_compare_refuses_a_b_model_it_cannot_set_beside_a(quantized, tmp_path, capsys):
    source, target = quantized["qwen2-moe"]
    # progress on: a refusal after A's load would show its loading lines
    argv = ["--device", "cpu", "--prompt", "routed experts", "--max-tokens", "2"]
    code, out, err = _run(["compare", "--model", source, "--b-model", "source", *argv], capsys)
    assert code == 2 and "is not a trellis checkpoint" in err and out == ""
    code, out, err = _run(["compare", "--model", target, "--b-model", "tiny", *argv], capsys)
    assert code == 2 and "vocabulary has 256 tokens and A's 320" in err and out == ""
    assert "loading" not in err  # refused from the configs, before A loads
    for b_model, said in (("", "--b-model is empty"), (" ", "--b-model is empty"),
                          ("source", "--b-model source with --weights random")):
        code, out, err = _run(["compare", "--model", target, "--b-model", b_model, *argv, "--weights", "random"],
                              capsys)
        assert code == 2 and said in err.splitlines()[-1] and "loading" not in err, (b_model, err)
    for recorded, said in ((str(target), "its experts are trellis-coded too"),
                           ("tiny", "not the model --model")):
        edited = tmp_path / f"recorded-{len(said)}"  # the trellis directory with another recorded source
        edited.mkdir()
        for path in target.iterdir():
            (edited / path.name).write_bytes(path.read_bytes())
        values = json.loads((edited / "config.json").read_text())
        values["moe_inspector"]["source"] = {"model": recorded, "weights": "auto", "seed": 0}  # no fingerprint
        (edited / "config.json").write_text(json.dumps(values))
        code, out, err = _run(["compare", "--model", edited, "--b-model", "source", *argv], capsys)
        assert code == 2 and said in err.splitlines()[-1] and f"source ({recorded})" in err and out == "", err
        assert "cannot verify" in err and "loading" not in err
    code, out, err = _run(["compare", "--model", target, "--b-model", tmp_path / "absent", *argv], capsys)
    assert code == 2 and err.splitlines()[-1] == (f"moe-inspector: error: --b-model {tmp_path / 'absent'}: does "
                                                  f"not exist; give a preset (tiny, demo, v4-shape) or a Hugging "
                                                  f"Face-format checkpoint directory (config.json, *.safetensors, "
                                                  f"tokenizer.json)")
    other = _with_other_tokenizer(source, tmp_path / "other-tokenizer")  # the same model, other tokens
    code, out, err = _run(["compare", "--model", target, "--b-model", other, *argv], capsys)
    assert code == 2 and "reads the prompt as other tokens" in err and out == ""
    assert err.splitlines()[-1].startswith("moe-inspector: error: --b-model") and "Traceback" not in err


def test_check_quant_refuses_a_dense_layer_in_one_line(quantized, capsys):
    _, target = quantized["deepseek-v3-dense-first"]
    code, out, err = _run(["check-quant", "--model", target, "--device", "cpu", "--layer", "0"], capsys)
    assert code == 2 and "dense layer" in err and "Traceback" not in err and out == ""


def test_a_session_check_quant_step_without_a_layer_checks_the_first_moe_layer(quantized, tmp_path, capsys):
    """A step that names no layer took layer 0, the dense one of a DeepSeek with first_k_dense_replace = 1."""
    _, target = quantized["deepseek-v3-dense-first"]
    session = tmp_path / "quant.toml"
    session.write_text(f'[session]\nversion = 1\nname = "q"\n\n[engine]\nmodel = "{target}"\ndevice = "cpu"\n\n'
                       '[[step]]\naction = "check-quant"\ntokens = [3]\nexpect = "dequantized"\n')
    code, out, err = _run(["run", session], capsys)
    assert code == 0, err
    step = next(json.loads(line) for line in (tmp_path / "quant.results.jsonl").read_text().splitlines()
                if json.loads(line).get("kind") == "step")
    assert step["check"]["held"] and step["numbers"]["config"]["layer"] == 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_model_config_round_trips_through_config_json(family, sources):
    config = model_config(str(sources[family]))
    assert config_from_json(config_to_json(config), Path("config.json")) == config
    assert dataclasses.is_dataclass(config_from_json(config_to_json(config), Path("x")).shared_experts)


def test_a_shape_only_deepseek_directory_loads_random_codes(sources, tmp_path, capsys):
    source = sources["deepseek-v2-no-dense"]
    out = write_shape_only(str(source), parse_experts("trellis:K=2,code=hyb"), tmp_path / "shape")
    code, _, err = _run(["generate", "--model", out, "--weights", "random", "--device", "cpu", "--prompt", "hi",
                         "--max-tokens", "2", "--no-progress"], capsys)
    assert code == 0, err
