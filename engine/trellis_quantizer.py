"""The trellis quantizer: Viterbi search for the tail-biting bitshift path closest to each tile sequence,
and the whole-matrix pipeline around it (rotation, row scales, optional Hessian feedback).

Shape legend: B = sequences searched at once, S = steps per sequence, V = weights per step,
P = 2^L states, M = 2^(L - K V) predecessor groups, J = 2^(K V) predecessors per state,
E = experts, N = rows, C = columns of a matrix.

The trellis (kernels.trellis_reference): state s follows p when s = ((p << KV) | fresh) mod 2^L, so
the predecessors of s are (j << (L - KV)) | (s >> KV), j < J, and all J states that share s >> KV share
their predecessors. A step is therefore O(P) work, not O(P J): the minimum over each group of J
predecessors once (`min` over a [B, J, M] view), then every state's own squared error added.
Tail-biting: the search runs twice, as the QTIP paper does. Pass one, on the sequence rotated by half,
free at both ends, only reads which state the best path passes at the original start; its top L - KV
bits (the overlap) then constrain pass two at both ends, so the path it returns wraps. Pass two is
exactly optimal among paths with that overlap (tests/test_trellis.py checks it against brute force).

Matrices (`quantize_stack`): W [E, N, C] is rotated (W_rot = T_L W T_R^T), each rotated row gets a
scale (its rms over the code's rms), the rows' tiles are searched, and each row's scale is then refit
by least squares to the codes found. With a Hessian H [E, C, C] of the inputs (sum of x x^T over
calibration tokens) the columns are quantized a tile column (16) at a time, left to right, and each
block's error is fed forward into the columns not yet quantized through the Cholesky factor of H^-1
(the block form of GPTQ / LDLQ), which minimises tr((W - Q) H (W - Q)^T) rather than the plain error.

Runs on whatever device the weights are on (vectorised over states and sequences in torch); on a
CPU keep shapes small. Knows nothing of checkpoints or models (engine.trellis_checkpoint).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.trellis_reference import (SEQUENCE, TILE, TrellisCode, TrellisMatrix, code_rms, default_hyb_table,
                                       hadamard_block, hadamard_signs, matrix_to_tiles, pack_states, rotate,
                                       state_values, tiles_to_matrix)

_INFINITY = float("inf")


def _errors(target: torch.Tensor, transposed: torch.Tensor) -> torch.Tensor:
    """target [B, V], transposed [V, P] -> the squared error of every state [B, P], >= 0, computed
    component by component in one fixed order (the traceback recomputes some of them bit for bit)."""
    total = (transposed[0] - target[:, :1]).square_()
    for component in range(1, transposed.shape[0]):
        total.add_((transposed[component] - target[:, component:component + 1]).square_())
    return total


def _group_minimum(cost: torch.Tensor, fan_in: int) -> torch.Tensor:
    """cost [B, P] (>= 0 or +inf) -> [B, M]: the least cost among each group's J predecessors j M + m.
    Non-negative floats order as their int32 bit patterns, and torch's int32 minimum over a leading
    dimension is vectorised where the float and index-returning reductions are not (about 5x and 20x
    slower on the development CPU)."""
    batch, states = cost.shape
    bits = cost.view(torch.int32).view(batch, fan_in, states // fan_in)
    return bits.amin(dim=1).view(torch.float32)


def _search(targets: torch.Tensor, values: torch.Tensor, step_bits: int,
            overlap: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One Viterbi pass. targets float32 [B, S, V]; values [P, V]; overlap int64 [B] or None: pass two's
    constraint, s[0] >> KV == overlap and s[S-1] mod M == overlap. Returns the best states int64 [B, S]
    and their squared errors [B].

    Forward, each step keeps only the best cost of each predecessor group (float32 [S, B, M], no back
    pointers); the traceback recomputes the J candidate costs of the one state on the path at each step
    (the same float ops, so the same bits) and takes the first least of them."""
    batch, steps, _ = targets.shape
    states = values.shape[0]
    groups, fan_in = states >> step_bits, 1 << step_bits  # M, J
    high_shift = states.bit_length() - 1 - step_bits  # L - KV
    device = targets.device
    transposed = values.t().contiguous()  # [V, P]
    cost = _errors(targets[:, 0], transposed)  # [B, P]
    if overlap is not None:
        cost.masked_fill_((torch.arange(states, device=device)[None, :] >> step_bits) != overlap[:, None], _INFINITY)
    best = torch.empty(steps, batch, groups, dtype=torch.float32, device=device)  # best[t]: group minima before t
    for step in range(1, steps):
        best[step] = _group_minimum(cost, fan_in)
        cost = _errors(targets[:, step], transposed).view(batch, groups, fan_in).add_(best[step].unsqueeze(-1))
        cost = cost.view(batch, states)
    ends = torch.arange(fan_in, device=device)[None, :] << high_shift  # [1, J]
    if overlap is not None:
        candidates = ends | overlap[:, None]  # [B, J]: the ends whose low L - KV bits are the overlap
        final_cost, pick = cost.gather(1, candidates).min(dim=1)
        last = candidates.gather(1, pick[:, None])[:, 0]
    else:
        final_cost, last = cost.min(dim=1)
    path = torch.empty(batch, steps, dtype=torch.int64, device=device)
    path[:, steps - 1] = last
    rows = torch.arange(batch, device=device)[:, None]
    for step in range(steps - 1, 0, -1):
        group = path[:, step] >> step_bits  # [B]
        candidates = ends | group[:, None]  # [B, J]: the predecessors of the state on the path
        target = targets[:, step - 1]  # [B, V]
        error = (values[candidates, 0] - target[:, :1]).square_()  # as _errors, component by component
        for component in range(1, values.shape[1]):
            error.add_((values[candidates, component] - target[:, component:component + 1]).square_())
        if step - 1 >= 1:
            error = error + best[step - 1][rows, candidates >> step_bits]
        elif overlap is not None:
            error = error.masked_fill((candidates >> step_bits) != overlap[:, None], _INFINITY)
        path[:, step - 1] = candidates.gather(1, error.argmin(dim=1, keepdim=True))[:, 0]
    return path, final_cost


