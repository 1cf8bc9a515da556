"""MoE kernels against the naive torch reference, the alignment's invariants, bit-identity of the
grouped variants, launch counters, and (on a GPU) CUDA-graph replay and sync-freedom.

CPU: Triton runs under TRITON_INTERPRET=1 (conftest) at small shapes in fp32 and fp16 — not bf16:
the interpreter computes tl.dot on bf16 wrongly. GPU (`-m gpu`): bf16 at realistic shapes.
Every check draws fresh random inputs (never zeros) and runs inside `poison_new_buffers()`, so a
row a kernel forgot to write is NaN or an impossible index, not a lucky zero.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kernels import arrivals, launches, scratch
from kernels import moe_align as moe_align_module
from kernels import moe_gemv as moe_gemv_module
from kernels.moe_align import FUSED_MAX_PAIRS, MoeAlignment, moe_align
from kernels.moe_gemv import moe_gemv
from kernels.moe_grouped import DEFAULT_TILE_M, ROWS_PER_PROGRAM, TILE_M_CHOICES, moe_grouped
from kernels.moe_peer import grouped_mm_available, moe_torch_grouped_mm
from kernels.reference import moe_reference

HAS_CUDA = torch.cuda.is_available()

# ‖out − ref‖ / ‖ref‖ allowed per dtype. The reference computes in fp32 from the same inputs; the
# kernels round the SiLU·mul intermediate and each pair's down row to the input dtype, so the
# error is a few units in the last place of that dtype:
#   fp32  only the summation order differs (seen ~3e-7); 1e-5 leaves margin, a wrong row is O(1)
#   fp16  11-bit mantissa, two extra roundings (seen ~4e-4)
#   bf16  8-bit mantissa, two extra roundings (seen ~4e-3 for torch's own grouped_mm pipeline)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_routing(tokens, top_k, experts, generator, device="cpu", *, avoid=(), cover_all=False):
    """topk_ids [T, k] int32 (k distinct experts per token) and softmax weights [T, k].

    avoid: experts that get no token. cover_all: every expert gets at least one pair (needs
    T*k >= E)."""
    allowed = [e for e in range(experts) if e not in avoid]
    assert top_k <= len(allowed)
    labels = torch.tensor(allowed)[torch.randperm(len(allowed), generator=generator)]
    rows = []
    for token in range(tokens):
        if cover_all:  # consecutive pairs walk the shuffled labels, so all appear, k distinct per token
            rows.append(labels[(token * top_k + torch.arange(top_k)) % len(allowed)])
        else:
            rows.append(labels[torch.randperm(len(allowed), generator=generator)[:top_k]])
    topk_ids = torch.stack(rows).to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=1)
    return topk_ids.to(device), topk_weights.to(device)


def make_layer(tokens, hidden, intermediate, experts, dtype, generator, device="cpu"):
    """x [T, D], w13 [E, 2F, D], w2 [E, D, F], scaled so activations stay O(1)."""
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) * intermediate**-0.5
    return tuple(t.to(device=device, dtype=dtype) for t in (x, w13, w2))


# Grouped arm and alignment: (T, k, E, D, F, tile_m, routing options), each named for the edge
# it covers. Small D and F: the interpreter pays per program and per op, not per element.
GROUPED_EDGE_SHAPES = [
    pytest.param(1, 2, 8, 32, 32, 16, {}, id="one-token"),
    pytest.param(5, 2, 8, 32, 32, 16, {}, id="n-below-tile_m"),
    pytest.param(9, 3, 13, 32, 32, 16, {}, id="prime-E-13"),
    pytest.param(6, 2, 7, 32, 64, 32, {"cover_all": True}, id="all-experts-woken-prime-E-7"),
    pytest.param(10, 2, 8, 32, 32, 16, {"avoid": (0, 3)}, id="experts-with-zero-tokens"),
    pytest.param(7, 3, 8, 32, 32, 16, {}, id="nk-21-not-multiple-of-tile_m"),
    pytest.param(9, 3, 7, 33, 17, 32, {}, id="odd-D-33-F-17"),
    pytest.param(12, 4, 5, 32, 32, 64, {}, id="tile_m-64"),
    # every token on expert 1: 70 pairs = 5 m-tiles (10 padding rows) = two 64-row windows
    pytest.param(70, 1, 3, 32, 32, 16, {"avoid": (0, 2)}, id="expert-spans-two-windows-padding-rows"),
    pytest.param(22, 3, 6, 32, 32, 32, {}, id="66-pairs-span-two-align-chunks"),
]
# GEMV arm: (T, k, E, D, F, routing options). It has no tiles, windows or chunks: its edges are
# the token count, the expert count (ids index w13/w2 directly), experts left empty, and D/F that
# are not multiples of its blocks.
GEMV_EDGE_SHAPES = [
    pytest.param(1, 2, 8, 32, 32, {}, id="one-token"),
    pytest.param(4, 3, 13, 32, 32, {}, id="prime-E-13"),
    pytest.param(5, 2, 8, 32, 32, {"avoid": (0, 3)}, id="experts-with-zero-tokens"),
    pytest.param(4, 3, 7, 33, 17, {}, id="odd-D-33-F-17"),
    # down's "last program reduces" over k pair programs per (token, 8-output block)
    pytest.param(3, 6, 11, 45, 23, {}, id="3-tokens-top-6-odd-D-45-F-23"),
    pytest.param(16, 2, 9, 19, 12, {}, id="16-tokens-odd-D-19-F-12"),
]


# ---------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------

def check_alignment(topk_ids: torch.Tensor, experts: int, tile_m: int, window_rows: int = ROWS_PER_PROGRAM) -> None:
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    with scratch.poison_new_buffers():
        align = moe_align(topk_ids, experts, tile_m, window_rows=window_rows)
    flat = topk_ids.reshape(-1).long().cpu()
    sorted_pair_ids = align.sorted_pair_ids.long().cpu()
    tile_expert_ids = align.tile_expert_ids.long().cpu()
    window_first_tiles = align.window_first_tiles.long().cpu()
    padded_offsets = align.padded_offsets.long().cpu()
    counts = torch.bincount(flat, minlength=experts)

    # sizes come from host bounds only (A = experts that can be woken)
    active = min(experts, num_pairs)
    max_tiles = (num_pairs + active * (tile_m - 1)) // tile_m
    window_rows = max(window_rows, tile_m)
    assert align.tile_expert_ids.numel() == max_tiles
    assert align.sorted_pair_ids.numel() == max_tiles * tile_m
    assert align.window_first_tiles.numel() == active + (num_pairs - active) // window_rows

    # per-expert counts and offsets: they sum to n*k
    assert torch.equal(align.expert_counts.long().cpu(), counts)
    assert torch.equal(align.expert_offsets.long().cpu(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    assert align.expert_offsets[-1].item() == num_pairs
    padded = (counts + tile_m - 1) // tile_m * tile_m
    assert torch.equal(padded_offsets, torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)]))

    # every pair exactly once, padding rows marked with the sentinel N, stable order in each expert
    real = sorted_pair_ids[sorted_pair_ids != num_pairs]
    assert torch.equal(real, torch.argsort(flat, stable=True))
    assert sorted_pair_ids.min() >= 0 and sorted_pair_ids.max() <= num_pairs
    assert (sorted_pair_ids == num_pairs).sum().item() == sorted_pair_ids.numel() - num_pairs
    assert torch.equal(sorted_pair_ids[align.pair_rows.long().cpu()], torch.arange(num_pairs))

    # tiles never mix experts; padding rows only at the end of an expert's last tile
    used_tiles = align.used_tiles.item()
    assert used_tiles == int((padded // tile_m).sum())
    assert (tile_expert_ids[used_tiles:] == -1).all()
    for tile in range(used_tiles):
        expert = tile_expert_ids[tile].item()
        rows = sorted_pair_ids[tile * tile_m:(tile + 1) * tile_m]
        pairs = rows[rows != num_pairs]
        assert len(pairs) > 0, f"tile {tile} holds only padding"
        assert (flat[pairs] == expert).all(), f"tile {tile} mixes experts"
        first_padding = (rows == num_pairs).nonzero()
        if len(first_padding):
            assert (rows[first_padding[0, 0]:] == num_pairs).all(), "padding before a pair inside a tile"
        assert padded_offsets[expert] <= tile * tile_m < padded_offsets[expert + 1]

    # windows: consecutive tiles of one expert, covering every used tile exactly once
    used_windows = align.used_windows.item()
    assert (window_first_tiles[used_windows:] == -1).all()
    covered = []
    for window in range(used_windows):
        first = window_first_tiles[window].item()
        expert = tile_expert_ids[first].item()
        tiles = [t for t in range(first, first + align.window_tiles) if t < used_tiles and tile_expert_ids[t] == expert]
        covered.extend(tiles)
    assert covered == list(range(used_tiles))


@pytest.mark.parametrize("window", ["64-row-windows", "one-tile-windows"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, tile_m, routing", GROUPED_EDGE_SHAPES)
def test_alignment_invariants(tokens, top_k, experts, hidden, intermediate, tile_m, routing, window):
    generator = torch.Generator().manual_seed(tokens * 1000 + experts)
    topk_ids, _ = make_routing(tokens, top_k, experts, generator, **routing)
    check_alignment(topk_ids, experts, tile_m, ROWS_PER_PROGRAM if window == "64-row-windows" else tile_m)


@pytest.mark.parametrize("tile_m", [16, 64])
def test_alignment_many_chunks_uses_scan_loop(tile_m):
    # 700 tokens x top-4 = 2800 pairs = 44 chunks of 64: more than one block of the scan kernel
    generator = torch.Generator().manual_seed(tile_m)
    topk_ids, _ = make_routing(700, 4, 16, generator)
    before = launches.snapshot()
    check_alignment(topk_ids.to(torch.int64), 16, tile_m)  # int64 ids, as torch.topk gives them
    assert launches.since(before) == {"moe_align.count": 1, "moe_align.scan": 1, "moe_align.place": 1}


# Fused (one launch, N <= FUSED_MAX_PAIRS) against the multi-kernel path: (T, k, E, routing), each
# named for the edge it covers; every one runs at tile_m 16/32/64 with 64-row windows, and with
# one-tile windows too (at tile_m 16 only for E >= 64, whose interpreter runs cost ~1 s each).
FUSED_ALIGN_SHAPES = [
    ("one-token", 1, 2, 8, {}),
    ("n-below-tile_m", 5, 2, 8, {}),
    ("prime-E-13", 9, 3, 13, {}),
    ("all-experts-woken-k-equals-E", 3, 7, 7, {}),
    ("experts-with-zero-tokens", 10, 2, 8, {"avoid": (0, 3)}),
    ("nk-21-not-multiple-of-tile_m", 7, 3, 8, {}),
    ("ids-outside-0-E-dropped", 9, 3, 13, {"dropped": True}),
    ("v4-shape-64-tokens-top-6", 64, 6, 256, {}),
    ("nk-512-exactly-E-64", 64, 8, 64, {}),
    ("E-600-past-256-narrower-blocks", 20, 4, 600, {}),
]
FUSED_ALIGN_CASES = [
    pytest.param(tokens, top_k, experts, routing, tile_m, window, id=f"{name}-tile_m-{tile_m}-{window}")
    for name, tokens, top_k, experts, routing in FUSED_ALIGN_SHAPES
    for tile_m in (16, 32, 64)
    for window in ("64-row-windows", "one-tile-windows")
    if window == "64-row-windows" or experts < 64 or tile_m == 16
]


def _align_recording_launches(topk_ids, experts, tile_m, window_rows, **path):
    before = launches.snapshot()
    with scratch.poison_new_buffers():
        align = moe_align(topk_ids, experts, tile_m, window_rows=window_rows, **path)
    return align, launches.since(before)


def _multi_kernel_launches(num_pairs: int) -> dict[str, int]:
    scan = {"moe_align.scan": 1} if num_pairs > moe_align_module.CHUNK_PAIRS else {}
    return {"moe_align.count": 1, **scan, "moe_align.place": 1}


@pytest.mark.parametrize("tokens, top_k, experts, routing, tile_m, window", FUSED_ALIGN_CASES)
def test_fused_alignment_equals_multi_kernel_path(tokens, top_k, experts, routing, tile_m, window):
    generator = torch.Generator().manual_seed(tokens * 131 + top_k * 17 + experts + tile_m)
    routing = dict(routing)
    dropped = routing.pop("dropped", False)
    topk_ids, _ = make_routing(tokens, top_k, experts, generator, **routing)
    if dropped:  # -1 (a dropped pair), an id past E below E_PAD, one past E_PAD: all match no expert
        topk_ids[1, 0], topk_ids[4, 2], topk_ids[6, 1] = -1, experts + 1, 2 * experts
    window_rows = ROWS_PER_PROGRAM if window == "64-row-windows" else tile_m
    fused, fused_launches = _align_recording_launches(topk_ids, experts, tile_m, window_rows)
    reference, reference_launches = _align_recording_launches(topk_ids, experts, tile_m, window_rows, fused=False)
    # the launch counters say which path ran: one launch, against two or three
    assert fused_launches == {"moe_align.fused": 1}
    assert reference_launches == _multi_kernel_launches(tokens * top_k)
    # every field equal, padding sentinels and unused (-1) entries included
    for field in MoeAlignment._fields:
        got, want = getattr(fused, field), getattr(reference, field)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape, field
            assert torch.equal(got, want), f"{field} differs"
        else:
            assert got == want, field
    if not dropped:  # and the fused tensors satisfy every invariant on their own
        check_alignment(topk_ids, experts, tile_m, window_rows)


def test_alignment_above_fused_bound_takes_multi_kernel_path():
    # 171 tokens x top-3 = 513 pairs: one past FUSED_MAX_PAIRS
    generator = torch.Generator().manual_seed(513)
    topk_ids, _ = make_routing(171, 3, 16, generator)
    assert topk_ids.numel() == FUSED_MAX_PAIRS + 1
    _, used = _align_recording_launches(topk_ids, 16, 16, ROWS_PER_PROGRAM)
    assert used == _multi_kernel_launches(topk_ids.numel())
    with pytest.raises(ValueError, match="fused alignment takes at most 512 pairs"):
        moe_align(topk_ids, 16, 16, fused=True)
    # at the bound itself the fused kernel runs
    _, used = _align_recording_launches(topk_ids[:128, :4].contiguous(), 16, 16, ROWS_PER_PROGRAM)
    assert used == {"moe_align.fused": 1}


@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, tile_m, routing", [
    pytest.param(9, 3, 13, 32, 32, 16, {}, id="prime-E-13"),
    pytest.param(70, 1, 3, 32, 32, 16, {"avoid": (0, 2)}, id="expert-spans-two-windows-padding-rows"),
    pytest.param(12, 4, 5, 32, 32, 64, {}, id="tile_m-64"),
])
def test_grouped_output_bit_identical_through_fused_alignment(tokens, top_k, experts, hidden, intermediate, tile_m,
                                                              routing, monkeypatch):
    inputs = _edge_case(tokens, top_k, experts, hidden, intermediate, routing, torch.float32)
    outs = {}
    for path, bound in (("fused", FUSED_MAX_PAIRS), ("multi-kernel", 0)):
        monkeypatch.setattr(moe_align_module, "FUSED_MAX_PAIRS", bound)  # 0: every N takes three launches
        for variant in (0, 2):
            before = launches.snapshot()
            with scratch.poison_new_buffers():
                outs[path, variant] = moe_grouped(*inputs, tile_m=tile_m, variant=variant)
            align_launches = {k: v for k, v in launches.since(before).items() if k.startswith("moe_align.")}
            expected = {"moe_align.fused": 1} if path == "fused" else _multi_kernel_launches(tokens * top_k)
            assert align_launches == expected, (path, variant)
    for variant in (0, 2):
        assert torch.equal(outs["fused", variant], outs["multi-kernel", variant]), f"v{variant}"


def test_alignment_rejects_bad_arguments():
    ids = torch.zeros(4, 2, dtype=torch.int32) + torch.arange(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="tile_m must be a power of two"):
        moe_align(ids, 8, 12)
    with pytest.raises(ValueError, match=r"\[tokens, k\]"):
        moe_align(ids.reshape(-1), 8, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        moe_align(ids.float(), 8, 16)
    with pytest.raises(ValueError, match="no pairs"):
        moe_align(ids[:0], 8, 16)


# ---------------------------------------------------------------------------------------------
# Kernels against the reference (interpreter on CPU)
# ---------------------------------------------------------------------------------------------

def _edge_case(tokens, top_k, experts, hidden, intermediate, routing, dtype):
    generator = torch.Generator().manual_seed(tokens * 31 + experts * 7 + hidden)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator, **routing)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, dtype, generator)
    return x, w13, w2, topk_ids, topk_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, routing", GEMV_EDGE_SHAPES)
def test_gemv_matches_reference(tokens, top_k, experts, hidden, intermediate, routing, dtype):
    inputs = _edge_case(tokens, top_k, experts, hidden, intermediate, routing, dtype)
    ref = moe_reference(*inputs)
    with scratch.poison_new_buffers():
        out = moe_gemv(*inputs)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, tile_m, routing", GROUPED_EDGE_SHAPES)
def test_grouped_variants_match_reference_bit_identically(tokens, top_k, experts, hidden, intermediate, tile_m,
                                                          routing, dtype):
    inputs = _edge_case(tokens, top_k, experts, hidden, intermediate, routing, dtype)
    ref = moe_reference(*inputs)
    with scratch.poison_new_buffers():
        outs = [moe_grouped(*inputs, tile_m=tile_m, variant=variant) for variant in (0, 1, 2)]
    for variant, out in enumerate(outs):
        assert out.dtype == dtype and out.shape == (tokens, hidden)
        assert relative_error(out, ref) <= TOLERANCE[dtype], f"grouped v{variant}"
    # the variants differ only in schedule: every bit must agree
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_out_of_range_ids_contribute_nothing():
    # an id of -1 (a dropped pair) must add nothing: same as the reference with weight 0
    generator = torch.Generator().manual_seed(5)
    topk_ids, topk_weights = make_routing(6, 3, 8, generator)
    x, w13, w2 = make_layer(6, 32, 32, 8, torch.float32, generator)
    topk_ids[1, 2] = -1
    topk_ids[4, 0] = -1
    reference_ids = topk_ids.clamp_min(0)
    reference_weights = torch.where(topk_ids < 0, 0.0, topk_weights)
    ref = moe_reference(x, w13, w2, reference_ids, reference_weights)
    with scratch.poison_new_buffers():
        assert relative_error(moe_gemv(x, w13, w2, topk_ids, topk_weights), ref) <= 1e-5
        assert relative_error(moe_grouped(x, w13, w2, topk_ids, topk_weights, variant=0), ref) <= 1e-5


def _dropped_ids_reference(x, w13, w2, topk_ids, topk_weights):
    """moe_reference where ids outside [0, E) count as expert 0 with routing weight 0."""
    valid = (topk_ids >= 0) & (topk_ids < w13.shape[0])
    return moe_reference(x, w13, w2, torch.where(valid, topk_ids, 0), torch.where(valid, topk_weights, 0.0))


def test_gemv_ids_outside_range_add_exact_zeros():
    # -1, E and larger ids: down reads expert 0's rows for them with weight 0 and their hidden rows (never
    # written: poisoned) as 0, so they add exact zeros; a token with no valid id gets an exact 0 row
    tokens, top_k, experts, hidden, intermediate = 4, 3, 8, 27, 20
    generator = torch.Generator().manual_seed(17)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, torch.float32, generator)
    topk_ids[0] = torch.tensor([-1, experts, 2**31 - 1], dtype=torch.int32)  # token 0 dropped entirely
    topk_ids[2, 1] = -5
    topk_ids[3, 2] = experts + 3
    with scratch.poison_new_buffers():
        out = moe_gemv(x, w13, w2, topk_ids, topk_weights)
    assert torch.equal(out[0], torch.zeros(hidden))
    assert relative_error(out, _dropped_ids_reference(x, w13, w2, topk_ids, topk_weights)) <= 1e-5


def test_gemv_repeated_calls_bit_identical():
    # A, B, A: the second A gives the same bits, on poisoned scratch (nothing read that a call did not write)
    generator = torch.Generator().manual_seed(23)
    cases = []
    for tokens, top_k, experts, hidden, intermediate in ((3, 6, 11, 21, 12), (2, 2, 5, 16, 8)):
        topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator)
        cases.append((*make_layer(tokens, hidden, intermediate, experts, torch.float16, generator), topk_ids, topk_weights))
    outs = []
    with scratch.poison_new_buffers():
        for inputs in (cases[0], cases[1], cases[0]):
            outs.append(moe_gemv(*inputs))
    assert torch.equal(outs[0], outs[2])
    assert relative_error(outs[1], moe_reference(*cases[1])) <= TOLERANCE[torch.float16]


def test_outgrown_arrival_buffer_is_kept_alive():
    # a kernel may need more counters than a captured graph's (attention decode, the fused GEMVs' arrivals):
    # a graph captured before the buffer grew keeps counting into the old buffer, which must not be freed
    device = torch.device("cpu")
    old = weakref.ref(arrivals.counters(device, 1)._base)
    grown = arrivals.counters(device, old().numel() + 1)
    gc.collect()
    assert old() is not None and grown.data_ptr() != old().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemv_multi_step_loops_match_reference(dtype, monkeypatch):
    # at v4-shape gate-up walks D in 8 steps of 512 and down walks F in 2 of 1024 per pair; narrowed blocks
    # run the same loops for 3 steps per pair with a masked tail at interpreter-sized D=45, F=40
    monkeypatch.setattr(moe_gemv_module, "GATE_UP_BLOCK_D", 16)
    monkeypatch.setattr(moe_gemv_module, "DOWN_BLOCK_F", 16)
    inputs = _edge_case(3, 2, 5, 45, 40, {}, dtype)
    with scratch.poison_new_buffers():
        out = moe_gemv(*inputs)
    assert relative_error(out, moe_reference(*inputs)) <= TOLERANCE[dtype]


def test_torch_grouped_mm_peer_matches_reference_on_cpu():
    if not grouped_mm_available("cpu"):
        pytest.skip("this torch build has no CPU torch._grouped_mm fallback (GPU test covers the arm)")
    generator = torch.Generator().manual_seed(11)
    # prime E with an expert left empty: offsets repeat, the grouped matmul must skip it
    topk_ids, topk_weights = make_routing(9, 3, 13, generator, avoid=(4,))
    x, w13, w2 = make_layer(9, 64, 32, 13, torch.bfloat16, generator)
    before = launches.snapshot()
    out = moe_torch_grouped_mm(x, w13, w2, topk_ids, topk_weights)
    assert launches.since(before) == {"torch_grouped_mm": 2}
    assert relative_error(out, moe_reference(x, w13, w2, topk_ids, topk_weights)) <= TOLERANCE[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# Contracts: launch counters and argument checks (host side, same on CPU and GPU)
# ---------------------------------------------------------------------------------------------

def test_launch_counters_are_exact():
    generator = torch.Generator().manual_seed(3)
    topk_ids, topk_weights = make_routing(5, 2, 8, generator)  # 10 pairs: the one-launch alignment
    x, w13, w2 = make_layer(5, 32, 32, 8, torch.float32, generator)
    before = launches.snapshot()
    moe_grouped(x, w13, w2, topk_ids, topk_weights, variant=1)
    assert launches.since(before) == {
        "moe_align.fused": 1,
        "moe_grouped.gate_up.v1": 1, "moe_grouped.down.v1": 1, "moe_grouped.reduce": 1,
    }
    before = launches.snapshot()
    moe_gemv(x, w13, w2, topk_ids, topk_weights)
    assert launches.since(before) == {"moe_gemv.gate_up": 1, "moe_gemv.down": 1}


def test_launchers_reject_bad_inputs():
    generator = torch.Generator().manual_seed(4)
    topk_ids, topk_weights = make_routing(3, 2, 4, generator)
    x, w13, w2 = make_layer(3, 32, 16, 4, torch.float32, generator)
    for launcher in (moe_gemv, moe_grouped):
        with pytest.raises(ValueError, match="w2 must be"):
            launcher(x, w13, w2[:, :, :8], topk_ids, topk_weights)
        with pytest.raises(ValueError, match="must have x's dtype"):
            launcher(x, w13.half(), w2, topk_ids, topk_weights)
        with pytest.raises(ValueError, match="topk_weights must be"):
            launcher(x, w13, w2, topk_ids, topk_weights[:, :1])
        with pytest.raises(ValueError, match="int32 or int64"):
            launcher(x, w13, w2, topk_ids.float(), topk_weights)
    with pytest.raises(ValueError, match="tile_m must be one of"):
        moe_grouped(x, w13, w2, topk_ids, topk_weights, tile_m=8)
    with pytest.raises(ValueError, match="variant must be one of"):
        moe_grouped(x, w13, w2, topk_ids, topk_weights, variant=3)
    with pytest.raises(ValueError, match="bf16 only"):
        moe_torch_grouped_mm(x, w13, w2, topk_ids, topk_weights)
    if not HAS_CUDA:  # without the interpreter, CPU tensors get a message, not a Triton pointer error
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv("TRITON_INTERPRET")
            with pytest.raises(ValueError, match="must be on a CUDA device"):
                moe_gemv(x, w13, w2, topk_ids, topk_weights)
            with pytest.raises(ValueError, match="must be on a CUDA device"):
                moe_grouped(x, w13, w2, topk_ids, topk_weights)
    assert DEFAULT_TILE_M in TILE_M_CHOICES


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at realistic shapes, graphs, sync-freedom
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (T, k, E, D, F, tile_m values), each named for what it covers. Few shapes on purpose: each
    # new width or k is a fresh Triton compile of every kernel, and bench/gpu_all.sh has minutes.
    pytest.param(1, 6, 16, 4096, 2048, (16,), id="decode-one-token-v4-width"),
    pytest.param(33, 4, 13, 2048, 1024, (16,), id="33-tokens-prime-E-13"),
    pytest.param(700, 6, 64, 1024, 512, TILE_M_CHOICES, id="several-m-tiles-per-expert-every-tile_m"),
    pytest.param(33, 4, 13, 1000, 520, (16,), id="odd-D-1000-F-520-not-multiples-of-block"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, experts, hidden, intermediate, tile_ms", GPU_SHAPES)
def test_gpu_arms_match_reference_bf16(tokens, top_k, experts, hidden, intermediate, tile_ms):
    generator = torch.Generator().manual_seed(tokens + experts)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator, device="cuda")
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, torch.bfloat16, generator, device="cuda")
    ref = moe_reference(x, w13, w2, topk_ids, topk_weights)
    with scratch.poison_new_buffers():
        outs = {"gemv": moe_gemv(x, w13, w2, topk_ids, topk_weights)}
        for tile_m in tile_ms:
            grouped = [moe_grouped(x, w13, w2, topk_ids, topk_weights, tile_m=tile_m, variant=v) for v in (0, 1, 2)]
            assert torch.equal(grouped[0], grouped[1]), f"tile_m={tile_m}: v0 != v1"
            assert torch.equal(grouped[0], grouped[2]), f"tile_m={tile_m}: v0 != v2"
            outs[f"grouped tile_m={tile_m}"] = grouped[0]
        if torch.cuda.get_device_capability() >= (9, 0):
            assert grouped_mm_available("cuda"), "torch._grouped_mm should run on sm90+"
            outs["torch_grouped_mm"] = moe_torch_grouped_mm(x, w13, w2, topk_ids, topk_weights)
    for name, out in outs.items():
        assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16], name


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", TILE_M_CHOICES)
def test_gpu_fused_alignment_equals_multi_kernel_path(tile_m):
    # the histogram, scan and layouts of the one-launch kernel as compiled for this GPU, at the
    # expert counts of the presets (8 = tiny, fewer than a warp of histogram bins; 64 = demo;
    # 256 = v4-shape), from one token to the last fused size (85 x 6 = 510, 64 x 8 = 512 pairs)
    generator = torch.Generator().manual_seed(tile_m)
    # one-tile windows at tile_m 16 only: every (E, tile_m, window) is a fresh compile
    windows = (ROWS_PER_PROGRAM, tile_m) if tile_m == 16 else (ROWS_PER_PROGRAM,)
    for experts, top_k in ((8, 2), (64, 6), (256, 6), (256, 8)):
        for tokens in (1, 2, 9, 11, 33, 64, 85):
            if tokens * top_k > FUSED_MAX_PAIRS:
                continue
            topk_ids, _ = make_routing(tokens, top_k, experts, generator, device="cuda")
            if tokens == 33:
                topk_ids = topk_ids.long()  # torch.topk's dtype
            for window_rows in windows:
                with scratch.poison_new_buffers():
                    fused = moe_align(topk_ids, experts, tile_m, window_rows=window_rows)
                    reference = moe_align(topk_ids, experts, tile_m, window_rows=window_rows, fused=False)
                for field in MoeAlignment._fields:
                    got, want = getattr(fused, field), getattr(reference, field)
                    same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
                    assert same, f"E={experts} k={top_k} n={tokens} window_rows={window_rows}: {field} differs"


def _capture(fn):
    """Warm up on a side stream (compiles outside the capture), then capture fn into a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn()
    return graph, static_out


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["grouped_v0", "grouped_v2", "gemv"])
def test_gpu_cuda_graph_replay_matches_eager(arm):
    tokens, top_k, experts, hidden, intermediate = 33, 6, 64, 1024, 512
    generator = torch.Generator().manual_seed(21)
    topk_ids, topk_weights = make_routing(tokens, top_k, experts, generator, device="cuda")
    x, w13, w2 = make_layer(tokens, hidden, intermediate, experts, torch.bfloat16, generator, device="cuda")
    if arm == "gemv":
        def run():
            return moe_gemv(x, w13, w2, topk_ids, topk_weights)
        expected_launches = {"moe_gemv.gate_up": 1, "moe_gemv.down": 1}
    else:
        variant = int(arm[-1])

        def run():
            return moe_grouped(x, w13, w2, topk_ids, topk_weights, tile_m=DEFAULT_TILE_M, variant=variant)
        expected_launches = {"moe_align.fused": 1,  # 33 x 6 = 198 pairs: one alignment launch
                             f"moe_grouped.gate_up.v{variant}": 1, f"moe_grouped.down.v{variant}": 1,
                             "moe_grouped.reduce": 1}
    before = launches.snapshot()
    graph, static_out = _capture(run)
    # the warm-up and the capture each recorded the launches once: exact counts, nothing else
    assert launches.since(before) == {name: 2 * count for name, count in expected_launches.items()}
    for _ in range(2):  # new routing and activations into the captured buffers, then replay
        new_ids, new_weights = make_routing(tokens, top_k, experts, generator, device="cuda")
        topk_ids.copy_(new_ids)
        topk_weights.copy_(new_weights)
        x.copy_(torch.randn(tokens, hidden, generator=generator).to(device="cuda", dtype=torch.bfloat16))
        graph.replay()
        eager = run()
        assert torch.equal(static_out, eager)
        assert relative_error(eager, moe_reference(x, w13, w2, topk_ids, topk_weights)) <= TOLERANCE[torch.bfloat16]


