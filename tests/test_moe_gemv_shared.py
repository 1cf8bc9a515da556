"""kernels.moe_gemv with shared experts in its two launches (`shared=(gate_up, down)`) against the torch
reference: the routed sum (kernels.reference.moe_reference, ids outside [0, E) adding nothing) plus the shared
SwiGLU of every token at weight exactly 1; and the dispatcher's choice of where a layer's shared experts run
(`Dispatcher._shared_path`, the record's shared_path and shared_reason, the flag shared_fold).

CPU: Triton's interpreter (the kernels use no tl.dot, so fp32 and fp16 are exact to their rounding), small odd
shapes, fresh random inputs inside `poison_new_buffers()` (an element a kernel forgot to write is NaN). The sm_90
build of the fold compiles here without a GPU (a child process: bench/moe_shared_fold_sass.py). GPU (`-m gpu`):
bf16 at DeepSeek-V2-Lite's widths, eager and replayed in a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_moe_kernels import TOLERANCE, make_layer, make_routing, relative_error

from kernels import launches, scratch
from kernels import moe_gemv as moe_gemv_module
from kernels.moe_gemv import moe_gemv
from kernels.reference import moe_reference


def _shared_weights(hidden, shared_intermediate, dtype, generator, device="cpu"):
    """gate_up [2Fs, D] (gate rows then up rows, as engine.hf_loader packs them) and down [D, Fs], O(1) outputs."""
    gate_up = torch.randn(2 * shared_intermediate, hidden, generator=generator) * hidden ** -0.5
    down = torch.randn(hidden, shared_intermediate, generator=generator) * shared_intermediate ** -0.5
    return gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype)


def _swiglu(x, gate_up, down):
    """engine.model.swiglu in fp32: the shared experts' term."""
    gate, up = (x.float() @ gate_up.float().t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.float().t()


def _routed(x, w13, w2, topk_ids, topk_weights):
    """moe_reference where ids outside [0, E) count as expert 0 at weight 0 (they add an exact 0)."""
    valid = (topk_ids >= 0) & (topk_ids < w13.shape[0])
    return moe_reference(x.float(), w13.float(), w2.float(), torch.where(valid, topk_ids, 0),
                         torch.where(valid, topk_weights, 0.0).float())


# (T, k, E, D, F, Fs): one and two shared experts of the routed F (DeepSeek: Fs = n_shared F), an Fs that is
# not a multiple of F (the last chunk masked), one below F, several rows, odd D
SHAPES = [
    pytest.param(1, 2, 5, 33, 12, 12, id="one-row-n_shared-1"),
    pytest.param(1, 3, 7, 40, 16, 32, id="one-row-n_shared-2"),
    pytest.param(3, 2, 6, 27, 12, 30, id="3-rows-Fs-30-of-F-12"),
    pytest.param(4, 3, 9, 45, 20, 7, id="4-rows-Fs-7-below-F"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, shared_intermediate", SHAPES)
def test_shared_pairs_add_the_shared_swiglu_at_weight_one(tokens, top_k, experts, hidden, intermediate,
                                                          shared_intermediate, dtype):
    generator = torch.Generator().manual_seed(tokens * 131 + hidden + shared_intermediate)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    topk_weights = (topk_weights * 1.5).to(dtype)  # a routed_scaling_factor in the weights, as engine.model
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, dtype, generator)
    gate_up, down = _shared_weights(hidden, shared_intermediate, dtype, generator)
    topk_ids[-1, 0] = -1  # ids outside [0, E): exact zeros, the shared term still added
    if tokens > 1:
        topk_ids[0, top_k - 1] = experts + 2
    routed, shared = _routed(x, w13, w2, topk_ids, topk_weights), _swiglu(x, gate_up, down)
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=(gate_up, down))
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert relative_error(out, routed + shared) <= TOLERANCE[dtype]
    # the check can tell: the shared term dropped, or weighted by the routing's scale, is far outside it
    assert relative_error(out, routed) > 30 * TOLERANCE[dtype]
    assert relative_error(out, routed + 1.5 * shared) > 30 * TOLERANCE[dtype]


def test_a_row_with_no_valid_id_gets_exactly_its_shared_term():
    """Every routed id of row 0 outside [0, E): its pairs add exact zeros whatever their weights, so the row is
    the shared SwiGLU alone (and the same bits with other weights on those ids)."""
    tokens, top_k, experts, hidden, intermediate, shared_intermediate = 2, 3, 5, 29, 12, 24
    generator = torch.Generator().manual_seed(3)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, torch.float32, generator)
    gate_up, down = _shared_weights(hidden, shared_intermediate, torch.float32, generator)
    topk_ids[0] = torch.tensor([-1, experts, 2 ** 31 - 1], dtype=torch.int32)
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=(gate_up, down))
        reweighted = moe_gemv(x, w13, w2, topk_ids, topk_weights * 7, shared=(gate_up, down))
    assert torch.equal(out[0], reweighted[0]) and not torch.equal(out[1], reweighted[1])
    assert relative_error(out[0:1], _swiglu(x[:1], gate_up, down)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_shared_walks_span_several_tiles_with_masked_tails(dtype, monkeypatch):
    """Narrowed blocks: gate-up walks D in 3 steps, down walks each routed pair's F in 2 tiles and the shared Fs
    in 4 (the last masked), as V2-Lite's shapes do at full blocks (F 1408 = 1024 + 384, Fs 2816)."""
    monkeypatch.setattr(moe_gemv_module, "GATE_UP_BLOCK_D", 16)
    monkeypatch.setattr(moe_gemv_module, "DOWN_BLOCK_F", 16)
    tokens, top_k, experts, hidden, intermediate, shared_intermediate = 2, 2, 5, 45, 22, 50
    generator = torch.Generator().manual_seed(11)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, dtype, generator)
    gate_up, down = _shared_weights(hidden, shared_intermediate, dtype, generator)
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, topk_ids, topk_weights.to(dtype), shared=(gate_up, down))
    assert relative_error(out, _routed(x, w13, w2, topk_ids, topk_weights) + _swiglu(x, gate_up, down)) \
        <= TOLERANCE[dtype]


