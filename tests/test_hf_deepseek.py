"""DeepSeek-V3, DeepSeek-V2 (and its Lite shape) and Qwen2-MoE against transformers itself: each tiny
random model is built with transformers, saved (float32 safetensors plus a tokenizer.json trained here),
loaded through `Engine.load(directory)`, and must give transformers' own logits (float32, CPU, eager
attention) within a relative error of 1e-4 at the prefill and at decode steps, one prompt at a time and
as a ragged batch, and the same greedy tokens. Also: the fused MLA arm run end to end under the Triton
interpreter, the records (shared experts, group-limited routing, latent cache bytes), and the errors a
bad directory gives (exit 2, naming file and key or tensor, nothing loaded).

Sizes are tiny (3 layers, hidden 64, 8 experts top-2, 4 heads, latent 32 + RoPE 16, vocab 320); each
checkpoint is built once per module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from engine import arms, flags  # noqa: E402
from engine.checkpoint import Checkpoint  # noqa: E402
from engine.errors import UserError  # noqa: E402
from engine.hf_loader import load_checkpoint, read_config  # noqa: E402
from engine.model import KVCache, StepLayout, forward  # noqa: E402
from engine.runtime import PREFILL, Dispatcher, Engine  # noqa: E402
from inspector import cli  # noqa: E402

# float32 against float32 on the same CPU: only summation order differs (measured 6e-7 to 9e-7); 1e-4 is
# the bar of the other families (tests/test_hf_models.py), far below any mapping or math mistake (> 1e-2).
RELATIVE_TOLERANCE = 1e-4
NEW_TOKENS = 6
VOCAB = 320
SENTENCES = [
    "mixture of experts layers route every token to a few experts",
    "latent attention keeps one compressed vector per token in the cache",
    "shared experts run on every token beside the routed ones",
]
PROMPTS = [  # token lengths differ (ragged batch)
    "mixture of experts layers route every token",
    "latent attention keeps one",
    "shared experts run on every token beside the routed ones, and a group",
]
COMMON = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
              num_experts_per_tok=2, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              attn_implementation="eager", experts_implementation="eager")
LATENT = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=12, moe_intermediate_size=16,
              intermediate_size=40)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
        "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # q through its low-rank bottleneck, interleaved RoPE with YaRN and the mscale^2 softmax scale, sigmoid
    # routing with the correction bias, top-2 of 4 groups of 2, norm_topk_prob, x2.5, one dense first layer
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(**LATENT, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1,
                         q_lora_rank=24, n_shared_experts=1, rope_parameters=YARN, max_position_embeddings=256)),
    # rope_interleave off, no group limit (one group), no renormalisation, 2 shared experts
    "deepseek-v3-plain": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(**LATENT, n_routed_experts=8, n_group=1, topk_group=1, first_k_dense_replace=0,
                               q_lora_rank=24, n_shared_experts=2, rope_interleave=False, norm_topk_prob=False,
                               routed_scaling_factor=1.0)),
    # the V2-Lite shape: one q projection (q_lora_rank null), greedy softmax routing, 2 shared, a dense first layer
    "deepseek-v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(**LATENT, n_routed_experts=8, first_k_dense_replace=1, q_lora_rank=None,
                              n_shared_experts=2, topk_method="greedy")),
    # V2's group_limited_greedy (max group scores), routed_scaling_factor, q through the bottleneck
    "deepseek-v2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                            dict(**LATENT, n_routed_experts=8, first_k_dense_replace=0, q_lora_rank=24,
                                 n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                 routed_scaling_factor=1.5)),
    # q/k/v biases, the sigmoid-gated shared expert, softmax-top-k renormalised, a dense layer (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' init (std 0.02, ones, zeros) makes near-uniform logits where argmax ties hide mistakes:
    every parameter at a scale where each term matters (norm weights off one, biases nonzero, routing
    decisive but not one-hot, a correction bias that moves some choices)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(("norm.weight", "layernorm.weight")):
                parameter.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif parameter.dim() == 3:  # [E, out, in]
                parameter.copy_(noise / math.sqrt(parameter.shape[2]))
            else:  # Linear [out, in]; the router a little sharper
                parameter.copy_(noise * (2.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(parameter.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def _write_tokenizer(directory) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def _build(family: str, directory, seed: int):
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    _randomize(model, seed)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    return model, _write_tokenizer(directory)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (directory, transformers model, tokenizer, engine), each built once."""
    torch.set_num_threads(1)  # two shared cores: threads only add contention at these sizes
    out = {}
    for seed, family in enumerate(FAMILIES):
        directory = tmp_path_factory.mktemp(family)
        model, tokenizer = _build(family, directory, seed + 10)
        out[family] = (directory, model, tokenizer, Engine.load(str(directory), "cpu"))
    return out


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def _reference_run(model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its logits at the prefill position and every decode position."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
        logits = model(torch.tensor([prompt_ids + generated[:-1]])).logits[0, len(prompt_ids) - 1:]
    return generated, logits


@pytest.fixture(scope="module")
def references(built):
    """family -> per prompt (prompt ids, transformers tokens, transformers logits per step)."""
    out = {}
    for family, (_, model, tokenizer, _) in built.items():
        out[family] = [(ids, *_reference_run(model, ids)) for ids in (tokenizer.encode(p).ids for p in PROMPTS)]
    return out


def _check_generation(engine, rows, family: str) -> float:
    worst = 0.0
    for prompt_ids, tokens, logits in rows:
        result = engine.generate(prompt_ids, NEW_TOKENS, flags.resolve(environ={}), timed=False)
        assert result.tokens == tokens, f"{family}: greedy tokens differ"
        for step, (ours, theirs) in enumerate(zip(result.logits, logits, strict=True)):
            error = _relative_error(ours, theirs)
            assert error <= RELATIVE_TOLERANCE, f"{family}: step {step} relative error {error:.2e}"
            worst = max(worst, error)
    return worst


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(family, built, references):
    worst = _check_generation(built[family][3], references[family], family)
    print(f"{family}: max relative error {worst:.2e} over {len(PROMPTS)} prompts x {NEW_TOKENS} steps")


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v2-lite", "qwen2-moe"])
def test_ragged_batch_logits_match_transformers(family, built, references):
    """The batched (ragged) forward: the prompts in one padded, indexed prefill, then decode steps with a
    per-row start, in cache rows given by slots (reversed: the latent rows are gathered, not viewed)."""
    engine = built[family][3]
    rows = references[family]
    lengths = [len(prompt_ids) for prompt_ids, _, _ in rows]
    width, batch = max(lengths), len(rows)
    cache = KVCache.allocate(engine.config, batch, width + NEW_TOKENS, engine.device, engine.dtype)
    dispatcher = Dispatcher(engine, flags.resolve(environ={}), timed=False)
    tokens = torch.tensor([prompt_ids + [0] * (width - len(prompt_ids)) for prompt_ids, _, _ in rows])
    token_index = torch.tensor([row * width + column for row, length in enumerate(lengths) for column in range(length)])
    slots = torch.arange(batch - 1, -1, -1)
    layout = StepLayout(torch.zeros(batch, dtype=torch.long), width, slots, token_index, torch.tensor(lengths) - 1)
    worst = 0.0
    with torch.inference_mode():
        for step in range(3):  # the prefill and two decode steps
            dispatcher.begin_step(step, PREFILL, int(tokens.numel()))
            logits = forward(engine.config, engine.weights, tokens, layout, cache, dispatcher)  # [B, V]
            for row, (_, _, reference_logits) in enumerate(rows):
                worst = max(worst, _relative_error(logits[row], reference_logits[step]))
            tokens = torch.tensor([[generated[step]] for _, generated, _ in rows])
            starts = torch.tensor(lengths) + step
            layout = StepLayout(starts, int(starts.max()) + 1, slots)
    assert worst <= RELATIVE_TOLERANCE, f"{family}: ragged batch relative error {worst:.2e}"


@pytest.mark.parametrize("family", ["deepseek-v3", "qwen2-moe"])
def test_continuous_batching_gives_transformers_tokens(family, built, references):
    engine, rows = built[family][3], references[family]
    result = engine.generate_batch([prompt_ids for prompt_ids, _, _ in rows], NEW_TOKENS, flags.resolve(environ={}))
    assert result.tokens == [tokens for _, tokens, _ in rows]


def test_the_fused_mla_arm_end_to_end_gives_transformers_tokens(built, references, monkeypatch):
    """The absorbed arm itself (q W_UK, the Triton walk over the latent cache under the interpreter, W_UV)
    executing every latent layer of a CPU run, not the reference that emulates it: the same tokens and
    logits within the tolerance."""
    fused = arms.ARMS["mla_fused"]
    monkeypatch.setitem(arms.ARMS, "mla_fused", dataclasses.replace(fused, supports=lambda device: True))
    engine = built["deepseek-v3"][3]
    prompt_ids, tokens, logits = references["deepseek-v3"][2]
    result = engine.generate(prompt_ids, NEW_TOKENS, flags.resolve(environ={}), timed=False)
    assert {record["executed_arm"] for step in result.steps for record in step["attention"]} == {"mla_fused"}
    assert result.counters["arms"]["mla_fused"] == 3 * NEW_TOKENS and result.counters["arms"]["mla_reference"] == 0
    assert result.counters["kernels"].get("mla_split", 0) == 3 * NEW_TOKENS
    assert result.tokens == tokens
    worst = max(_relative_error(ours, theirs) for ours, theirs in zip(result.logits, logits, strict=True))
    assert worst <= RELATIVE_TOLERANCE, f"fused MLA arm: relative error {worst:.2e}"


def test_every_kernel_arm_end_to_end_under_the_interpreter(built, references, monkeypatch):
    """The GPU's arms on a CPU (Triton interpreter): the fused MLA arm, the grouped GEMM for the prefill and
    the GEMV for decode steps, beside the shared experts and the group-limited routing: transformers' tokens."""
    for name in ("mla_fused", "gemv", "grouped"):
        monkeypatch.setitem(arms.ARMS, name, dataclasses.replace(arms.ARMS[name], supports=lambda device: True))
    engine = built["deepseek-v3"][3]
    prompt_ids, tokens, logits = references["deepseek-v3"][0]
    result = engine.generate(prompt_ids, 3, flags.resolve(["moe_gate=threshold:4", "decode_floor=1"], environ={}),
                             timed=False)
    executed = {(step["phase"], record["executed_arm"]) for step in result.steps for record in step["moe"]}
    assert executed == {("prefill", "grouped"), ("decode", "gemv")}
    assert result.tokens == tokens[:3]
    worst = max(_relative_error(ours, theirs) for ours, theirs in zip(result.logits, logits))
    assert worst <= RELATIVE_TOLERANCE, f"kernel arms: relative error {worst:.2e}"


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-plain", "deepseek-v2-lite", "deepseek-v2-grouped",
                                    "qwen2-moe"])
