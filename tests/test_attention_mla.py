"""kernels.attention_mla (the absorbed MLA walk over the latent cache) against its torch reference, the
two MLA arms against each other, and the arm decision. CPU tests run the kernel under the Triton
interpreter in fp32 and fp16 (its bf16 tl.dot is wrong); `-m gpu` runs bf16 on CUDA at DeepSeek's shape,
odd sizes and under CUDA-graph capture. Fresh random inputs for every check, outputs poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from engine import attention_dispatch
from kernels.reference import mla_decompressed_reference, mla_latent_reference

triton = pytest.importorskip("triton")
from kernels import attention_mla  # noqa: E402
from kernels.attention_mla import MlaConfig, default_num_splits, mla_decode  # noqa: E402

# Relative max error against the float32 reference of the same (rounded) inputs. fp32: the walk's exp2 and
# tile-wise rescaling round differently from torch's softmax, a few ULPs; fp16: the probabilities and the
# output are rounded once each (2^-11 relative), summed over R columns; bf16 the same at 2^-8.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(batch, query_len, heads, rank, rope, keys, dtype, device="cpu", seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, query_len, heads, rank + rope, generator=generator, device=device).to(dtype)
    cache = torch.randn(batch, keys, 1, rank + rope, generator=generator, device=device).to(dtype)
    return q, cache


def _relative(ours, theirs) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


CASES = [
    # (B, Tq, Hq, R, r, Tk, q_start, splits): the edge each covers
    (1, 1, 1, 16, 16, 1, 0, None),  # one head, one key: the smallest shape
    (2, 1, 3, 64, 16, 37, [36, 11], None),  # decode, odd heads and keys, ragged rows (row 1 sees 12 of 37)
    (3, 1, 5, 32, 32, 70, [69, 0, 40], 3),  # a row that sees only key 0; three splits, one of them empty for it
    (1, 5, 4, 64, 16, 23, 10, 2),  # a chunk of 5 queries at positions 10..14 (rows of different bounds)
    (2, 7, 3, 32, 16, 7, 0, 4),  # a prefill from 0 (causal), 21 rows over two 16-row blocks, 4 splits of 1 tile
    (1, 1, 17, 128, 64, 129, 128, None),  # 17 heads: one row past a 16-row block; the DeepSeek RoPE width
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}T{c[1]}H{c[2]}R{c[3]}r{c[4]}K{c[5]}" for c in CASES])
def test_kernel_matches_the_reference_under_the_interpreter(case, dtype):
    batch, query_len, heads, rank, rope, keys, start, splits = case
    q, cache = _inputs(batch, query_len, heads, rank, rope, keys, dtype, seed=sum(case[:6]))
    q_start = torch.tensor(start) if isinstance(start, list) else start
    out = torch.full((batch, query_len, heads, rank), float("nan"), dtype=dtype)  # poisoned
    mla_decode(q, cache, rank, 0.17, q_start, out=out, num_splits=splits)
    expected = mla_latent_reference(q.float(), cache.float(), rank, 0.17, q_start)
    assert torch.isfinite(out).all()
    assert _relative(out, expected) <= TOLERANCE[dtype]


STRUCTURES = [  # MlaConfig's structure candidates at interpreter-sized blocks
    MlaConfig(16, 16, 4, 1, lazy_rescale=True),
    MlaConfig(16, 16, 4, 2, unchained=True),
    MlaConfig(32, 16, 4, 2, lazy_rescale=True, unchained=True),
    MlaConfig(16, 32, 4, 2, tma=True),
    MlaConfig(16, 16, 4, 2, unchained=True, tma=True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", STRUCTURES, ids=lambda config: config.label().replace(" ", ""))
@pytest.mark.parametrize("case", CASES[1:], ids=[f"B{c[0]}T{c[1]}H{c[2]}R{c[3]}r{c[4]}K{c[5]}" for c in CASES[1:]])
def test_structure_candidates_match_the_reference(case, config, dtype):
    """Lazy rescaling and the unchained walk compute the same function: odd sizes, ragged and causal rows,
    splits (one of them empty for a row), rows past a block."""
    batch, query_len, heads, rank, rope, keys, start, splits = case
    q, cache = _inputs(batch, query_len, heads, rank, rope, keys, dtype, seed=sum(case[:6]) + 1)
    q_start = torch.tensor(start) if isinstance(start, list) else start
    out = torch.full((batch, query_len, heads, rank), float("nan"), dtype=dtype)
    mla_decode(q, cache, rank, 0.17, q_start, out=out, num_splits=splits, config=config)
    expected = mla_latent_reference(q.float(), cache.float(), rank, 0.17, q_start)
    assert torch.isfinite(out).all()
    assert _relative(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("growth", [0.0, 3.0, 40.0], ids=["flat", "under-threshold", "past-threshold"])
@pytest.mark.parametrize("config", STRUCTURES[:3:2], ids=lambda config: config.label().replace(" ", ""))
def test_lazy_rescaling_is_exact_whether_or_not_the_max_grows(growth, config):
    """Scores that climb by `growth` (log2 units) per 16-key tile: flat keeps the first tile's max to the
    end (probabilities up to 2^8 accumulate unscaled), 3 per tile rescales every few tiles, 40 every tile.
    fp16, where a probability past 2^16 would overflow: the reference max must bound them."""
    generator = torch.Generator().manual_seed(int(growth) + 3)
    q = torch.randn(2, 1, 6, 64 + 16, generator=generator)
    cache = torch.randn(2, 150, 1, 64 + 16, generator=generator) * 0.05
    ramp = torch.arange(150).div(16).floor() * growth  # the tile's offset, along one latent direction
    q[..., 0] = 1.0
    cache[:, :, 0, 0] += ramp / (0.3 * attention_mla.LOG2_E)
    q, cache = q.half(), cache.half()
    expected = mla_latent_reference(q.float(), cache.float(), 64, 0.3, torch.tensor([149, 90]))
    out = torch.full((2, 1, 6, 64), float("nan"), dtype=torch.float16)
    mla_decode(q, cache, 64, 0.3, torch.tensor([149, 90]), out=out, num_splits=1, config=config)
    assert torch.isfinite(out).all()
    assert _relative(out, expected) <= TOLERANCE[torch.float16]


def test_wide_offsets_path_and_its_decision(monkeypatch):
    """Key offsets switch to int64 once Tk x token stride can reach 2^31; the int64 walk, forced at a small
    shape, computes the same output."""
    assert not attention_mla.needs_wide_offsets(8192, 576, 576)
    assert attention_mla.needs_wide_offsets(2 ** 31 // 576 + 1, 576, 576)
    assert attention_mla.needs_wide_offsets(2 ** 31 // 576, 576, 576) == (2 ** 31 // 576 * 576 + 576 >= 2 ** 31)
    q, cache = _inputs(2, 1, 5, 64, 16, 45, torch.float32, seed=9)
    expected = mla_latent_reference(q, cache, 64, 0.2, 44)
    monkeypatch.setattr(attention_mla, "needs_wide_offsets", lambda *shape: True)
    assert _relative(mla_decode(q, cache, 64, 0.2, 44, num_splits=2), expected) <= TOLERANCE[torch.float32]


def test_config_labels():
    assert MlaConfig(64, 64, 8, 2).label() == "64x64 w8 s2"
    assert MlaConfig(64, 32, 8, 3, lazy_rescale=True, unchained=True, tma=True).label() == \
        "64x32 w8 s3 +lazy +unchained +tma"


def test_tma_refuses_a_misaligned_cache_and_reads_a_strided_view():
    """TMA needs 16-byte aligned rows: a cache one element into its buffer is refused, naming what; an
    aligned view (every other batch row, keys up to a length) computes the reference's output."""
    q, cache = _inputs(2, 1, 3, 32, 16, 20, torch.float32, seed=4)
    shifted = torch.empty(cache.numel() + 1)[1:].view_as(cache).copy_(cache)
    with pytest.raises(ValueError, match="16-byte aligned rows; the cache's address is not"):
        mla_decode(q, shifted, 32, 0.2, 19, config=MlaConfig(16, 16, 4, 2, tma=True))
    big = torch.randn(4, 30, 1, 48)
    view = big[::2, :23]
    expected = mla_latent_reference(q, view, 32, 0.2, torch.tensor([22, 7]))
    out = mla_decode(q, view, 32, 0.2, torch.tensor([22, 7]), config=MlaConfig(16, 16, 4, 2, tma=True), num_splits=2)
    assert _relative(out, expected) <= TOLERANCE[torch.float32]