def test_the_fold_is_two_launches_and_bit_reproducible():
    tokens, top_k, experts, hidden, intermediate, shared_intermediate = 1, 3, 6, 31, 10, 20
    generator = torch.Generator().manual_seed(5)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, torch.float16, generator)
    gate_up, down = _shared_weights(hidden, shared_intermediate, torch.float16, generator)
    other = make_layer(tokens, hidden, intermediate, experts, torch.float16, generator)
    outs = []
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        for inputs in ((x, w13, w2), other, (x, w13, w2)):  # A, B, A: the second A the same bits
            outs.append(moe_gemv(*inputs, topk_ids, topk_weights.half(), shared=(gate_up, down)))
    assert launches.since(before) == {"moe_gemv.gate_up": 3, "moe_gemv.down": 3}
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])


def test_shared_weights_that_do_not_fit_are_refused():
    x = torch.randn(1, 16)
    w13, w2 = torch.randn(4, 2 * 8, 16), torch.randn(4, 16, 8)
    ids, weights = torch.tensor([[0, 2]], dtype=torch.int32), torch.ones(1, 2)
    cases = [((torch.randn(2 * 12, 15), torch.randn(16, 12)), "gate_up"),  # D differs
             ((torch.randn(25, 16), torch.randn(16, 12)), "gate_up"),  # an odd row count
             ((torch.randn(2 * 12, 16), torch.randn(16, 11)), "down"),
             ((torch.randn(2 * 12, 16).half(), torch.randn(16, 12)), "float32 tensor"),
             ((torch.randn(2 * 12, 16), torch.randn(12, 16).t()), "contiguous")]
    for shared, word in cases:
        with pytest.raises(ValueError, match=word):
            moe_gemv(x, w13, w2, ids, weights, shared=shared)


# ------------------------------------------------------------------------------------------------ sm_90 build

_COMPILE = """
import json, sys
sys.path.insert(0, "bench")
import moe_shared_fold_sass as report
from kernels import moe_gemv
rows = {}
for label, (fn, constexprs) in report._configs(moe_gemv).items():
    kernel = report._build(fn, dict(constexprs, SHARED_CHUNKS=2), fold=True)
    rows[label] = report._usage(kernel)
print(json.dumps(rows))
"""