def test_the_fused_decode_step_gives_transformers_tokens(family, built, references, fused_decode_steps):
    """Every decode step through engine.decode_fused (as on a GPU; here its kernels under the interpreter, the
    arms the CPU's): transformers' greedy tokens and logits to 1e-4, one prompt per family."""
    _check_generation(built[family][3], references[family][:1], family)
    assert len(fused_decode_steps) == NEW_TOKENS - 1  # every step after the prefill


def test_loaded_configs_carry_each_familys_features(built):
    v3, v3_plain, v2_lite, v2_grouped, qwen = (built[family][3].config for family in FAMILIES)
    latent = v3.latent_attention
    assert (latent.q_lora_rank, latent.kv_lora_rank, latent.rope_interleave, v3.head_dim) == (24, 32, True, 32)
    mscale = 0.1 * 0.707 * math.log(4.0) + 1.0
    assert latent.scale == pytest.approx(32 ** -0.5 * mscale ** 2)
    assert (v3.router, v3.n_group, v3.topk_group, v3.routed_scaling_factor, v3.norm_topk_prob) == \
        ("sigmoid_group_topk", 4, 2, 2.5, True)
    assert v3.dense_layers == (0,) and v3.moe_layers == (1, 2) and v3.shared_experts.intermediate == 16
    assert built["deepseek-v3"][3].weights["layers.1.router_correction"].dtype == torch.float32
    assert not v3_plain.latent_attention.rope_interleave and v3_plain.shared_experts.count == 2
    assert v2_lite.latent_attention.q_lora_rank is None and v2_lite.router == "softmax_topk"
    assert "layers.0.wq" in built["deepseek-v2-lite"][3].weights
    assert (v2_grouped.router, v2_grouped.routed_scaling_factor) == ("softmax_group_topk", 1.5)
    assert qwen.qkv_bias and not qwen.attention_bias and qwen.shared_experts.gated and qwen.dense_layers == (1,)
    assert "layers.0.bo" not in built["qwen2-moe"][3].weights
    from engine.decode_fused import ineligible  # what the fused decode glue does not compute: each says why

    assert ineligible(v3) == ineligible(v3_plain) == ineligible(v2_lite) == ineligible(v2_grouped) == ""
    assert ineligible(qwen) == ""  # its q/k/v biases and the gated shared expert are in the glue


