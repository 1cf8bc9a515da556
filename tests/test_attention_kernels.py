"""The fused prefill kernel (kernels.attention) and the split-KV decode kernel
(kernels.attention_decode; its single launch and its two-kernel path) against the unfused
reference, across mask kinds, chunked-prefill offsets, odd lengths, head dims, grouped-query
heads, fully masked rows and infinite sinks.

CPU: the Triton interpreter (conftest sets TRITON_INTERPRET=1) at small sizes in fp32 and fp16 —
not bf16, whose tl.dot the interpreter computes on the raw bits. GPU (-m gpu): bf16, larger.
Every input is fresh random data; every output buffer is poisoned with NaN before the kernel
writes it, so a row the kernel forgets to write fails the test.
"""

from __future__ import annotations

import pytest
import torch

from kernels import arrivals, launches
from kernels.attention import PrefillConfig, flash_attention
from kernels import attention_decode
from kernels.attention_decode import (
    MIN_TILES_PER_SPLIT,
    DecodeConfig,
    choose_splits,
    default_num_splits,
    flash_decode,
    merge_tile,
)
from kernels.reference import MaskSpec, attention_reference

# ‖out − ref‖ / ‖ref‖ allowed, per working dtype, against a float32 reference:
# - float32: the kernel uses exp2 and rescales tile by tile; measured ~3e-7. 1e-5 is 30x that and
#   still 4 orders below what a wrong mask costs (0.1 .. 1).
# - float16: probabilities and the output are rounded to fp16 (2^-11 relative each); measured
#   ~5e-4. 4e-3 leaves 8x.
# - bfloat16 (GPU only): 8x coarser than fp16 (2^-8).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1e-2}

COMPOSITE = MaskSpec("composite", window=8, block=4)
MASKS = {
    "causal": MaskSpec("causal"),
    "window": MaskSpec("window", window=8),
    "composite": COMPOSITE,
    "none": MaskSpec("none"),
}