def viterbi(targets: torch.Tensor, values: torch.Tensor, step_bits: int,
            overlap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The best path of a bitshift trellis through each sequence, by squared error.

    targets float32 [B, S, V]: what each step's V code values should approach.
    values float32 [P, V]: the code values of every state (P = 2^L, a power of two; L > step_bits).
    step_bits: K V, the bits each step shifts in.
    overlap int64 [B] or None: None = free ends (not tail-biting); else the path must start in a state
    whose top L - KV bits are `overlap` and end in one whose low L - KV bits are.
    Returns states int64 [B, S] and squared errors float32 [B]."""
    if values.shape[0] & (values.shape[0] - 1) or values.shape[0] <= 1 << step_bits:
        raise ValueError(f"{values.shape[0]} states is not a power of two above 2^{step_bits}")
    values = values.to(device=targets.device, dtype=torch.float32)
    return _search(targets.to(torch.float32), values, step_bits, overlap)


def tail_biting_viterbi(targets: torch.Tensor, values: torch.Tensor, step_bits: int, *,
                        overlap_window: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A wrapping path through each sequence (two passes, module docstring): states int64 [B, S] such that
    every state shifts in from the one before it, s[0] from s[S-1] included, and squared errors [B].

    overlap_window: pass one searches only the last and first `overlap_window` steps around the start
    (None: the whole sequence, rotated by half); a path's choice at the start hardly depends on steps
    far from it, and pass one is then a fraction of pass two's cost."""
    steps = targets.shape[1]
    window = steps // 2 if overlap_window is None else min(overlap_window, steps // 2)
    around_start = torch.cat([targets[:, steps - window:], targets[:, :steps - window]], dim=1)[:, :2 * window]
    first, _ = viterbi(around_start, values, step_bits)
    overlap = first[:, window] >> step_bits  # the state at the original step 0
    return viterbi(targets, values, step_bits, overlap)


# --------------------------------------------------------------------------------------------
# Matrices
# --------------------------------------------------------------------------------------------

def default_batch(device: torch.device) -> int:
    """Sequences one search holds: it keeps S x M float32 group minima of each (16 MB at K = 2, V = 1, so 8 GB
    for the GPU's 512)."""
    # on a CPU a few sequences at a time keep each step's [B, P] costs near the core's cache
    return 512 if device.type == "cuda" else 4


@dataclass
class QuantizationReport:
    """How close a quantized stack is to the weights it came from (float64 sums)."""

    mse: float  # mean squared error per weight, in the weights' own units
    relative_mse: float  # mse / mean square of the weights
    max_abs_error: float
    weights: int

    def to_json(self) -> dict:
        return {"mse": self.mse, "relative_mse": self.relative_mse, "max_abs_error": self.max_abs_error,
                "weights": self.weights}


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """On a CPU, the search's ops are a few hundred KB each, below what intra-op threads repay: with two
    threads on the shared 2-core development machine a step took 57 ms against 2.6 ms on one thread (a
    thread waiting for a descheduled partner). The process's thread count is restored afterwards."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def quantize_sequences(normalized: torch.Tensor, code: TrellisCode, values: torch.Tensor, batch: int,
                       advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """normalized float32 [n, 256] tile sequences (in code units) -> their tail-biting states int64 [n, S],
    searched `batch` sequences at a time; `advance(k)` after each batch of k."""
    count = normalized.shape[0]
    targets = normalized.reshape(count, code.steps, code.V)
    out = torch.empty(count, code.steps, dtype=torch.int64, device=normalized.device)
    with _one_cpu_thread(normalized.device):
        for begin in range(0, count, batch):
            end = min(begin + batch, count)
            out[begin:end], _ = tail_biting_viterbi(targets[begin:end], values, code.step_bits)
            if advance is not None:
                advance(end - begin)
    return out


def _rotate_stack(weights: torch.Tensor, left_signs, left_block, right_signs, right_block) -> torch.Tensor:
    """[E, N, C] -> T_L W T_R^T in float32."""
    columns_rotated = rotate(weights, right_signs, right_block)  # each row x -> T_R x
    return rotate(columns_rotated.transpose(-1, -2), left_signs, left_block).transpose(-1, -2).contiguous()


def _refit_scales(rotated: torch.Tensor, values: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Per-row least-squares scales <w, c> / <c, c> ([E, N]); `fallback` where a row's codes are all zero."""
    numerator = (rotated.double() * values.double()).sum(-1)
    denominator = values.double().pow(2).sum(-1)
    refit = torch.where(denominator > 0, numerator / denominator.clamp(min=1e-300), fallback.double())
    return refit.to(torch.float32)


def quantize_stack(weights: torch.Tensor, code: TrellisCode, *, left_seed: int, right_seed: int,
                   left_block: int | None = None, right_block: int | None = None,
                   table: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
                   batch: int | None = None, advance: Callable[[int], None] | None = None) -> TrellisMatrix:
    """weights [E, N, C] (any float dtype, on the device to search on) -> their TrellisMatrix.

    left_block / right_block default to `hadamard_block` of N and C (pass F's for w13's rows). `table`:
    hyb's code table (the default k-means table when None). `hessian` float [E, C, C] or None: the
    inputs' second moments per expert, in the model's basis; None minimises the plain squared error.
    `advance(k)` is called as k more tile sequences are done (E N C / 256 in all)."""
    experts, rows, columns = weights.shape
    if rows % TILE or columns % TILE:
        raise ValueError(f"a trellis matrix needs both sides multiples of {TILE}, got [{rows}, {columns}]")
    if not torch.isfinite(weights).all():
        raise ValueError("the weights hold NaN or infinite values: no code approximates them")
    device = weights.device
    if code.needs_table:
        table = (default_hyb_table() if table is None else table).to(torch.float32).cpu()
    else:
        table = None
    left_block = hadamard_block(rows) if left_block is None else left_block
    right_block = hadamard_block(columns) if right_block is None else right_block
    left_signs, right_signs = hadamard_signs(left_seed, rows), hadamard_signs(right_seed, columns)
    values = state_values(code, table, device)  # [P, V]
    rotated = _rotate_stack(weights.to(torch.float32), left_signs.to(device), left_block, right_signs.to(device),
                            right_block)  # [E, N, C]
    rms = rotated.pow(2).mean(-1).sqrt()  # [E, N]
    scales = torch.where(rms > 0, rms / code_rms(code, table), torch.ones_like(rms))  # [E, N]
    batch = batch or default_batch(device)
    if hessian is None:
        normalized = rotated / scales.unsqueeze(-1)
        states = quantize_sequences(matrix_to_tiles(normalized).reshape(-1, SEQUENCE), code, values, batch, advance)
        states = states.view(experts, rows // TILE, columns // TILE, code.steps)
    else:
        states = _quantize_with_hessian(rotated, scales, hessian, code, values, batch, advance, right_signs,
                                        right_block)
    decoded = values[states].reshape(experts, rows // TILE, columns // TILE, SEQUENCE)
    if hessian is None:  # with feedback the targets moved; the search's scales stay the ones it used
        scales = _refit_scales(rotated, tiles_to_matrix(decoded), scales)
    return TrellisMatrix(code, pack_states(states, code).contiguous(), scales.contiguous(), table,
                         left_signs, right_signs, left_block, right_block, left_seed, right_seed).to(device)


def _quantize_with_hessian(rotated, scales, hessian, code, values, batch, advance, right_signs, right_block):
    """Block LDLQ over tile columns (module docstring). Returns states int64 [E, N/16, C/16, S]."""
    experts, rows, columns = rotated.shape
    if tuple(hessian.shape) != (experts, columns, columns):
        raise ValueError(f"hessian must be [E, C, C] = {[experts, columns, columns]}, got {list(hessian.shape)}")
    device = rotated.device
    signs = right_signs.to(device)
    states = torch.empty(experts, rows // TILE, columns // TILE, code.steps, dtype=torch.int64, device=device)
    for expert in range(experts):
        h = hessian[expert].to(device=device, dtype=torch.float64)
        # the inputs the rotated weights see are T_R x, so their Hessian is T_R H T_R^T
        h = rotate(rotate(h, signs, right_block).t(), signs, right_block).t().double()
        h = h + 0.01 * h.diagonal().mean().clamp(min=1e-12) * torch.eye(columns, dtype=h.dtype, device=device)
        upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # H^-1 = U^T U
        work = rotated[expert].double().clone()  # [N, C], updated as blocks are quantized
        scale = scales[expert].double().unsqueeze(-1)  # [N, 1]
        for block in range(columns // TILE):
            begin, end = block * TILE, (block + 1) * TILE
            target = (work[:, begin:end] / scale).to(torch.float32)  # [N, 16]
            tiles = target.reshape(rows // TILE, SEQUENCE)  # tile (i, block) rows 16i.., row-major
            found = quantize_sequences(tiles, code, values, batch, advance)  # [N/16, S]
            states[expert, :, block] = found
            quantized = values[found].reshape(rows, TILE).double() * scale  # [N, 16]
            error = torch.linalg.solve_triangular(upper[begin:end, begin:end], work[:, begin:end] - quantized,
                                                  upper=True, left=False)  # (W_b - Q_b) U_bb^-1
            work[:, end:] -= error @ upper[begin:end, end:]
    return states


def quantization_report(original: torch.Tensor, dequantized: torch.Tensor) -> QuantizationReport:
    """Error of `dequantized` against `original` ([E, N, C] each), float64 sums."""
    difference = dequantized.double() - original.double()
    mse = float(difference.pow(2).mean())
    power = float(original.double().pow(2).mean())
    return QuantizationReport(mse=mse, relative_mse=mse / power if power > 0 else math.nan,
                              max_abs_error=float(difference.abs().max()), weights=original.numel())