def test_records_say_shared_experts_group_routing_and_latent_cache_bytes(built):
    engine = built["deepseek-v3"][3]
    result = engine.generate("latent attention", 2, flags.resolve(environ={}), timed=False)
    moe, attention = result.steps[1]["moe"], result.steps[1]["attention"]
    assert [record["layer"] for record in moe] == [1, 2]  # layer 0 is dense: no MoE record, no woken count
    assert "always on" in moe[0]["shared_experts"] and "outside the GEMV/grouped decision" in moe[0]["shared_experts"]
    assert "best 2 of 4 groups" in moe[0]["routing"] and moe[0]["woken_observed"] <= 2
    record = attention[0]
    assert (record["decided_arm"], record["executed_arm"], record["declined"]) == ("mla_fused", "mla_reference", False)
    assert record["kv_cache_bytes_per_token"] == (32 + 16) * 4  # float32 on the CPU
    assert record["naive_kv_cache_bytes_per_token"] == 4 * (16 + 16 + 12) * 4
    assert "cannot run on cpu" in record["execution_note"]
    assert record["forward"].startswith("decode steps on a GPU: engine.decode_fused's fused glue")
    assert moe[0]["forward"] == record["forward"]
    off = engine.generate("latent attention", 1, flags.resolve(["flash_512=off"], environ={}), timed=False)
    assert off.steps[0]["attention"][0]["decided_arm"] == "mla_reference"
    assert "flash_512=off" in off.steps[0]["attention"][0]["reason"]
    plain = built["deepseek-v2-lite"][3].generate("experts", 1, flags.resolve(environ={}), timed=False)
    assert "routing" not in plain.steps[0]["moe"][0]  # greedy: no group limit to state
    assert plain.steps[0]["moe"][0]["forward"].startswith("decode steps on a GPU: engine.decode_fused's fused glue")