def test_the_default_reads_through_tma_where_it_can_and_through_pointers_where_not():
    """At 64 rows and R = 512 the default config reads the cache through TMA; a misaligned cache gets the same
    config without it, not a refusal: the same output either way."""
    q, cache = _inputs(1, 1, 64, 512, 64, 5, torch.float32, seed=6)
    assert attention_mla.default_config(512, 64).tma
    expected = mla_latent_reference(q, cache, 512, 0.05, 4)
    shifted = torch.empty(cache.numel() + 1)[1:].view_as(cache).copy_(cache)
    for source in (cache, shifted):
        assert _relative(mla_decode(q, source, 512, 0.05, 4), expected) <= TOLERANCE[torch.float32]


def test_strided_cache_views_and_block_configs():
    """A cache row read through a view (every other batch row of a larger cache, keys up to a length), and
    each block shape the benchmark sweeps: the same output."""
    q, _ = _inputs(2, 1, 6, 64, 16, 1, torch.float32, seed=5)
    big = torch.randn(4, 50, 1, 80)
    cache = big[::2, :41]  # [2, 41, 1, 80], batch stride 2 x 50 x 80
    expected = mla_latent_reference(q, cache, 64, 0.2, 40)
    for config in (None, MlaConfig(16, 16, 4, 1), MlaConfig(32, 64, 4, 2), MlaConfig(16, 32, 4, 2, unchained=True)):
        assert _relative(mla_decode(q, cache, 64, 0.2, 40, config=config), expected) <= TOLERANCE[torch.float32]


