"""What the prefill kernel (`kernels.attention`) and the decode kernel (`kernels.attention_decode`)
share: the visible-key walk, one step of it (load a key tile, score, mask, fold into the online
softmax), the launchers' argument checks, and the compiler's resource report. Not a kernel
family: no launcher lives here.

Shape legend (as in `kernels.reference`):
    B  = sequences                Tq / Tk = query / key positions of one sequence
    Hq / Hkv = query / key-value heads (Hq % Hkv == 0)            hd = head dim

The visible-key walk
--------------------
visible(i, j) = j <= i  and  not pad(j)  and  (i - j < W  or  j % blk == 0)

For a set of query positions [p_first, p_last] (one program's rows) the keys that can be visible
are a contiguous *band* [max(0, p_first - W + 1), min(Tk, p_last + 1)) plus, for the composite
mask, the block-start *summary* keys j = s * blk with j <= p_last - W (older than every row's
window). A kernel walks one "virtual" key index v over both lists, band first:

    v <  band_len :  key = band_lo + v                visible iff j <= i and i - j < W
    v >= band_len :  key = (v - band_len) * blk       visible iff i - j >= W     (implies j <= i)

so every visible (i, j) is visited exactly once (a summary key inside row i's window comes from
the band; outside it, from the summary list) and no tile without a visible key is touched. The
summary keys are gathered with a stride of blk rows, so a tile of BLOCK_N summary keys costs
BLOCK_N key rows, not the BLOCK_N * blk rows of "every tile that contains a block start".
Key padding and the tails (j >= Tk, rows past Tq) are predicated inside each tile.
Kind `causal` is the band with W = infinity, `window` the band alone, `none` every key with no
causal or padding predicate (the unmasked reference of the magnitude check).

Sinks and -inf
--------------
The running max m starts at sigma_h and the running denominator l at exp(sigma_h - m) = 1, so
the sink enters the denominator exactly once. sigma = -inf: m starts at -inf and l at 0; a step
whose max is still -inf (nothing visible yet) rescales against 0 instead of -inf, because
exp(-inf - (-inf)) is NaN. sigma = +inf takes all the mass: the walk is skipped and the row is 0.
A row that sees nothing and has no sink ends with l = 0 and writes 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.reference import MaskSpec

LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); the kernels work in base 2
_LOG2_E = tl.constexpr(LOG2_E)  # the same, readable inside @triton.jit functions (sinks)
SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A window larger than any position stands for "no window" without a separate code path.
NO_WINDOW = 2**30


@dataclass(frozen=True)
class MaskArguments:
    """What a kernel needs to know about the mask: constexpr switches and runtime sizes."""

    causal: bool  # False only for kind `none`
    has_window: bool  # window, composite
    window: int  # NO_WINDOW when there is none
    has_summaries: bool  # composite
    summary_block: int  # 1 when there are none (never used as a divisor then)
    has_padding: bool
    padding: torch.Tensor  # [B, Tk] uint8 view of the caller's bool mask, or a dummy
    padding_strides: tuple[int, int]


@dataclass(frozen=True)
class AttentionInputs:
    """The launcher's checked arguments, shared by the prefill and decode launchers."""

    batch: int
    query_len: int  # Tq
    key_len: int  # Tk
    query_heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # hd
    q_start: torch.Tensor  # [B] int32, absolute position of each sequence's first query
    sinks: torch.Tensor  # [Hq] float32, or a dummy when has_sinks is False
    has_sinks: bool
    qk_scale_log2: float  # softmax scale * log2(e)
    mask: MaskArguments
    dot_precision: str  # "ieee" for fp32 inputs (no tf32 rounding), ignored for 16-bit ones


def mask_arguments(spec: MaskSpec, key_padding: torch.Tensor | None, like: torch.Tensor) -> MaskArguments:
    has_padding = key_padding is not None and spec.kind != "none"  # as kernels.reference.visible_mask
    if has_padding:
        padding = key_padding.view(torch.uint8)  # same bytes as bool, loadable by every backend
        padding_strides = (padding.stride(0), padding.stride(1))
    else:
        padding, padding_strides = like, (0, 0)  # never dereferenced: HAS_PADDING is False
    has_window = spec.kind in ("window", "composite")
    return MaskArguments(
        causal=spec.kind != "none",
        has_window=has_window,
        window=spec.window if has_window else NO_WINDOW,
        has_summaries=spec.kind == "composite",
        summary_block=spec.block if spec.kind == "composite" else 1,
        has_padding=has_padding,
        padding=padding,
        padding_strides=padding_strides,
    )


