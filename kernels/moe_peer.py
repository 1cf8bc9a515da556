"""The `torch_grouped_mm` peer arm: the MoE layer as a production torch pipeline would write it,
sort -> torch._grouped_mm (w13) -> SiLU·mul -> torch._grouped_mm (w2) -> weighted sum, so the
Triton arms are measured against something other than themselves.

Shapes: T tokens, k experts per token, E experts, D hidden, F expert intermediate, N = T*k pairs.

    x             [T, D]   bf16
    w13           [E, 2F, D]   passed to _grouped_mm as the view [E, D, 2F] (column-major per expert)
    w2            [E, D, F]    passed as [E, F, D]
    topk_ids      [T, k]
    topk_weights  [T, k]
    order         [N]      pair ids sorted by expert (stable)
    offsets       [E]      int32 cumulative pair counts: expert e owns sorted rows offsets[e-1]..offsets[e]-1
    gate_up       [N, 2F]  sorted pairs
    down          [N, D]   sorted pairs, put back in pair order before the weighted sum over k

torch._grouped_mm(mat_a [M, K], mat_b [G, K, N], offs=int32 cumulative ends [G]) -> [M, N]: the
2D x 3D form; mat_b may be the transposed view of a row-major [G, N, K] tensor (strides must be
16-byte aligned, so D and F must be multiples of 8 in bf16). No step waits for the device: the
counts are a scatter_add, not bincount (which reads the maximum back to the host on CUDA).
The sum over the k experts of a token is a fixed-order reduction, not index_add_ (float atomics
on CUDA), so the peer is as reproducible as the Triton arms.

Launch counting: `launches.record("torch_grouped_mm")` once per torch._grouped_mm call (two per
layer); the sort, gather and elementwise torch kernels around them are not counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import launches
from kernels.moe_checks import check_moe_inputs

_AVAILABLE: dict[tuple[str, int | None], bool] = {}


def grouped_mm_available(device: torch.device | str) -> bool:
    """True where torch._grouped_mm runs bf16 on this device: sm90+ GPUs (the CUTLASS kernel);
    on a CPU, builds of torch that ship its slow fallback (the tests use it to check this arm's
    sorting and scattering). Tried once per device with a tiny call, then cached."""
    device = torch.device(device)
    key = (device.type, device.index)
    if key not in _AVAILABLE:
        _AVAILABLE[key] = _try_grouped_mm(device)
    return _AVAILABLE[key]


def _try_grouped_mm(device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (9, 0):
            return False
    elif device.type != "cpu":
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        b = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
        offsets = torch.tensor([8, 16], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, b, offs=offsets)
        return tuple(out.shape) == (16, 16)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def moe_torch_grouped_mm(
    x: torch.Tensor,  # [T, D] bf16
    w13: torch.Tensor,  # [E, 2F, D]
    w2: torch.Tensor,  # [E, D, F]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, D]
    """The torch._grouped_mm pipeline; same contract as `kernels.reference.moe_reference`."""
    tokens, hidden_size, experts, intermediate, top_k = check_moe_inputs(x, w13, w2, topk_ids, topk_weights)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the torch_grouped_mm arm runs bf16 only (torch._grouped_mm), got {x.dtype}")
    if hidden_size % 8 or intermediate % 8:
        raise ValueError(f"torch._grouped_mm needs 16-byte aligned rows: D ({hidden_size}) and F "
                         f"({intermediate}) must be multiples of 8")
    if not grouped_mm_available(x.device):
        raise ValueError(f"torch._grouped_mm does not run on {x.device} (it needs an sm90+ GPU); "
                         "use the grouped or gemv arm")
    if tokens == 0:
        return torch.empty(0, hidden_size, dtype=x.dtype, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()  # [N]
    order = torch.argsort(flat_ids, stable=True)  # [N]
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    # ids must lie in [0, E) for this arm; the clamp only keeps a bad id from writing out of bounds
    counts.scatter_add_(0, flat_ids.clamp(0, experts - 1), torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [E]
    sorted_x = x.index_select(0, order // top_k)  # [N, D]
    gate_up = torch._grouped_mm(sorted_x, w13.transpose(1, 2), offs=offsets)  # [N, 2F]
    launches.record("torch_grouped_mm")
    hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]  # [N, F]
    down = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offsets)  # [N, D]
    launches.record("torch_grouped_mm")
    pair_out = torch.empty_like(down).index_copy_(0, order, down)  # [N, D] back in pair order
    weighted = pair_out.view(tokens, top_k, hidden_size).float() * topk_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)
