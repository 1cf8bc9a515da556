"""The GEMV arm for gpt-oss experts (biases, clamped SwiGLU) against kernels.reference.moe_reference_gpt_oss:
fresh random inputs, odd sizes, the clamp engaged, with and without each bias; under the interpreter on a
CPU (fp32, fp16), in bf16 on a GPU (also captured in a CUDA graph, as the decode step runs it)."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import scratch  # noqa: E402
from kernels.moe_gemv import moe_gemv_clamped  # noqa: E402
from kernels.reference import moe_reference_gpt_oss  # noqa: E402
from test_moe_kernels import TOLERANCE, make_layer, make_routing, relative_error  # noqa: E402

ALPHA, LIMIT = 1.702, 1.5  # a limit low enough that the clamp bites on these scales


def _case(tokens, top_k, experts, hidden, intermediate, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed + tokens * 7 + experts)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, dtype, generator)
    b13 = (0.5 * torch.randn(experts, 2 * intermediate, generator=generator)).to(dtype)
    b2 = (0.5 * torch.randn(experts, hidden, generator=generator)).to(dtype)
    return [tensor.to(device) for tensor in (x, w13, w2, topk_ids, topk_weights.to(dtype), b13, b2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate", [
    pytest.param(1, 4, 7, 48, 40, id="one-token-prime-experts"),
    pytest.param(5, 3, 11, 33, 24, id="odd-hidden-prime-experts"),
])
@pytest.mark.parametrize("biases", ["both", "none", "b13-only"])
@pytest.mark.parametrize("preload", [False, True], ids=["no-preload", "preload"])
def test_clamped_gemv_matches_the_gpt_oss_reference(tokens, top_k, experts, hidden, intermediate, dtype, biases,
                                                    preload, monkeypatch):
    """`preload`: down's first tile loaded before the wait, as on a GPU under PDL (kernels.pdl): with one tile per
    pair, that tile is the first pair's last, whose bias must still be added."""
    from kernels import moe_gemv

    monkeypatch.setattr(moe_gemv.pdl, "preload", lambda device, kernel: preload)
    x, w13, w2, ids, weights, b13, b2 = _case(tokens, top_k, experts, hidden, intermediate, dtype)
    b13, b2 = {"both": (b13, b2), "none": (None, None), "b13-only": (b13, None)}[biases]
    reference = moe_reference_gpt_oss(x, w13, w2, ids, weights, b13, b2, ALPHA, LIMIT)
    gate = (x.float() @ w13[ids[0, 0].long(), :intermediate].float().t())
    assert (gate > LIMIT).any(), "the clamp must engage on these inputs"
    with scratch.poison_new_buffers():
        out = moe_gemv_clamped(x, w13, w2, ids, weights, b13, b2, ALPHA, LIMIT)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert relative_error(out, reference) <= TOLERANCE[dtype]


def test_clamped_gemv_refuses_mis_shaped_biases():
    x, w13, w2, ids, weights, b13, b2 = _case(2, 2, 5, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="b13 must be"):
        moe_gemv_clamped(x, w13, w2, ids, weights, b13[:, :8], b2, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="b2 must be"):
        moe_gemv_clamped(x, w13, w2, ids, weights, b13, b2.t().contiguous(), ALPHA, LIMIT)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_clamped_gemv_in_bf16_on_the_gpu_and_in_a_graph(tokens):
    x, w13, w2, ids, weights, b13, b2 = _case(tokens, 4, 32, 2880 // 4, 2880 // 4, torch.bfloat16, "cuda")
    reference = moe_reference_gpt_oss(x, w13, w2, ids, weights, b13, b2, ALPHA, LIMIT)
    eager = moe_gemv_clamped(x, w13, w2, ids, weights, b13, b2, ALPHA, LIMIT)
    assert relative_error(eager, reference) <= TOLERANCE[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemv_clamped(x, w13, w2, ids, weights, b13, b2, ALPHA, LIMIT)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