def check_attention_inputs(
    q: torch.Tensor,  # [B, Tq, Hq, hd]
    k: torch.Tensor,  # [B, Tk, Hkv, hd]
    v: torch.Tensor,  # [B, Tk, Hkv, hd]
    sinks: torch.Tensor | None,  # [Hq]
    spec: MaskSpec,
    q_start: torch.Tensor | int,  # [B] or int
    key_padding: torch.Tensor | None,  # [B, Tk] bool
    scale: float | None,
) -> AttentionInputs:
    """Validate the launcher arguments (ValueError naming the argument) and normalise them."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, H, hd]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, query_len, query_heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must be [B={batch}, Tk, Hkv, hd={head_dim}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    key_len, kv_heads = k.shape[1], k.shape[2]
    if kv_heads == 0 or query_heads % kv_heads != 0:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of key-value heads ({kv_heads})")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        # Rows of a head are read as contiguous vectors; every other stride is free (cache views).
        if tensor.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got strides {tensor.stride()}")
    if sinks is not None and (sinks.shape != (query_heads,) or sinks.device != q.device):
        raise ValueError(f"sinks must be [Hq={query_heads}] on {q.device}; got {tuple(sinks.shape)} on {sinks.device}")
    if key_padding is not None and (
        key_padding.shape != (batch, key_len) or key_padding.dtype != torch.bool or key_padding.device != q.device
    ):
        raise ValueError(
            f"key_padding must be a bool [B={batch}, Tk={key_len}] tensor on {q.device}; got "
            f"{key_padding.dtype} {tuple(key_padding.shape)}"
        )
    if isinstance(q_start, torch.Tensor):
        if q_start.numel() not in (1, batch):
            raise ValueError(f"q_start must be an int or have B={batch} entries; got shape {tuple(q_start.shape)}")
        q_start_tensor = q_start.to(device=q.device, dtype=torch.int32).reshape(-1).expand(batch).contiguous()
    else:
        if q_start < 0:
            raise ValueError(f"q_start must be >= 0, got {q_start}")
        q_start_tensor = torch.full((batch,), int(q_start), dtype=torch.int32, device=q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return AttentionInputs(
        batch=batch,
        query_len=query_len,
        key_len=key_len,
        query_heads=query_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_start=q_start_tensor,
        sinks=q if sinks is None else sinks.float().contiguous(),
        has_sinks=sinks is not None,
        qk_scale_log2=scale * LOG2_E,
        mask=mask_arguments(spec, key_padding, q),
        dot_precision="ieee" if q.dtype == torch.float32 else "tf32",
    )


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The caller's preallocated output (checked), or a new one shaped like q."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(3) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with stride 1 in head_dim")
    return out


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# --------------------------------------------------------------------------------------------
# Device helpers shared by both kernel families
# --------------------------------------------------------------------------------------------

@triton.jit
def _key_walk_bounds(
    p_first,  # absolute position of the first query row of this program
    p_last,  # absolute position of the last valid query row
    key_len,
    window,
    summary_block,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SUMMARIES: tl.constexpr,
):
    """(band_lo, band_len, walk_len): the band of keys [band_lo, band_lo + band_len) and the
    length of the whole virtual walk (band, then summary keys); see the module docstring."""
    band_hi = key_len
    if CAUSAL:
        band_hi = tl.minimum(p_last + 1, key_len)
    band_lo = p_first * 0
    if HAS_WINDOW:
        band_lo = tl.maximum(p_first - window + 1, 0)
    band_len = tl.maximum(band_hi - band_lo, 0)
    walk_len = band_len
    if HAS_SUMMARIES:
        # Summary keys s * blk with s * blk <= p_last - W (older than every row's window) and < Tk.
        newest_summary = p_last - window  # may be negative: then there are none
        summary_count = tl.where(
            newest_summary >= 0,
            tl.minimum(newest_summary // summary_block + 1, tl.cdiv(key_len, summary_block)),
            0,
        )
        walk_len = band_len + summary_count
    return band_lo, band_len, walk_len


@triton.jit
def _visible_keys(
    walk_index,  # [BLOCK_N] int32 virtual key indices (band first, then summaries)
    walk_end,  # scalar: indices >= walk_end are outside this program's walk
    query_positions,  # [BLOCK_M] int32 absolute positions of the rows
    band_lo,
    band_len,
    key_len,
    window,
    summary_block,
    padding_row_ptr,  # key padding of this sequence (uint8 [Tk], 1 = padded)
    stride_padding_t,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SUMMARIES: tl.constexpr,
    HAS_PADDING: tl.constexpr,
):
    """(keys [BLOCK_N] int32, key_in_range [BLOCK_N], visible [BLOCK_M, BLOCK_N])."""
    in_band = walk_index < band_len
    keys = band_lo + walk_index
    if HAS_SUMMARIES:
        keys = tl.where(in_band, keys, (walk_index - band_len) * summary_block)
    key_in_range = (walk_index < walk_end) & (keys < key_len)
    visible = key_in_range[None, :]  # [1, N]; the predicates below broadcast it to [M, N]
    distance = query_positions[:, None] - keys[None, :]  # i - j
    if CAUSAL:
        visible = visible & (distance >= 0)
    if HAS_WINDOW:
        in_window = distance < window
        if HAS_SUMMARIES:
            # Band keys count inside the window; summary keys only outside it (else counted twice).
            visible = visible & tl.where(in_band[None, :], in_window, distance >= window)
        else:
            visible = visible & in_window
    if HAS_PADDING:
        padded = tl.load(padding_row_ptr + keys.to(tl.int64) * stride_padding_t, mask=key_in_range, other=1)
        visible = visible & (padded == 0)[None, :]
    return keys, key_in_range, visible


@triton.jit
def _attend_key_tile(
    accumulator,  # [BLOCK_M, BLOCK_DV] float32, sum of p * v scaled by exp2(-running_max)
    running_max,  # [BLOCK_M] float32, base-2 logits; -inf before anything was seen
    running_sum,  # [BLOCK_M] float32
    q,  # [BLOCK_M, HEAD_DIM]
    k_base,  # this (sequence, kv head)'s K rows
    v_base,  # this (sequence, kv head)'s V rows
    keys,  # [BLOCK_N] int32 key positions (from _visible_keys)
    key_in_range,  # [BLOCK_N]
    visible,  # [BLOCK_M, BLOCK_N] or [1, BLOCK_N]
    dims,  # [HEAD_DIM] 0..hd-1
    value_dims,  # [BLOCK_DV] the output columns this program accumulates
    stride_kt,
    stride_vt,
    qk_scale_log2,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the walk: scores of BLOCK_N keys, masked, folded into the online softmax."""
    key_rows = keys.to(tl.int64)  # int64 before the stride multiply (long caches pass 2^31)
    k = tl.load(k_base + key_rows[:, None] * stride_kt + dims[None, :], mask=key_in_range[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
    scores = tl.where(visible, scores, float("-inf"))
    values = tl.load(
        v_base + key_rows[:, None] * stride_vt + value_dims[None, :], mask=key_in_range[:, None], other=0.0
    )  # [BLOCK_N, BLOCK_DV]

    new_max = tl.maximum(running_max, tl.max(scores, 1))
    # Nothing visible so far (and no sink): rescale against 0, not -inf (-inf - -inf is NaN).
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.math.exp2(running_max - safe_max)
    probabilities = tl.math.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probabilities, 1)
    accumulator = tl.dot(
        probabilities.to(values.dtype), values, accumulator * rescale[:, None], input_precision=DOT_PRECISION
    )
    return accumulator, new_max, running_sum


# --------------------------------------------------------------------------------------------
# Compiler resource report (GPU only)
# --------------------------------------------------------------------------------------------

_COMPILED: dict[str, object] = {}


def remember_compiled(label: str, compiled) -> None:
    """Keep the CompiledKernel a launch returned (None under the interpreter) for the report."""
    if compiled is not None:
        _COMPILED[label] = compiled


def resource_report() -> list[dict]:
    """One row per compiled attention kernel variant launched in this process: registers per
    thread, spilled registers, shared memory bytes, warps and stages, as ptxas reported them.
    Read it after a launch; spills > 0 or shared > 227 KB at head_dim 512 mean the block sizes
    in the kernel's config table are wrong for this GPU."""
    rows = []
    for label, compiled in _COMPILED.items():
        metadata = compiled.metadata
        rows.append({
            "kernel": label,
            "n_regs": getattr(compiled, "n_regs", None),
            "n_spills": getattr(compiled, "n_spills", None),
            "shared_bytes": getattr(metadata, "shared", None),
            "num_warps": getattr(metadata, "num_warps", None),
            "num_stages": getattr(metadata, "num_stages", None),
        })
    return rows


def format_resource_report(rows: list[dict]) -> str:
    if not rows:
        return "no compiled attention kernels (interpreter or nothing launched yet)"
    lines = [f"{'kernel':<60} {'regs':>5} {'spills':>6} {'shared KB':>9} {'warps':>5} {'stages':>6}"]
    for row in rows:
        shared = row["shared_bytes"]
        lines.append(
            f"{row['kernel']:<60} {row['n_regs']!s:>5} {row['n_spills']!s:>6} "
            f"{(shared / 1024 if shared is not None else float('nan')):>9.1f} {row['num_warps']!s:>5} {row['num_stages']!s:>6}"
        )
    return "\n".join(lines)