def test_the_absorbed_arm_equals_the_decompressed_reference():
    """The identity the fused arm rests on: (q W_UK) . c = q . (c W_UK^T), and P c W_UV^T = P (c W_UV^T)."""
    from engine.config import LatentAttention, LayerMask, ModelConfig
    from engine.arms import ARMS

    heads, nope, rope, rank, v = 3, 24, 16, 32, 20
    config = ModelConfig(name="mla", n_layers=1, hidden=16, intermediate=8, n_experts=4, top_k=2, n_heads=heads,
                         n_kv_heads=heads, head_dim=nope + rope, vocab_size=8, max_seq_len=64,
                         layer_masks=(LayerMask("causal"),), sinks=False,
                         latent_attention=LatentAttention(rank, nope, rope, v, softmax_scale=0.15))
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, heads, nope + rope, generator=generator)
    cache = torch.randn(2, 29, 1, rank + rope, generator=generator)
    kv_b = torch.randn(heads * (nope + v), rank, generator=generator) / rank ** 0.5
    starts = torch.tensor([26, 4])
    fused = ARMS["mla_fused"].launch(config, q, cache, kv_b, starts)  # the interpreter here
    reference = ARMS["mla_reference"].launch(config, q, cache, kv_b, starts)
    assert fused.shape == reference.shape == (2, 3, heads, v)
    assert _relative(fused, reference) <= TOLERANCE[torch.float32]
    w_uk = kv_b.view(heads, nope + v, rank)[:, :nope]
    w_uv = kv_b.view(heads, nope + v, rank)[:, nope:]
    assert torch.equal(reference, mla_decompressed_reference(q, cache, w_uk, w_uv, 0.15, starts))