def make_inputs(batch, q_len, k_len, heads, kv_heads, head_dim, dtype, seed, device="cpu"):
    """q as a slice of a packed [B, Tq, Hq + 2, hd] projection, k/v as views of a longer KV cache
    [B, Tk + 5, Hkv, hd]: the strides the engine passes, none of them contiguous."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    q = draw(batch, q_len, heads + 2, head_dim)[:, :, 1 : heads + 1]  # [B, Tq, Hq, hd] view
    k_cache = draw(batch, k_len + 5, kv_heads, head_dim)  # [B, ctx, Hkv, hd]
    v_cache = draw(batch, k_len + 5, kv_heads, head_dim)
    sinks = torch.randn(heads, generator=generator, device=device)  # [Hq] float32
    return q, k_cache[:, :k_len], v_cache[:, :k_len], sinks


def reference(q, k, v, sinks, spec, q_start, key_padding):
    """float32 reference from the (exactly representable) upcast inputs."""
    return attention_reference(q.float(), k.float(), v.float(), sinks, spec, q_start, key_padding)


def poisoned_like(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


def relative_error(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_matches(out, ref, dtype):
    assert torch.isfinite(out).all(), "NaN/inf in the kernel's output (or a row it never wrote)"
    error = relative_error(out, ref)
    assert error <= TOLERANCE[dtype], f"relative error {error:.3g} > {TOLERANCE[dtype]:.0e}"


def padding_for(batch, k_len, device="cpu"):
    padding = torch.zeros(batch, k_len, dtype=torch.bool, device=device)  # [B, Tk]
    padding[0, 4] = True  # a block-start (summary) key of COMPOSITE
    padding[0, k_len - 7] = True  # inside the window band of the last queries
    padding[1, :3] = True  # a left-padded second sequence
    return padding


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_prefill_masks_offsets_gqa(mask_name, dtype):
    # 13 queries x 37 keys: neither a multiple of a block; q_start 24 puts sequence 0's chunk at the
    # end of its cache (chunked prefill), 10 puts sequence 1's in the middle (later keys are future);
    # Hq 4 over Hkv 2 (GQA); padding on a summary key, inside the band, and left-padding.
    q, k, v, sinks = make_inputs(2, 13, 37, 4, 2, 64, dtype, seed=1)
    q_start = torch.tensor([24, 10])
    padding = padding_for(2, 37)
    spec = MASKS[mask_name]
    out = flash_attention(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), dtype)


@pytest.mark.parametrize("head_dim", [128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_head_dims(head_dim, dtype):
    # Every head dim in the kernel's table, short so the interpreter stays fast; at 512 the output
    # columns are split over two programs (block_dv 256), which this exercises.
    q, k, v, sinks = make_inputs(2, 7, 21, 4, 2, head_dim, dtype, seed=head_dim)
    q_start = torch.tensor([14, 3])
    padding = padding_for(2, 21)
    out = flash_attention(q, k, v, sinks, COMPOSITE, q_start, padding, out=poisoned_like(q))
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, q_start, padding), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_many_tiles_band_and_summaries(dtype):
    # Small blocks (16 x 16, 2 column programs) over 45 queries and 83 keys: the walk crosses from
    # the window band into the gathered block-start keys mid-tile, and several row tiles differ in
    # their band; q_start 38 and 0 (a whole prompt), one sequence padded at the front.
    q, k, v, sinks = make_inputs(2, 45, 83, 2, 1, 64, dtype, seed=7)
    q_start = torch.tensor([38, 0])
    padding = torch.zeros(2, 83, dtype=torch.bool)
    padding[1, :6] = True
    spec = MaskSpec("composite", window=11, block=5)
    config = PrefillConfig(block_m=16, block_n=16, block_dv=32, num_warps=4, num_stages=1)
    out = flash_attention(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), config=config)
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), dtype)


def test_prefill_drop_is_plain_causal():
    # The incident, reproduced by the caller's arguments: causal and no padding. The output equals
    # the causal reference and sits far from the composite one.
    q, k, v, sinks = make_inputs(1, 33, 33, 2, 2, 64, torch.float32, seed=3)
    padding = torch.zeros(1, 33, dtype=torch.bool)
    padding[0, :2] = True
    dropped = flash_attention(q, k, v, sinks, MaskSpec("causal"), 0, None)
    assert_matches(dropped, reference(q, k, v, sinks, MaskSpec("causal"), 0, None), torch.float32)
    assert relative_error(dropped, reference(q, k, v, sinks, COMPOSITE, 0, padding)) > 0.1


@pytest.mark.parametrize("with_sinks", [True, False])
def test_prefill_fully_masked_rows_are_zero(with_sinks):
    # Padding covers the whole window and every block start (0, 8) of queries 0..9: those rows see
    # nothing and must be exactly 0, with or without a sink, and never NaN.
    q, k, v, sinks = make_inputs(1, 16, 16, 2, 2, 64, torch.float32, seed=5)
    sinks = sinks if with_sinks else None
    padding = torch.zeros(1, 16, dtype=torch.bool)
    padding[0, :10] = True
    spec = MaskSpec("composite", window=4, block=8)
    out = flash_attention(q, k, v, sinks, spec, 0, padding, out=poisoned_like(q))
    assert torch.equal(out[0, :10], torch.zeros_like(out[0, :10]))
    assert_matches(out, reference(q, k, v, sinks, spec, 0, padding), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_infinite_sinks(dtype):
    # sigma = -inf (no sink), +inf (all mass on the sink: output 0), 0 and a large finite one, one
    # per query head, with GQA so two heads share a kv head.
    q, k, v, _ = make_inputs(1, 19, 19, 4, 2, 64, dtype, seed=11)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.0, 6.0])
    out = flash_attention(q, k, v, sinks, COMPOSITE, 0, None, out=poisoned_like(q))
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, 0, None), dtype)


def test_prefill_counts_one_launch():
    q, k, v, sinks = make_inputs(1, 5, 5, 2, 2, 64, torch.float32, seed=2)
    before = launches.snapshot()
    flash_attention(q, k, v, sinks, COMPOSITE, 0, None)
    assert launches.since(before) == {"flash_attention": 1}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"head_dim": 96}, "head_dim 96"),  # not a supported head dim
        ({"kv_heads": 3}, "multiple of key-value heads"),  # 4 query heads over 3 kv heads
    ],
)
def test_prefill_rejects_bad_shapes(change, message):
    shape = {"head_dim": 64, "kv_heads": 2} | change
    q = torch.randn(1, 4, 4, shape["head_dim"])
    k = torch.randn(1, 4, shape["kv_heads"], shape["head_dim"])
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k.clone(), None, COMPOSITE)


# ------------------------------------------------------------------------------------------------
# Decode (split KV; merged by the last split of each group, or by a second kernel)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_masks_offsets_gqa(query_len, mask_name, dtype):
    # One and three queries (decode, a tiny speculative chunk) per sequence at positions 70 and 30
    # of a 77-key cache; GQA 4/2 packs 2 x Tq rows per program; padding as in prefill; block_n 16
    # gives the walk several splits, the last ones shorter or empty.
    q, k, v, sinks = make_inputs(2, query_len, 77, 4, 2, 64, dtype, seed=query_len)
    q_start = torch.tensor([70, 30])
    padding = padding_for(2, 77)
    spec = MASKS[mask_name]
    out = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), num_splits=5,
                       config=DecodeConfig(block_n=16, num_stages=1))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_sink_counted_once_for_any_split_count(num_splits):
    # A large sink (sigma = 4) makes a sink counted per split visible at once; the answer must not
    # depend on how the walk is split.
    q, k, v, _ = make_inputs(1, 1, 130, 2, 2, 64, torch.float32, seed=13)
    sinks = torch.tensor([4.0, -1.0])
    out = flash_decode(q, k, v, sinks, MaskSpec("causal"), 129, None, out=poisoned_like(q),
                       num_splits=num_splits, config=DecodeConfig(block_n=16, num_stages=1))
    assert_matches(out, reference(q, k, v, sinks, MaskSpec("causal"), 129, None), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_head_dim_512(dtype):
    # The incident's head dim with its own table entry (block_n 32), GQA 4/1, composite + padding.
    q, k, v, sinks = make_inputs(2, 1, 45, 4, 1, 512, dtype, seed=17)
    q_start = torch.tensor([44, 20])
    padding = padding_for(2, 45)
    out = flash_decode(q, k, v, sinks, COMPOSITE, q_start, padding, out=poisoned_like(q), num_splits=3)
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, q_start, padding), dtype)


def test_decode_infinite_sinks_and_fully_masked_rows():
    # Sequence 1's query at position 9 sees only padded keys (its whole window and block starts
    # 0, 4, 8): 0 without NaN for every finite sink; sigma = +inf zeroes head 1 everywhere.
    q, k, v, _ = make_inputs(2, 1, 40, 4, 2, 64, torch.float32, seed=19)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.0, 6.0])
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, :10] = True
    q_start = torch.tensor([39, 9])
    out = flash_decode(q, k, v, sinks, COMPOSITE, q_start, padding, out=poisoned_like(q), num_splits=4,
                       config=DecodeConfig(block_n=16, num_stages=1))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, q_start, padding), torch.float32)


def test_decode_config_checks():
    with pytest.raises(ValueError, match="programs_per_sm"):
        DecodeConfig(block_n=16, num_stages=1, programs_per_sm=0)
    q, k = shapes_only(1, 8, 8, 8192)
    # Two programs per SM planned: 132 x 2 // 8 = 33 splits instead of 16.
    assert default_num_splits(q, k, MaskSpec("causal"), DecodeConfig(block_n=32, num_stages=3, programs_per_sm=2),
                              sms=132) == 33


def test_decode_counts_split_and_combine():
    q, k, v, sinks = make_inputs(1, 1, 20, 2, 2, 64, torch.float32, seed=23)
    before = launches.snapshot()
    flash_decode(q, k, v, sinks, COMPOSITE, 19, None, combine="kernel")
    assert launches.since(before) == {"flash_decode_split": 1, "flash_decode_combine": 1}


def group_counters(q, k):
    """The arrival counters flash_decode's single launch uses: one per (sequence, kv head)."""
    return arrivals.counters(q.device, q.shape[0] * k.shape[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_single_launch_matches_reference_and_kernel_path(num_splits, dtype):
    # One launch (combine="last"): 1 split writes out directly, 3 and the default (4 on CPU) merge in
    # the group's last program. Two queries per sequence at ragged offsets 49 / 17 of a 53-key
    # cache, GQA 4/2, padding, and sinks -inf, +inf (head 1 is 0), 0.3 and 2.0. The two-kernel path
    # runs the same merge code in the same split order, so the two outputs are equal to the bit.
    q, k, v, _ = make_inputs(2, 2, 53, 4, 2, 64, dtype, seed=43)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.3, 2.0])
    q_start = torch.tensor([49, 17])
    padding = padding_for(2, 53)
    config = DecodeConfig(block_n=16, num_stages=1)
    before = launches.snapshot()
    out = flash_decode(q, k, v, sinks, COMPOSITE, q_start, padding, out=poisoned_like(q), combine="last",
                       num_splits=num_splits, config=config)
    assert launches.since(before) == {"flash_decode_split": 1}
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, q_start, padding), dtype)
    two_launches = flash_decode(q, k, v, sinks, COMPOSITE, q_start, padding, out=poisoned_like(q),
                                num_splits=num_splits, config=config, combine="kernel")
    assert torch.equal(out, two_launches)


