"""Expert parallelism on CUDA GPUs over NCCL (engine.expert_parallel): EP = 2, 4, 8 (as many as the host has)
against the one-GPU run, with the Triton arms each rank's gate picks on the rows it receives. Needs at least
two GPUs; bench/gpu_ep.sh runs it first."""

import pytest
import torch

import ep_targets
from engine import ep_launch

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(GPUS < 2, reason="expert parallelism on GPUs needs at least two of them")

# bf16 on the GPU: one rank rounds each pair's weighted output to bf16 before its owner sums the k of them, where
# one GPU sums them in fp32 inside the arm and rounds once; k = 2 or 3 extra bf16 roundings (2^-8 relative each)
# per layer, two layers: 3e-2 of the largest logit holds that and stays far below a wrong expert or weight.
RELATIVE_TO_MAX = 3e-2


@needs_gpus
@pytest.mark.parametrize("ranks", [ranks for ranks in (2, 4, 8) if ranks <= max(GPUS, 2)])
@pytest.mark.parametrize("gate", ["gemv", "grouped"])
def test_gpu_outputs_match_one_gpu(ranks, gate):
    """The prefill's logits within bf16 tolerance and its greedy tokens identical, on every row of a ragged batch;
    the forced arm ran on every rank that received rows (the counters say it, not the reference)."""
    flags = [f"moe_gate={gate}"]
    reference = {model: ep_targets.generate(ep_targets.build_engine(model, "cuda:0"), 3, flags)
                 for model in ("tiny", "small")}
    results = ep_launch.run(ranks, ep_targets.generate_on_rank,
                            {"models": ["tiny", "small"], "max_tokens": 3, "device": "cuda", "flags": flags},
                            device="cuda")
    for model, expected in reference.items():
        got = results[model]
        for rows, want in zip(got["logits"], expected["logits"]):
            scale = want[0].abs().max()
            assert scale > 0.1
            assert (rows[0] - want[0]).abs().max() <= RELATIVE_TO_MAX * scale, model  # the prefill's logits
        assert [tokens[0] for tokens in got["tokens"]] == [tokens[0] for tokens in expected["tokens"]], model
        arm = "gemv" if gate == "gemv" else "grouped_v2"
        assert got["counters"].get(arm, 0) > 0 and got["counters"].get("reference", 0) == 0, got["counters"]