def test_bad_arguments_name_the_problem():
    q, cache = _inputs(1, 1, 2, 32, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="kv_lora_rank 24 is not a power of two"):
        mla_decode(q[..., :40], cache[..., :40], 24, 0.1)
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode(q, cache[:, :, :, :40], 32, 0.1)
    with pytest.raises(ValueError, match="share a dtype"):
        mla_decode(q, cache.half(), 32, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        mla_decode(q, cache, 32, 0.1, num_splits=0)


def test_the_dispatch_copy_of_the_kernels_shape_bounds_agrees():
    assert (attention_dispatch.MLA_MIN_DIM, attention_dispatch.MLA_MAX_LATENT, attention_dispatch.MLA_MAX_ROPE) == \
        (attention_mla.MIN_DIM, attention_mla.MAX_LATENT, attention_mla.MAX_ROPE)
    for rank, rope in [(512, 64), (16, 16), (24, 16), (1024, 64), (512, 8), (512, 256), (256, 48)]:
        assert bool(attention_dispatch.mla_kernel_declines(rank, rope)) == bool(attention_mla.supports(rank, rope))


def test_decisions_of_latent_layers():
    fused = attention_dispatch.decide_latent_attention(512, 64, flash_512=True)
    assert (fused.arm, fused.declined) == ("mla_fused", False) and "512 + 64" in fused.reason
    off = attention_dispatch.decide_latent_attention(512, 64, flash_512=False)
    assert (off.arm, off.declined) == ("mla_reference", False) and "flash_512=off" in off.reason
    declined = attention_dispatch.decide_latent_attention(384, 64, flash_512=True)
    assert (declined.arm, declined.declined) == ("mla_reference", True) and "kv_lora_rank 384" in declined.reason


def test_split_count_fills_one_wave_of_the_h200():
    """Host-side, shapes only (graph-safe). The bench's shape: 64 rows x 128 heads in 64-row blocks is 128
    programs already: one split. Batch 1 at V2-Lite's 16 heads: the walk is split over the SMs, a short one into
    one-tile splits."""
    config = attention_mla.default_config(512, 128)
    assert config == MlaConfig(64, 64, 8, 2, tma=True)  # run 63's fastest at R = 512 (bench/RESULTS.md)
    assert default_num_splits(64, 128, 8192, config, sms=132) == 1
    small = attention_mla.default_config(512, 16)
    assert small.block_m == 16 and small.num_warps == 4 and not small.tma
    assert default_num_splits(1, 16, 4096, small, sms=132) == 32  # 128 tiles / 4 per split
    assert default_num_splits(1, 16, 160, small, sms=132) == 5  # a short walk: one tile a split
    assert default_num_splits(1, 16, 1024, small, sms=132) == attention_mla.SHORT_WALK_SPLITS  # 32 tiles
    assert default_num_splits(8, 16, 160, small, sms=132) == 5
    assert default_num_splits(64, 16, 160, small, sms=132) == 2  # 132 SMs over 64 programs a split
    # merged by unabsorb: one tile a split, up to the wave and MAX_SPLITS
    assert default_num_splits(1, 16, 1024, small, sms=132, consumer_merges=True) == 32
    assert default_num_splits(1, 16, 4096, small, sms=132, consumer_merges=True) == attention_mla.MAX_SPLITS
    assert default_num_splits(8, 16, 4096, small, sms=132, consumer_merges=True) == 16
    assert default_num_splits(64, 128, 8192, config, sms=132, consumer_merges=True) == 1


_COMPILE = """
import json, sys
sys.path.insert(0, "bench")
import mla_sm90_compile as report
from kernels.attention_mla import MlaConfig
rows = [report.describe(config) for config in (MlaConfig(64, 64, 8, 2), MlaConfig(64, 64, 8, 2, unchained=True))]
print(json.dumps(rows))
"""


def test_the_sm90_build_shows_the_duplicated_score_dot_and_the_unchained_fix():
    """bench/mla_sm90_compile.py on the default and the unchained build (a child process: the tests'
    interpreter cannot build for a GPU). What holds on every Triton it was written against: the default's
    score dot has 8 warps over its 64 rows, the unchained one splits the keys and issues fewer wgmma, and
    its P is read after the barrier, not prefetched."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sass_loops

    if sass_loops.cuobjdump() is None:
        pytest.skip("no cuobjdump in this Triton")
    default, unchained = sass_loops.compiled_in_child(_COMPILE)
    assert "failed" not in default and "failed" not in unchained, (default, unchained)
    assert default["dots"] == ["64x64:[8,1]", "64x64:[8,1]", "64x512:[4,2]"]
    assert unchained["dots"] == ["64x64:[8,1]", "64x64:[4,2]", "64x512:[4,2]"]  # the RoPE dot, then the latent one
    assert unchained["wgmma"] < default["wgmma"] and unchained["loop_mufu"] < default["loop_mufu"]
    assert unchained["p_prefetched"] == 0 and default["shared_bytes"] <= 227 * 1024 and default["loop_instructions"]


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

GPU_CASES = [
    (64, 1, 128, 512, 64, 4096, None),  # the benchmark's shape (one split)
    (1, 1, 16, 512, 64, 4099, None),  # V2-Lite decode at batch 1: a split walk, an odd key count
    (3, 1, 128, 512, 64, 1001, [1000, 3, 517]),  # ragged rows, one seeing 4 keys
    (2, 37, 16, 512, 64, 300, [263, 0]),  # a 37-query chunk (592 rows) at two offsets
    (5, 1, 20, 256, 32, 77, None),  # a smaller latent, 20 heads (odd block fill)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"B{c[0]}T{c[1]}H{c[2]}R{c[3]}K{c[5]}" for c in GPU_CASES])
def test_gpu_kernel_matches_the_reference_in_bf16(case):
    batch, query_len, heads, rank, rope, keys, start = case
    q, cache = _inputs(batch, query_len, heads, rank, rope, keys, torch.bfloat16, "cuda", seed=keys)
    q_start = keys - 1 if start is None else torch.tensor(start, device="cuda")
    out = torch.full((batch, query_len, heads, rank), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode(q, cache, rank, 192 ** -0.5, q_start, out=out)
    expected = mla_latent_reference(q.float(), cache.float(), rank, 192 ** -0.5, q_start)
    assert torch.isfinite(out).all()
    assert _relative(out, expected) <= TOLERANCE[torch.bfloat16]


GPU_STRUCTURES = [  # the sweep's unchained and TMA builds, and lazy rescaling (compiled, though it spills here)
    MlaConfig(64, 64, 8, 2, unchained=True),
    MlaConfig(64, 64, 8, 2, tma=True),
    MlaConfig(64, 32, 8, 4, unchained=True, tma=True),
    MlaConfig(64, 64, 8, 2, lazy_rescale=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_STRUCTURES, ids=lambda config: config.label().replace(" ", ""))
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[2]], ids=["bench-shape", "ragged"])
def test_gpu_structure_candidates_match_the_reference_in_bf16(case, config):
    """The compiled candidates: the unchained walk's scratch round trip (a barrier the interpreter does not
    have) and lazy rescaling, at the benchmark's shape and on ragged rows, two splits for the second."""
    batch, query_len, heads, rank, rope, keys, start = case
    q, cache = _inputs(batch, query_len, heads, rank, rope, keys, torch.bfloat16, "cuda", seed=keys + 1)
    q_start = keys - 1 if start is None else torch.tensor(start, device="cuda")
    out = torch.full((batch, query_len, heads, rank), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode(q, cache, rank, 192 ** -0.5, q_start, out=out, config=config, num_splits=1 if start is None else 2)
    expected = mla_latent_reference(q.float(), cache.float(), rank, 192 ** -0.5, q_start)
    assert torch.isfinite(out).all()
    assert _relative(out, expected) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_kernel_replays_under_a_cuda_graph():
    """Captured once, replayed with new cache contents and positions: the replay's outputs follow."""
    q, cache = _inputs(2, 1, 128, 512, 64, 2048, torch.bfloat16, "cuda", seed=1)
    q_start = torch.tensor([2047, 900], device="cuda", dtype=torch.int32)
    out = torch.empty(2, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
    mla_decode(q, cache, 512, 0.07, q_start, out=out)  # warm-up: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, cache, 512, 0.07, q_start, out=out)
    fresh_q, fresh_cache = _inputs(2, 1, 128, 512, 64, 2048, torch.bfloat16, "cuda", seed=2)
    q.copy_(fresh_q), cache.copy_(fresh_cache), q_start.copy_(torch.tensor([1500, 12], device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = mla_latent_reference(q.float(), cache.float(), 512, 0.07, q_start)
    assert _relative(out, expected) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_check_attention_mla_sits_on_the_causal_reference():
    from engine.compare_mla import DEFAULTS, check_mla

    honor = check_mla(**DEFAULTS["cuda"], device="cuda")
    assert honor["ok"] and honor["verdict"] == "causal", honor["sentence"]
    drop = check_mla(**DEFAULTS["cuda"], mode="drop", device="cuda")
    assert drop["verdict"] == "unmasked" and not drop["ok"], drop["sentence"]


def test_mla_bench_runs_every_path_on_a_cpu_stub(monkeypatch):
    """bench/mla_bench.py's rows at a small shape on the interpreter with a stub timer (one call, a fixed
    1 us: no timing meaning), so a GPU run cannot die on a typo; the sweep keeps a failing config as a row."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mla_bench", Path(__file__).parents[1] / "bench" / "mla_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "SWEEP", [(16, 16, 4, 1), (16, 16, 4, 1, {"unchained": True, "lazy_rescale": True}),
                                         (16, 8, 4, 1)])  # block_n 8: refused by MlaConfig

    def stub_timer(fn, calls):
        fn()
        return 1.0

    row = bench.bench_cache(2, 4, 40, True, stub_timer, {"flops_per_s": 1e12}, device="cpu", latent=64, rope=16)
    assert row["kernel"]["error"] <= TOLERANCE[torch.float32] and row["ratio_to_bytes_bound"] > 0
    assert row["cache_bytes"] == 2 * 40 * 80 * 4 and "us" in row["arm"] and "kernel_speedup" in row["sdpa"]
    splits = len(bench.SWEEP_SPLITS)
    assert [("us" in entry, "failed" in entry) for entry in row["sweep"]] == \
        [(True, False)] * (2 * splits) + [(False, True)] * splits
    assert row["sweep"][splits]["config"] == "16x16 w4 s1 +lazy +unchained splits 1"
    assert all(entry["ratio_to_roofline"] > 0 for entry in row["sweep"][:2 * splits])
    table = bench.format_rows([row], {"flops_per_s": 1e12})
    assert "target <= 1.2x bytes" in table and "FAILED ValueError: block_n must be a power of two" in table
    assert "x roofline" in table and "16x16 w4 s1 +lazy +unchained splits 2" in table


def test_mla_bench_target_line_says_when_the_bytes_target_is_out_of_reach():
    """Run 59's figures (bench/RESULTS.md): the FLOP bound 92.3 us over the bytes bound 72.1 us is 1.28x,
    past the 1.2x target; at a bytes-bound shape the sentence is absent."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mla_bench", Path(__file__).parents[1] / "bench" / "mla_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    compute_bound = {"ratio_to_bytes_bound": 290.5 / 72.1, "ratio_to_roofline": 290.5 / 92.3, "bytes_bound_us": 72.1,
                     "flops_bound_us": 92.3}
    line = bench.target_line(compute_bound)
    assert line.startswith("target <= 1.2x bytes: missed (4.029x); roofline max(bytes, FLOP): 3.147x")
    assert "lies below the FLOP bound" in line and "no kernel gets under 1.28x bytes" in line
    bytes_bound = {"ratio_to_bytes_bound": 1.1, "ratio_to_roofline": 1.1, "bytes_bound_us": 100.0,
                   "flops_bound_us": 40.0}
    assert bench.target_line(bytes_bound) == "target <= 1.2x bytes: met (1.100x); roofline max(bytes, FLOP): 1.100x"


def test_mla_bench_main_runs_both_passes_on_a_cpu_stub(monkeypatch, tmp_path, capsys):
    """main() end to end with the device calls stubbed (the interpreter, a fixed 1 us timer): the default rows
    for every cache length first, then each sweep, each sweep row printed as it is made, then the table and
    the JSON; a broken launch in the sweep is a row, not the end of the run."""
    import functools
    import importlib.util
    import json
    from pathlib import Path

    import engine.bench

    spec = importlib.util.spec_from_file_location("mla_bench", Path(__file__).parents[1] / "bench" / "mla_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def stub_timer(fn, calls):
        fn()
        return 1.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "stub")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(engine.bench, "graph_call_us", stub_timer)
    monkeypatch.setattr(bench, "_matmul_flops", lambda timer: {"shape": "stub", "flops_per_s": 1e12})
    monkeypatch.setattr(bench, "bench_cache", functools.partial(bench.bench_cache, device="cpu", latent=64, rope=16))
    small_problem = bench._problem
    monkeypatch.setattr(bench, "_problem", lambda batch, heads, tokens, device, latent, rope:
                        small_problem(batch, heads, tokens, "cpu", 64, 16))
    monkeypatch.setattr(bench, "SWEEP", [(16, 16, 4, 1, {"unchained": True}), (16, 8, 4, 1)])
    out = tmp_path / "mla.json"
    assert bench.main(["--batch", "2", "--heads", "4", "--tokens", "40,23", "--sweep", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.index("sweep 40: {") < printed.index("sweep 23: {") < printed.index("bf16 matmul")
    written = json.loads(out.read_text())
    assert [row["tokens"] for row in written["rows"]] == [40, 23] and written["stopped"] is None
    assert [("us" in entry) for entry in written["rows"][1]["sweep"]] == [True, True, False, False]