@pytest.mark.parametrize("mask_name", ["causal", "window", "none"])
def test_decode_single_launch_masks_without_sinks(mask_name):
    # No sinks (None), every other mask kind, one query at ragged offsets 36 / 11 of an odd 37-key
    # cache with padding (ignored by kind none, as the reference), GQA 8/2: 4 rows per program.
    q, k, v, _ = make_inputs(2, 1, 37, 8, 2, 64, torch.float32, seed=47)
    q_start = torch.tensor([36, 11])
    padding = padding_for(2, 37)
    spec = MASKS[mask_name]
    out = flash_decode(q, k, v, None, spec, q_start, padding, out=poisoned_like(q), num_splits=3,
                       config=DecodeConfig(block_n=16, num_stages=1))
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert_matches(out, reference(q, k, v, None, spec, q_start, padding), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_single_launch_fully_masked_rows_without_sinks(num_splits):
    # Sequence 1's query at position 9 sees only padded keys and there is no sink: every split (or
    # the only one) ends with sum 0, and the merge must write 0, not 0 / 0.
    q, k, v, _ = make_inputs(2, 1, 40, 2, 2, 64, torch.float32, seed=53)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[1, :10] = True
    q_start = torch.tensor([39, 9])
    out = flash_decode(q, k, v, None, COMPOSITE, q_start, padding, out=poisoned_like(q), num_splits=num_splits,
                       config=DecodeConfig(block_n=16, num_stages=1))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_matches(out, reference(q, k, v, None, COMPOSITE, q_start, padding), torch.float32)


def test_decode_single_launch_repeats_with_counters_reset():
    # The counters are 0 again after every call, so the next launch (or a graph replay) merges too:
    # a counter left at S would make no program the last one and leave the NaN poison in place.
    q, k, v, sinks = make_inputs(1, 1, 70, 2, 1, 64, torch.float32, seed=59)
    expected = reference(q, k, v, sinks, MaskSpec("causal"), 69, None)
    config = DecodeConfig(block_n=16, num_stages=1)
    before = launches.snapshot()
    outputs = []
    for _ in range(3):
        outputs.append(flash_decode(q, k, v, sinks, MaskSpec("causal"), 69, None, out=poisoned_like(q), combine="last",
                                    num_splits=4, config=config))
        assert torch.count_nonzero(group_counters(q, k)) == 0
    assert launches.since(before) == {"flash_decode_split": 3}
    assert_matches(outputs[0], expected, torch.float32)
    assert all(torch.equal(outputs[0], later) for later in outputs[1:])


def test_decode_rejects_unknown_combine():
    q, k, v, sinks = make_inputs(1, 1, 20, 2, 2, 64, torch.float32, seed=61)
    with pytest.raises(ValueError, match="combine must be 'last'.*'kernel'"):
        flash_decode(q, k, v, sinks, COMPOSITE, 19, None, combine="second")


@pytest.mark.parametrize("query_len, key_len, kernel", [(1, 20, "flash_decode_split"), (4, 9, "flash_decode_split"),
                                                     (5, 20, "flash_attention")])
def test_fused_arm_picks_decode_for_small_chunks_at_any_key_length(query_len, key_len, kernel):
    # The engine's fused arm: up to 4 queries go to the decode kernel even against a short cache.
    from engine.arms import ARMS

    q, k, v, sinks = make_inputs(1, query_len, key_len, 2, 2, 64, torch.float32, seed=67)
    before = launches.snapshot()
    out = ARMS["fused"].launch(q, k, v, sinks, COMPOSITE, key_len - query_len, None)
    assert launches.since(before) == {kernel: 1}
    assert_matches(out, reference(q, k, v, sinks, COMPOSITE, key_len - query_len, None), torch.float32)


V4_COMPOSITE = MaskSpec("composite", window=1024, block=64)  # the engine's v4 mask


def shapes_only(batch, heads, kv_heads, k_len, head_dim=512, dtype=torch.bfloat16):
    """q [B, 1, Hq, hd] and k [B, Tk, Hkv, hd] on the meta device: shapes for the host-side planner."""
    return (torch.empty(batch, 1, heads, head_dim, dtype=dtype, device="meta"),
            torch.empty(batch, k_len, kv_heads, head_dim, dtype=dtype, device="meta"))


@pytest.mark.parametrize(
    "batch, heads, kv_heads, k_len, spec, expected",
    [
        # The engine's v4 step (Hq 8 over Hkv 1: a GQA group of 8 rows, merged by the combine kernel):
        # one 32-key tile per split up to GQA_MAX_SPLITS (run 13: 8.6 us at 640 keys against 14.7 us
        # for 5 splits of 4-5 tiles). 640 keys: 21 tiles (composite: 640 + 10 block starts) and 20.
        (1, 8, 1, 640, V4_COMPOSITE, 21),
        (1, 8, 1, 640, MaskSpec("causal"), 20),
        # v4 at 8192 keys: composite walks 1024 + 128 keys (36 tiles), causal 256: capped at 32.
        (1, 8, 1, 8192, V4_COMPOSITE, 32),
        (1, 8, 1, 8192, MaskSpec("causal"), 32),
        # The attention benchmark's decode problem (Hq = Hkv = 8, 8192 keys): one wave, 132 // 8 = 16 splits of 16
        # tiles, as before.
        (1, 8, 8, 8192, MaskSpec("causal"), 16),
        # A batch of 32 sequences: 132 // 32 = 4 programs per sequence fit one wave.
        (32, 8, 1, 640, V4_COMPOSITE, 4),
        # bench tg128's 160-key cache at v4: a short walk (SHORT_WALK_CONFIG's 16-key tiles): 11 tiles (160 + 3
        # block starts), one split each.
        (1, 8, 1, 160, V4_COMPOSITE, 11),
        # One row per group (the benchmark's shape) under 2 x MIN_TILES_PER_SPLIT tiles: one split, out written
        # directly (no merge); a single tile is one split for a GQA group too.
        (1, 8, 8, 200, V4_COMPOSITE, 1),
        (1, 8, 1, 5, MaskSpec("causal"), 1),
    ],
)
def test_decode_split_count_on_an_h200(batch, heads, kv_heads, k_len, spec, expected):
    q, k = shapes_only(batch, heads, kv_heads, k_len)
    assert default_num_splits(q, k, spec, sms=132) == expected


def test_decode_choose_splits_rules():
    assert MIN_TILES_PER_SPLIT == 4
    assert choose_splits(21, 132) == 5  # each split >= 4 tiles
    assert choose_splits(256, 16) == 16  # the wave binds
    assert choose_splits(10_000, 10_000) == 128  # MAX_SPLITS
    assert choose_splits(3, 132) == choose_splits(0, 132) == choose_splits(21, 0) == 1  # never 0
    assert choose_splits(256, 132, merge_ratio=0.25) == 32  # sqrt(256 / 0.25)
    assert choose_splits(21, 132, merge_ratio=0.25) == 5  # sqrt(84) = 9 does not bind
    for tiles in range(1, 300, 7):
        for wave in (1, 3, 16, 132):
            splits = choose_splits(tiles, wave, merge_ratio=0.25)
            assert 1 <= splits <= max(1, wave)
            # The kernel's balanced walk gives every split floor or ceil of tiles / splits tiles.
            assert splits == 1 or tiles // splits >= MIN_TILES_PER_SPLIT


def test_decode_merge_tile_sizes():
    assert merge_tile(8, 5, 512) == (8, 8, 128)  # v4: the group's 8 rows x 8 splits, 4 column chunks
    assert merge_tile(1, 16, 512) == (1, 16, 512)  # the benchmark's shape: one load per kv head
    assert merge_tile(8, 128, 512) == (2, 128, 32)  # many splits: 2 rows at a time
    for rows in (1, 3, 8, 64):
        for splits in (2, 5, 33, 128):
            merge_rows, splits_pow2, block_d = merge_tile(rows, splits, 512)
            assert merge_rows * splits_pow2 * block_d <= attention_decode.MERGE_ELEMENTS
            assert block_d >= 32 and 512 % block_d == 0


@pytest.mark.parametrize("head_dim, merge_elements, dtype", [(512, None, torch.float32), (512, None, torch.float16),
                                                             (64, 512, torch.float32)])
def test_decode_gqa_group_merge(head_dim, merge_elements, dtype, monkeypatch):
    # The v4 grouping (8 query heads over 1 kv head) merged by the group's last split, 5 splits of
    # uneven length (7 tiles of 16 keys: 1 or 2 each) at offsets 99 / 60 of a 100-key cache, sinks
    # -inf, +inf (head 1 is 0), finite; sequence 1's padding hides its whole window and block starts
    # (only its sinks remain: 0). At head dim 512 the [8, 8, 128] merge tile walks 4 column chunks;
    # with 512-element merge tiles at head dim 64 the group's 8 rows merge 2 at a time, 2 column
    # chunks each. The two-kernel path runs the same merge tiles: equal to the bit.
    if merge_elements:
        monkeypatch.setattr(attention_decode, "MERGE_ELEMENTS", merge_elements)
    q, k, v, _ = make_inputs(2, 1, 100, 8, 1, head_dim, dtype, seed=79)
    sinks = torch.tensor([float("-inf"), float("inf"), 0.0, 1.5, -2.0, 0.5, 3.0, -0.5])
    q_start = torch.tensor([99, 60])
    padding = torch.zeros(2, 100, dtype=torch.bool)
    padding[1, :61] = True
    spec = MaskSpec("composite", window=96, block=16)  # walk <= 96 + 7 keys: 7 tiles of 16
    config = DecodeConfig(block_n=16, num_stages=1)
    before = launches.snapshot()
    out = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), combine="last", num_splits=5,
                       config=config)
    assert launches.since(before) == {"flash_decode_split": 1}
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), dtype)
    two_launches = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), num_splits=5,
                                config=config, combine="kernel")
    assert torch.equal(out, two_launches)