def test_a_latent_rank_the_kernel_does_not_take_declines_to_the_reference(built, tmp_path):
    """kv_lora_rank 24 (not a power of two): the model loads and runs; every latent layer's record says
    the fused arm declined and why."""
    directory = tmp_path / "rank24"
    config = transformers.DeepseekV3Config(**COMMON, **{**LATENT, "kv_lora_rank": 24}, n_routed_experts=8, n_group=2,
                                           topk_group=1, first_k_dense_replace=0, q_lora_rank=None)
    model = transformers.DeepseekV3ForCausalLM(config).float().eval()
    _randomize(model, 3)
    model.save_pretrained(directory)
    shutil.copy(built["deepseek-v3"][0] / "tokenizer.json", directory)
    result = Engine.load(str(directory), "cpu").generate("experts", 1, flags.resolve(environ={}), timed=False)
    record = result.steps[0]["attention"][0]
    assert record["declined"] and record["decided_arm"] == "mla_reference"
    assert "kv_lora_rank 24 is not a power of two" in record["reason"]


# config.json of released checkpoints (the fields that matter, as published).
RELEASED_CONFIGS = {
    "DeepSeek-V3": ({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "vocab_size": 129280, "rope_theta": 10000,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "attention_bias": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
        dict(n_experts=256, top_k=8, intermediate=2048, head_dim=192, router="sigmoid_group_topk", n_group=8,
             topk_group=4, routed_scaling_factor=2.5, dense_layers=(0, 1, 2), dense_intermediate=18432)),
    "DeepSeek-V2-Lite": ({
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "vocab_size": 102400, "rope_theta": 10000,
        "attention_bias": False, "tie_word_embeddings": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"}},
        dict(n_experts=64, top_k=6, intermediate=1408, head_dim=192, router="softmax_topk", dense_layers=(0,),
             n_moe_layers=26)),
    "Qwen1.5-MoE-A2.7B": ({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24, "num_experts": 60,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 21, "vocab_size": 151936, "hidden_act": "silu", "tie_word_embeddings": False},
        dict(n_experts=60, top_k=4, intermediate=1408, head_dim=128, qkv_bias=True, dense_layers=())),
}


@pytest.mark.parametrize("model", list(RELEASED_CONFIGS))
def test_released_configs_parse(model, tmp_path):
    values, expected = RELEASED_CONFIGS[model]
    (tmp_path / "config.json").write_text(json.dumps(values))
    config, _ = read_config(tmp_path)
    assert {key: getattr(config, key) for key in expected} == expected
    if model == "DeepSeek-V3":  # YaRN's mscale at factor 40 squared into the softmax scale
        assert config.latent_attention.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
        assert config.rotary_dim == 64 and config.rope_scaling.factor == 40
        assert config.rope_scaling.resolved_attention_factor == pytest.approx(1.0)  # mscale / mscale_all_dim


def test_curve_takes_the_models_routing_shape(tmp_path, capsys):
    values, _ = RELEASED_CONFIGS["DeepSeek-V3"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert cli.main(["curve", "--model", str(tmp_path), "--tokens", "1,64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["k"], result["experts"], result["n_group"], result["topk_group"]) == (8, 256, 8, 4)
    assert "best 4 of 8 groups" in result["routing"] and result["rows"][0]["woken_groups"] == pytest.approx(4.0)
    assert cli.main(["curve", "--model", str(tmp_path), "--k", "6"]) == 2
    assert "not both" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the file and the key or tensor; nothing loaded half-way
# ------------------------------------------------------------------------------------------------

def _run_cli(directory, capsys) -> tuple[int, str]:
    code = cli.main(["generate", "--model", str(directory), "--prompt", "x", "--max-tokens", "1", "--device", "cpu"])
    return code, capsys.readouterr().err


def _edited_config(built, family: str, destination, **changes):
    shutil.copytree(built[family][0], destination)
    path = destination / "config.json"
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))
    return destination


@pytest.mark.parametrize("family, changes, words", [
    ("deepseek-v2-lite", {"topk_method": "noaux_tc"}, ["topk_method", "noaux_tc", "DeepseekV2ForCausalLM"]),
    ("deepseek-v3", {"topk_method": "greedy"}, ["topk_method", "greedy", "DeepseekV3ForCausalLM"]),
    ("deepseek-v3", {"scoring_func": "softmax"}, ["scoring_func", "softmax"]),
    ("deepseek-v2-lite", {"norm_topk_prob": True}, ["norm_topk_prob"]),
    ("deepseek-v3", {"attention_bias": True}, ["attention_bias"]),
    ("deepseek-v2-lite", {"mlp_bias": True}, ["mlp_bias"]),
    ("deepseek-v3", {"num_key_value_heads": 2}, ["num_key_value_heads"]),
    ("deepseek-v3", {"n_group": 3}, ["n_group=3"]),
    ("qwen2-moe", {"shared_expert_intermediate_size": 0}, ["shared_expert_intermediate_size"]),
])
def test_unimplemented_config_values_exit_2_naming_key_and_value(family, changes, words, built, tmp_path, capsys):
    directory = _edited_config(built, family, tmp_path / family, **changes)
    code, err = _run_cli(directory, capsys)
    assert code == 2 and "config.json" in err and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
    assert "Traceback" not in err


def test_a_missing_tensor_exits_2_before_any_tensor_is_read(built, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "v3"
    shutil.copytree(built["deepseek-v3"][0], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.2.mlp.shared_experts.down_proj.weight"]  # the last layer: found before reading
    save_file(tensors, str(directory / "model.safetensors"))
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name, index=None: reads.append(name)
                        or original(self, name, index))
    code, err = _run_cli(directory, capsys)
    assert code == 2 and "model.layers.2.mlp.shared_experts.down_proj.weight" in err and "missing" in err
    assert reads == []  # nothing loaded half-way


def test_a_mis_shaped_latent_tensor_exits_2_naming_file_and_tensor(built, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "v2"
    shutil.copytree(built["deepseek-v2-lite"][0], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(100, 32)  # config.json: [4 * (16 + 12), 32]
    save_file(tensors, str(directory / "model.safetensors"))
    code, err = _run_cli(directory, capsys)
    assert code == 2 and "model.safetensors" in err and "kv_b_proj.weight" in err and "[100, 32]" in err


def test_multi_token_prediction_layers_are_not_read_but_other_extras_are_errors(built, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "v3"
    shutil.copytree(built["deepseek-v3"][0], directory)
    assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)  # layer 3 = n_layers: the MTP module
    save_file(tensors, str(directory / "model.safetensors"))
    load_checkpoint(directory, torch.device("cpu"), torch.float32)
    tensors["model.layers.4.eh_proj.weight"] = torch.ones(64, 128)  # past the MTP modules: not this config's
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(UserError, match="model.layers.4.eh_proj.weight.*not used"):
        load_checkpoint(directory, torch.device("cpu"), torch.float32)


def test_other_architectures_declaring_latent_attention_exit_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "kv_lora_rank": 32, "n_routed_experts": 8}))
    code, err = _run_cli(tmp_path, capsys)
    assert code == 2 and "Glm4MoeForCausalLM" in err and "kv_lora_rank" in err


# ------------------------------------------------------------------------------------------------
# GPU: the fused arm in bf16 against transformers' own bf16 error
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v2-lite", "qwen2-moe"])
def test_gpu_bf16_error_is_at_most_twice_transformers_own(family, built):
    """On a GPU in bf16 the engine (latent layers on the fused arm, the routed experts on their kernels) may
    differ from transformers' float32 logits by at most 2x (+1e-3 relative slack) what transformers' own bf16
    run (a copy of the model) differs by, at every step of every prompt."""
    import copy

    directory, model, tokenizer, _ = built[family]
    engine = Engine.load(str(directory), "cuda")
    bf16 = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        result = engine.generate(ids, NEW_TOKENS, flags.resolve(environ={}), timed=False)
        if engine.config.latent_attention is not None:
            assert {r["executed_arm"] for step in result.steps for r in step["attention"]} == {"mla_fused"}
        full = torch.tensor([ids + result.tokens[:-1]])
        with torch.no_grad():
            reference = model(full).logits[0, len(ids) - 1:]  # float32, CPU
            theirs = bf16(full.cuda()).logits[0, len(ids) - 1:].float().cpu()
        for step, ours in enumerate(result.logits):
            own = _relative_error(theirs[step], reference[step])
            ours_error = _relative_error(ours, reference[step])
            assert ours_error <= 2 * own + 1e-3, f"{family} step {step}: {ours_error:.3e} vs transformers {own:.3e}"


def test_the_v2_lite_bench_config_is_the_released_shape():
    """bench/configs/deepseek-v2-lite/config.json (the `tg128 @ b1` row's model, weights drawn on the GPU):
    27 layers, 64 routed + 2 shared experts, top-6, latent attention 512 + 64; 15.7 B parameters, 2.45 B
    active per token (4.9 GB in bf16: the bound engine.bench divides by the copy bandwidth)."""
    from pathlib import Path

    from engine.bench import active_weight_bytes
    from engine.model_source import model_config
    from engine.model import tensor_shapes

    config = model_config(str(Path(__file__).parents[1] / "bench" / "configs" / "deepseek-v2-lite"))
    assert (config.n_layers, config.n_experts, config.top_k, config.shared_experts.count) == (27, 64, 6, 2)
    assert (config.latent_attention.kv_lora_rank, config.latent_attention.qk_rope_head_dim) == (512, 64)
    assert config.latent_attention.q_lora_rank is None and config.dense_layers == (0,)
    assert sum(math.prod(shape) for shape in tensor_shapes(config).values()) == pytest.approx(15.7e9, rel=0.01)
    assert active_weight_bytes(config, 2)["total"] == pytest.approx(4.90e9, rel=0.01)
