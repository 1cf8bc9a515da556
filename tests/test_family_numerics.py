"""bf16 numerics of the Hugging Face families against transformers, on the CPU (bench/family_numerics.py).

For Qwen3-MoE, Mixtral, OLMoE and gpt-oss, a tiny random 3-layer checkpoint built with transformers is
teacher-forced through the engine in bf16 (its torch forward with the reference arms, as on any CPU)
and through transformers in fp32 and bf16; the engine's per-step error against transformers fp32 must
be at most 2x transformers' own bf16 error (the FlashAttention test rule), at the worst step and in the
mean, with routing forced to the fp32 run's experts (docs/numerics.md says why: a free run's worst
step is decided by which near-tied routing decision a rounding flips). Also: forcing a run's own
choices gives its own logits to the bit (forcing changes decisions, nothing else), each family's RMSNorm
rounds where transformers' does, and a precision loss the rule must catch fails it.

Sizes: hidden 128, 4 heads (2 kv) of 32, 8 experts top-2, vocab 256, a 12-token prompt then 16 steps;
the sliding window (8) is shorter than the prompt, so Mixtral's and gpt-oss's windows act.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import family_numerics as numerics  # noqa: E402
from engine import model as engine_model  # noqa: E402

SHAPE = numerics.Shape(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=64, experts=8, top_k=2, vocab=256,
                       prompt=12, steps=16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: threads only add contention at these sizes
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> a checkpoint directory, each built once."""
    out = {}
    for seed, family in enumerate(numerics.FAMILY_NAMES):
        out[family] = tmp_path_factory.mktemp(family)
        numerics.build_checkpoint(family, SHAPE, out[family], seed)
    return out


def _measure(family: str, tmp_path) -> numerics.FamilyResult:
    return numerics.measure(family, SHAPE, CPU, numerics.FAMILY_NAMES.index(family), tmp_path / family)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' past_key_values rename (5.40)
@pytest.mark.parametrize("family", numerics.FAMILY_NAMES)
def test_bf16_error_is_at_most_twice_transformers_own(family, tmp_path):
    result = _measure(family, tmp_path)
    print(result.row())
    # float32 on the CPU against transformers' float32: the mapping, as tests/test_hf_models.py checks it
    assert result.engine_fp32_error <= 1e-4, result.row()
    for condition in (numerics.FP32_WEIGHTS, numerics.BF16_WEIGHTS):
        comparison = result.comparison(condition)
        assert comparison.worst_ratio <= numerics.RATIO_LIMIT, result.row()
        assert comparison.mean_ratio <= numerics.RATIO_LIMIT, result.row()
        assert comparison.engine.flips == comparison.transformers_bf16.flips == 0  # forced: nothing flips
    assert result.passed


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family", ["mixtral", "gpt-oss"])
def test_forcing_a_runs_own_choices_gives_its_own_logits(family, checkpoints):
    """The forced runs differ from the free ones only in the decisions: forced to the experts it picked
    itself, each run computes the same weights from the same logits, so the same bits."""
    tokens = torch.randint(0, SHAPE.vocab, (SHAPE.prompt + SHAPE.steps,), generator=torch.Generator().manual_seed(5))
    run = (tokens.tolist(), SHAPE.prompt, SHAPE.steps)
    model = numerics.load_transformers(checkpoints[family], torch.bfloat16, CPU)
    free = numerics.Routing()
    logits = numerics.transformers_logits(model, *run, free)
    assert torch.equal(numerics.transformers_logits(model, *run, numerics.Routing(free.ids())), logits)
    engine = numerics.load_engine(checkpoints[family], CPU, torch.bfloat16)
    free = numerics.Routing()
    logits = numerics.engine_logits(engine, *run, numerics._routed_dispatcher(engine, free))
    forced = numerics.Routing(free.ids())
    assert torch.equal(numerics.engine_logits(engine, *run, numerics._routed_dispatcher(engine, forced)), logits)
    assert numerics.flips(forced.ids(), free.ids()) == 0
    assert all(forced.cursor[layer] == ids.shape[0] for layer, ids in free.ids().items())  # every row consumed


def test_forced_routing_takes_the_reference_experts_not_the_runs_own(checkpoints):
    """Forcing another run's choices does change a run's experts: ids from a shifted reference are taken."""
    tokens = list(range(SHAPE.prompt + SHAPE.steps))
    engine = numerics.load_engine(checkpoints["mixtral"], CPU, torch.bfloat16)
    free = numerics.Routing()
    numerics.engine_logits(engine, tokens, SHAPE.prompt, SHAPE.steps, numerics._routed_dispatcher(engine, free))
    shifted = {layer: (ids + 1) % SHAPE.experts for layer, ids in free.ids().items()}
    forced = numerics.Routing(shifted)
    numerics.engine_logits(engine, tokens, SHAPE.prompt, SHAPE.steps, numerics._routed_dispatcher(engine, forced))
    assert all(torch.equal(forced.ids()[layer], shifted[layer]) for layer in shifted)
    assert numerics.flips(forced.ids(), free.ids()) == sum(ids.shape[0] for ids in shifted.values())


@pytest.mark.parametrize("family, rounds_once", [("gpt-oss", True), ("mixtral", False), ("qwen3-moe", False),
                                                 ("olmoe", False)])
def test_rms_norm_rounds_where_the_familys_norm_rounds(family, rounds_once, checkpoints):
    """gpt-oss's RMSNorm rounds once, `(weight * normed).to(dtype)`; the Llama-style families round the
    normalised value, then multiply by the weight in bf16: the engine's norm gives their bits."""
    engine = numerics.load_engine(checkpoints[family], CPU, torch.bfloat16)
    assert engine.config.norm_rounds_once is rounds_once
    model = numerics.load_transformers(checkpoints[family], torch.bfloat16, CPU)
    layer = model.model.layers[0].post_attention_layernorm
    weight = engine.weights["layers.0.moe_norm"]
    assert torch.equal(layer.weight, weight)
    x = (3 * torch.randn(5, SHAPE.hidden, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16)
    with torch.no_grad():
        theirs = layer(x)
    ours = engine_model.rms_norm(x, weight, engine.config.norm_eps, engine.config.norm_rounds_once)
    assert torch.equal(ours, theirs)
    other = engine_model.rms_norm(x, weight, engine.config.norm_eps, not rounds_once)
    assert not torch.equal(other, theirs)  # the two roundings differ on these inputs: the test can tell them apart


def test_a_norm_sixteen_times_coarser_than_bf16_fails_the_rule(monkeypatch, tmp_path):
    """The check can fail: RMSNorm outputs rounded to 3 mantissa bits (bf16 has 7) push the engine's
    error to about 4x-5x transformers' (measured on these sizes), past the 2x rule."""
    plain = engine_model.rms_norm

    def coarse_rms_norm(x, weight, eps, rounds_once=False):
        if x.dtype != torch.bfloat16:
            return plain(x, weight, eps, rounds_once)
        x32 = x.float()
        value = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        bits = value.contiguous().view(torch.int32)
        dropped = 20  # of float32's 23 mantissa bits: 3 kept
        bits = (bits + (1 << (dropped - 1))) & ~((1 << dropped) - 1)
        return bits.view(torch.float32).to(torch.bfloat16)

    monkeypatch.setattr(engine_model, "rms_norm", coarse_rms_norm)
    result = _measure("mixtral", tmp_path)
    assert not result.comparison(numerics.FP32_WEIGHTS).passed, result.row()
    assert not result.passed