def test_decode_refuses_prefill_sized_chunks():
    q, k, v, sinks = make_inputs(1, 40, 40, 4, 1, 64, torch.float32, seed=29)  # 4 x 40 rows > 64
    with pytest.raises(ValueError, match="flash_attention"):
        flash_decode(q, k, v, sinks, COMPOSITE, 0)


# ------------------------------------------------------------------------------------------------
# GPU: bf16, serving-sized shapes, CUDA graphs, the compiler's resource report
# ------------------------------------------------------------------------------------------------

GPU_MASKS = {
    "causal": MaskSpec("causal"),
    "window": MaskSpec("window", window=256),
    "composite": MaskSpec("composite", window=256, block=64),
}


def gpu_padding(batch, k_len):
    padding = torch.zeros(batch, k_len, dtype=torch.bool, device="cuda")
    padding[0, 64] = True  # a block start
    padding[-1, :100] = True  # left padding covering the first queries' whole windows
    return padding


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("mask_name", list(GPU_MASKS))
def test_gpu_prefill_bf16(mask_name, head_dim):
    # 1000 keys, a 333-query chunk at offsets 667 / 200 (not multiples of any block), GQA 8/2.
    q, k, v, sinks = make_inputs(2, 333, 1000, 8, 2, head_dim, torch.bfloat16, seed=head_dim, device="cuda")
    q_start = torch.tensor([667, 200], device="cuda")
    padding = gpu_padding(2, 1000)
    spec = GPU_MASKS[mask_name]
    out = flash_attention(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_prefill_drop_and_infinite_sinks_bf16():
    q, k, v, _ = make_inputs(1, 515, 515, 8, 8, 512, torch.bfloat16, seed=31, device="cuda")
    sinks = torch.tensor([float("-inf"), float("inf")] + [0.5] * 6, device="cuda")
    spec = GPU_MASKS["composite"]
    out = flash_attention(q, k, v, sinks, spec, 0, None, out=poisoned_like(q))
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, spec, 0, None), torch.bfloat16)
    dropped = flash_attention(q, k, v, sinks, MaskSpec("causal"), 0, None)
    assert_matches(dropped, reference(q, k, v, sinks, MaskSpec("causal"), 0, None), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("mask_name", list(GPU_MASKS))
@pytest.mark.parametrize("query_len", [1, 4])
def test_gpu_decode_bf16(query_len, mask_name, head_dim):
    q, k, v, sinks = make_inputs(2, query_len, 4099, 8, 2, head_dim, torch.bfloat16, seed=head_dim, device="cuda")
    q_start = torch.tensor([4099 - query_len, 1500], device="cuda")
    padding = gpu_padding(2, 4099)
    spec = GPU_MASKS[mask_name]
    out = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph():
    # The engine captures decode: no host reads of device values, allocations from the graph pool.
    q, k, v, sinks = make_inputs(1, 1, 8192, 8, 8, 512, torch.bfloat16, seed=37, device="cuda")
    spec = GPU_MASKS["composite"]
    q_start = torch.tensor([8191], device="cuda")
    out = torch.empty_like(q)
    flash_decode(q, k, v, sinks, spec, q_start, None, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_decode(q, k, v, sinks, spec, q_start, None, out=out)
    q.copy_(torch.randn_like(q))  # fresh inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, None), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_gpu_decode_single_launch_bf16(num_splits):
    # The single launch at the benchmark's head dim: out written directly (1 split) or merged by the
    # last split of each group (3, and one wave by default); two queries at ragged offsets, GQA 8/2,
    # composite mask + padding, sinks -inf / +inf / finite. It agrees with the two-kernel path far
    # inside the bf16 tolerance (same partials, same merge order; only the bf16 rounding of a
    # differently laid-out sum may differ).
    q, k, v, sinks = make_inputs(2, 2, 4099, 8, 2, 512, torch.bfloat16, seed=71, device="cuda")
    sinks[0], sinks[1] = float("-inf"), float("inf")
    q_start = torch.tensor([4097, 1500], device="cuda")
    padding = gpu_padding(2, 4099)
    spec = GPU_MASKS["composite"]
    before = launches.snapshot()
    out = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), num_splits=num_splits,
                       combine="last")
    torch.cuda.synchronize()
    assert launches.since(before) == {"flash_decode_split": 1}
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), torch.bfloat16)
    two_launches = flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q), num_splits=num_splits,
                                combine="kernel")
    assert relative_error(out, two_launches.float()) <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("position", [639, 520])