def test_the_fold_builds_for_sm90_within_the_routed_builds_registers():
    """The fold's gate-up and down build for Hopper (Triton's bundled ptxas, no GPU) at <= 96 registers: the routed
    F_STEPS=2 build's, 5 programs of 4 warps an SM (docs/decode-step.md: the fold's one-step gate-up rises from 80).
    That the routed-only build is the same SASS as before the fold: bench/moe_shared_fold_sass.py --against REV."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sass_loops

    if sass_loops.cuobjdump() is None:
        pytest.skip("no cuobjdump in this Triton")
    rows = sass_loops.compiled_in_child(_COMPILE)
    assert set(rows) == {"gate_up F_STEPS=1", "gate_up F_STEPS=2", "down"}
    assert all(row["registers"] is not None and row["registers"] <= 96 and row["stack"] == 0
               for row in rows.values()), rows


# ------------------------------------------------------------------------------------------------ GPU

V2_LITE = dict(hidden=2048, experts=64, intermediate=1408, top_k=6, shared_intermediate=2 * 1408)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_gpu_fold_at_v2_lite_widths_in_a_cuda_graph(tokens):
    """bf16 at V2-Lite's widths (weights drawn on the GPU): the fold against the fp32 reference and against the
    launches kept apart (routed moe_gemv + the shared experts' one-expert moe_gemv, added in bf16); captured in
    a CUDA graph, each replay on new routing and activations gives the eager call's bits."""
    from test_moe_kernels import _capture

    shape, device = V2_LITE, torch.device("cuda")
    hidden, experts, intermediate, shared_intermediate = (shape["hidden"], shape["experts"], shape["intermediate"],
                                                          shape["shared_intermediate"])
    generator = torch.Generator(device=device).manual_seed(tokens)

    def draw(*size, scale=1.0):
        return (torch.randn(*size, generator=generator, device=device) * scale).to(torch.bfloat16)

    w13 = draw(experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    w2 = draw(experts, hidden, intermediate, scale=intermediate ** -0.5)
    gate_up = draw(2 * shared_intermediate, hidden, scale=hidden ** -0.5)
    down = draw(hidden, shared_intermediate, scale=shared_intermediate ** -0.5)
    x = draw(tokens, hidden)
    routing = torch.Generator().manual_seed(tokens)
    topk_ids, topk_weights = make_routing(tokens, shape["top_k"], experts, routing, device="cuda")
    topk_weights = topk_weights.to(torch.bfloat16)
    reference = _routed(x, w13, w2, topk_ids, topk_weights) + _swiglu(x, gate_up, down)
    eager = moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=(gate_up, down))
    ones = (torch.zeros((tokens, 1), dtype=torch.int32, device=device),
            torch.ones((tokens, 1), dtype=torch.bfloat16, device=device))
    apart = moe_gemv(x, w13, w2, topk_ids, topk_weights) + moe_gemv(x, gate_up[None], down[None], *ones)
    # bf16: each pair's hidden and the output rounded once (apart: three output roundings and an add), 1e-2
    assert relative_error(eager, reference) <= TOLERANCE[torch.bfloat16]
    assert relative_error(apart, reference) <= TOLERANCE[torch.bfloat16]
    before = launches.snapshot()
    graph, static_out = _capture(lambda: moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=(gate_up, down)))
    assert launches.since(before) == {"moe_gemv.gate_up": 2, "moe_gemv.down": 2}  # warm-up and capture
    for replay in range(2):  # new routing and activations into the captured buffers, then replay
        new_ids, new_weights = make_routing(tokens, shape["top_k"], experts, routing, device="cuda")
        topk_ids.copy_(new_ids)
        topk_weights.copy_(new_weights.to(torch.bfloat16))
        x.copy_(draw(tokens, hidden))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, moe_gemv(x, w13, w2, topk_ids, topk_weights, shared=(gate_up, down)))
        assert relative_error(static_out, _routed(x, w13, w2, topk_ids, topk_weights) + _swiglu(x, gate_up, down)) \
            <= TOLERANCE[torch.bfloat16]


# ------------------------------------------------------------------------------------------------ the flag


def test_shared_fold_flag_is_on_by_default_typed_and_recorded():
    from engine import flags
    from engine.errors import UserError

    resolved = flags.resolve(environ={})
    assert resolved["shared_fold"] is True and resolved.sources["shared_fold"] == flags.DEFAULT
    assert "shared_fold=on" in resolved.describe()  # what results headers and bench footers print
    off = flags.resolve(["shared_fold=off"], environ={"MOEI_SHARED_FOLD": "on"})
    assert off["shared_fold"] is False and off.to_json()["shared_fold"] == {"value": False, "source": flags.COMMAND_LINE}
    assert flags.resolve(environ={"MOEI_SHARED_FOLD": "off"})["shared_fold"] is False
    with pytest.raises(UserError, match="flag shared_fold in --set: 'sometimes' is not allowed; allowed: on or off"):
        flags.resolve(["shared_fold=sometimes"], environ={})