@pytest.fixture(scope="module")
def v4_weights():
    """w13, w2 at v4-shape (E=256, D=4096, F=2048, bf16: 12.9 GB), drawn on the GPU: a CPU randn in
    fp32 would need 26 GB and minutes. Built once for the module's v4 tests."""
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("v4-shape weights need about 13 GB of GPU memory plus the reference's")
    generator = torch.Generator(device="cuda").manual_seed(40)
    experts, hidden, intermediate = 256, 4096, 2048
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(experts, hidden, intermediate, generator=generator, device="cuda", dtype=torch.bfloat16)
    yield w13.mul_(hidden**-0.5), w2.mul_(intermediate**-0.5)
    del w13, w2
    torch.cuda.empty_cache()


def _v4_decode_inputs(tokens, experts, hidden, generator):
    topk_ids, topk_weights = make_routing(tokens, 6, experts, generator, device="cuda")
    x = torch.randn(tokens, hidden, generator=generator).to(device="cuda", dtype=torch.bfloat16)
    return x, topk_ids, topk_weights


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_gemv_v4_shape_decode_bit_reproducible(v4_weights, tokens):
    # the v4 decode shape: 512 down programs per token, each summing its 6 pairs in a fixed order; programs
    # run in a different order from call to call, the output bits must not change
    w13, w2 = v4_weights
    generator = torch.Generator().manual_seed(70 + tokens)
    x, topk_ids, topk_weights = _v4_decode_inputs(tokens, w13.shape[0], w13.shape[2], generator)
    if tokens > 1:  # dropped pairs (-1, E) on the compiled path too
        topk_ids[1, 3], topk_ids[tokens - 1, 0] = -1, w13.shape[0]
    with scratch.poison_new_buffers():
        outs = [moe_gemv(x, w13, w2, topk_ids, topk_weights) for _ in range(5)]
    for call, out in enumerate(outs[1:], start=2):
        assert torch.equal(out, outs[0]), f"call {call} differs from call 1"
    ref = _dropped_ids_reference(x, w13, w2, topk_ids, topk_weights)
    assert relative_error(outs[0], ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_gemv_v4_shape_one_token_graph_replays_equal_eager(v4_weights):
    # replayed back to back and after new inputs are copied in: the same bits as an eager call
    w13, w2 = v4_weights
    generator = torch.Generator().manual_seed(71)
    x, topk_ids, topk_weights = _v4_decode_inputs(1, w13.shape[0], w13.shape[2], generator)

    def run():
        return moe_gemv(x, w13, w2, topk_ids, topk_weights)

    graph, static_out = _capture(run)
    for _ in range(3):
        new_x, new_ids, new_weights = _v4_decode_inputs(1, w13.shape[0], w13.shape[2], generator)
        x.copy_(new_x)
        topk_ids.copy_(new_ids)
        topk_weights.copy_(new_weights)
        graph.replay()
        graph.replay()
        eager = run()
        assert torch.equal(static_out, eager)
        assert relative_error(eager, moe_reference(x, w13, w2, topk_ids, topk_weights)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_arms_never_wait_for_the_device():
    # E=256 top-6 at 64 tokens: the decode-to-prefill boundary of v4-shape routing
    generator = torch.Generator().manual_seed(8)
    topk_ids, topk_weights = make_routing(64, 6, 256, generator, device="cuda")
    x, w13, w2 = make_layer(64, 512, 256, 256, torch.bfloat16, generator, device="cuda")
    moe_grouped(x, w13, w2, topk_ids, topk_weights)  # compile outside the check
    moe_gemv(x, w13, w2, topk_ids, topk_weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
    try:
        moe_align(topk_ids, 256, DEFAULT_TILE_M)
        grouped = moe_grouped(x, w13, w2, topk_ids, topk_weights)
        gemv = moe_gemv(x, w13, w2, topk_ids, topk_weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = moe_reference(x, w13, w2, topk_ids, topk_weights)
    assert relative_error(grouped, ref) <= TOLERANCE[torch.bfloat16]
    assert relative_error(gemv, ref) <= TOLERANCE[torch.bfloat16]