def test_gpu_decode_v4_shape_bf16(position):
    # The engine's v4 decode step: one sequence, 8 query heads over 1 kv head, head dim 512, the
    # composite mask W=1024 B=64, a 640-key cache, the query at 639 or 520, sinks -inf / +inf /
    # finite. The default (a GQA group: 21 splits of one tile on an H200, merged by the combine
    # kernel) and the single launch with 5 splits (its last program merging the group's 8 rows) each
    # equal the reference.
    q, k, v, sinks = make_inputs(1, 1, 640, 8, 1, 512, torch.bfloat16, seed=83, device="cuda")
    sinks[0], sinks[1] = float("-inf"), float("inf")
    q_start = torch.tensor([position], device="cuda")
    splits = default_num_splits(q, k, V4_COMPOSITE)
    if torch.cuda.get_device_properties(0).multi_processor_count >= 40:
        assert splits == 21
    before = launches.snapshot()
    out = flash_decode(q, k, v, sinks, V4_COMPOSITE, q_start, None, out=poisoned_like(q))
    torch.cuda.synchronize()
    assert launches.since(before) == {"flash_decode_split": 1, "flash_decode_combine": 1}
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert_matches(out, reference(q, k, v, sinks, V4_COMPOSITE, q_start, None), torch.bfloat16)
    before = launches.snapshot()
    one_launch = flash_decode(q, k, v, sinks, V4_COMPOSITE, q_start, None, out=poisoned_like(q), num_splits=5,
                              combine="last")
    assert launches.since(before) == {"flash_decode_split": 1}
    assert torch.count_nonzero(group_counters(q, k)) == 0
    # Different split counts sum in a different order: each path is held to the reference (an H200 run
    # measured 2.1e-3 and 2.3e-3 between the two bf16 outputs, one bf16 ULP is 3.9e-3 relative).
    assert_matches(one_launch, reference(q, k, v, sinks, V4_COMPOSITE, q_start, None), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_single_launch_repeats_and_replays():
    # Whichever split of a group arrives last, it merges every split's partials in the order 0..S-1,
    # so repeated calls are equal to the bit; the counters are 0 after each launch, so a captured
    # graph replays (several times, with fresh q in the same buffer) exactly as eager calls.
    q, k, v, sinks = make_inputs(2, 1, 8192, 8, 8, 512, torch.bfloat16, seed=73, device="cuda")
    spec = GPU_MASKS["composite"]
    q_start = torch.tensor([8191, 5000], device="cuda")
    padding = gpu_padding(2, 8192)

    def eager():
        return flash_decode(q, k, v, sinks, spec, q_start, padding, out=poisoned_like(q))

    first = eager()
    for _ in range(5):
        assert torch.equal(eager(), first)
    torch.cuda.synchronize()
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert_matches(first, reference(q, k, v, sinks, spec, q_start, padding), torch.bfloat16)

    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_decode(q, k, v, sinks, spec, q_start, padding, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    q.copy_(torch.randn_like(q))  # fresh inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager())
    assert torch.count_nonzero(group_counters(q, k)) == 0
    assert_matches(out, reference(q, k, v, sinks, spec, q_start, padding), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_head_dim_512_fits_without_spills():
    from kernels.attention_common import resource_report

    q, k, v, sinks = make_inputs(1, 128, 128, 8, 8, 512, torch.bfloat16, seed=41, device="cuda")
    flash_attention(q, k, v, sinks, GPU_MASKS["composite"], 0, None)
    flash_decode(q[:, :1], k, v, sinks, GPU_MASKS["composite"], 127, None)
    rows = [row for row in resource_report() if "hd512" in row["kernel"] and "bfloat16" in row["kernel"]]
    assert rows, "no head_dim-512 bf16 kernel in the resource report"
    for row in rows:
        assert row["n_spills"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row

