"""Every Hugging Face family through the one runtime on a GPU: decode steps replay CUDA graphs (every family on the
fused decode step, gpt-oss's experts on the GEMV arm's clamped epilogue), the graphed
tokens and kept logits equal an eager run's, and replayed layers get their µs from the profile."""

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from engine import flags, layer_timing  # noqa: E402
from engine.runtime import Engine  # noqa: E402
import test_hf_models  # noqa: E402
from test_hf_models import FAMILIES  # noqa: E402

PROMPT = "mixture of experts layers route every token to a few"
TOKENS = 24


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """test_hf_models' tiny checkpoints at head_dim 64, the smallest the fused attention kernels take."""
    out = {}
    wide = dict(test_hf_models.COMMON, hidden_size=256, head_dim=64)  # 4 heads x 64 = hidden: OLMoE norms q over it
    original = test_hf_models.COMMON
    test_hf_models.COMMON = wide
    try:
        for seed, family in enumerate(FAMILIES):
            directory = tmp_path_factory.mktemp(family)
            test_hf_models._build(family, directory, seed)
            out[family] = Engine.load(str(directory), "cuda")
    finally:
        test_hf_models.COMMON = original
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_graphed_decode_equals_eager_and_replays_every_family(engines, family):
    engine = engines[family]
    graphed = engine.generate(PROMPT, TOKENS, flags.resolve(environ={}))
    eager = engine.generate(PROMPT, TOKENS, flags.resolve(["layer_timing=events"], environ={}))
    assert graphed.graphs == "on" and eager.graphs.startswith("off")
    assert graphed.tokens == eager.tokens
    assert all(torch.equal(a, b) for a, b in zip(graphed.logits, eager.logits))
    decode = [step for step in graphed.steps if step["phase"] == "decode"]
    assert sum(step["graph"] == "replay" for step in decode) >= len(decode) - 2, \
        [(s["graph"], s.get("eager_reason"), [r["executed_arm"] for r in s["moe"]]) for s in decode[:3]]
    assert all(step["eager_reason"] == "" for step in decode)
    assert graphed.decode_glue == "fused", graphed.decode_glue
    if family == "gpt-oss":  # the clamped SwiGLU on the device: the GEMV arm, not the reference
        assert all(record["executed_arm"] == "gemv" for step in decode for record in step["moe"])


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
def test_replayed_layers_are_timed_from_the_profile(engines, family):
    result = engines[family].generate(PROMPT, 16, flags.resolve(environ={}))
    assert "replayed layer records timed from the profile" in result.layer_timing, result.layer_timing
    replayed = [record for step in result.steps if step["graph"] == "replay"
                for record in step["moe"] + step["attention"]]
    assert replayed and all(record["us_method"] == layer_timing.PROFILED and record["us"] > 0 for record in replayed)
    eager = [record for step in result.steps if step["graph"] != "replay" for record in step["moe"]]
    assert all(record["us_method"] == "cuda events around the call (eager step)" for record in eager)
