"""Expert parallelism over a torch.distributed group: the experts of every MoE layer sharded over W ranks,
each token's (token, expert) pairs exchanged with `all_to_all_single`, each rank's arm decided by the same
gate (engine.dispatch) on the rank's own problem. Attention, dense layers, embeddings, norms and the router
are replicated: every rank runs the same step on the same tokens, so every rank holds the same routing.

Shape legend: N = the step's tokens (on every rank), W = ranks, E = experts, El = E / W local experts (rank r
holds experts r*El .. (r+1)*El - 1, contiguous), k = top-k, D = hidden, n = the tokens rank r owns (an even
split of the N: `owned_range`), P = n*k pairs they route, R = the rows rank r's experts receive.

A MoE layer on rank r (`moe`):

1. dispatch: its owned tokens' pairs sorted by the rank that holds the expert; the counts (W ints), then each
   pair's (local expert id, routing weight) [P, 2] and hidden row [P, D], each one `all_to_all_single`;
2. the rank's gate decides on what its kernel sees: R rows, one expert each (k = 1), over El experts
   (`Dispatcher.moe_arm`); the arm computes each row's weighted expert output [R, D];
3. combine: the rows back to their owners ([R, D] -> [P, D], `all_to_all_single`), summed per token in fp32;
4. gather: the owned tokens' outputs to every rank (`all_gather` of [ceil(N/W), D]), so the replicated layers
   go on with the same bits on every rank; shared experts then run replicated, outside the exchange.

The split sizes are read on the host, so every MoE layer syncs (and no step is a CUDA graph): engines that
avoid it pad every exchange to a fixed capacity; this one shows the exact rows instead. Each record gets an
`ep` sub-dict (the rank, its experts, rows, the exchange's bytes and µs); `gather_records` hands rank 0 every
rank's, side by side, with the imbalance of routed pairs across ranks. Knows nothing of launching the ranks
(engine.ep_launch) or of printing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import UserError

MAX_RANKS = 64  # the largest group `--ep` accepts: a host with more GPUs than this is not one this tool targets


def parse_ep(value, where: str = "--ep") -> int:
    """`--ep N` / `[engine] ep = N`: ranks in the expert-parallel group, an integer from 1 to MAX_RANKS."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise UserError(f"{where} {value!r}: give the number of ranks, an integer from 1 to {MAX_RANKS}")
    return value


def check_divisible(n_experts: int, ranks: int, model: str, option: str = "--ep") -> None:
    """Each rank holds E / W contiguous experts: W must divide E (`option`: where the count was given)."""
    if n_experts % ranks:
        divisors = [d for d in range(1, min(n_experts, MAX_RANKS) + 1) if n_experts % d == 0]
        raise UserError(f"{option} {ranks}: {model} has {n_experts} experts, not divisible by {ranks} ranks; "
                        f"give one of {', '.join(map(str, divisors))}")


@dataclass(frozen=True)
class ExpertGroup:
    """This process's place in the expert-parallel group (made by engine.ep_launch, after init_process_group)."""

    rank: int
    size: int
    backend: str  # "gloo" (CPU) or "nccl" (GPU)
    group: object = None  # the torch.distributed process group; None = the default (world) group

    def local_experts(self, n_experts: int) -> tuple[int, int]:
        """[first, last) of the experts this rank holds."""
        per_rank = n_experts // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def describe(self) -> str:
        return f"{self.size} ranks ({self.backend})"


def owned_range(n_tokens: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi) of the N tokens rank `rank` dispatches: an even split, the first N mod W ranks one more."""
    base, extra = divmod(n_tokens, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


EXPERT_TENSORS = ("w13", "w2", "b13", "b2")  # per-expert tensors of a MoE layer, [E, ...]: the ones sharded


def shard(engine, group: ExpertGroup) -> None:
    """Keep only this rank's experts of every MoE layer (`engine.weights` sliced, the rest freed) and mark the
    engine expert-parallel (`engine.expert_group`). The router, attention, dense layers and the embeddings stay
    whole. Refuses experts no slice can split (trellis-coded stacks)."""
    config = engine.config
    check_divisible(config.n_experts, group.size, config.name)
    first, last = group.local_experts(config.n_experts)
    dense = set(config.dense_layers)
    for layer in range(config.n_layers):
        if layer in dense:
            continue
        for name in EXPERT_TENSORS:
            key = f"layers.{layer}.{name}"
            tensor = engine.weights.get(key)
            if tensor is None:
                continue
            if not isinstance(tensor, torch.Tensor):
                raise UserError(f"--ep {group.size}: {config.name}'s experts are {type(tensor).__name__} "
                                f"(trellis-coded), which expert parallelism does not shard yet; run it with --ep 1")
            engine.weights[key] = tensor[first:last].clone()  # the clone frees the other ranks' experts
    engine.expert_group = group


def _all_to_all(output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: ExpertGroup) -> None:
    import torch.distributed as dist

    dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group.group)


def moe(dispatcher, layer: int, h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
        topk_weights: torch.Tensor, experts=None, shared=None) -> torch.Tensor:
    """One expert-parallel MoE layer (module docstring): h [N, D] (the same on every rank), topk_ids [N, k] of
    the E global experts, topk_weights [N, k]; w13 [El, 2F, D] and w2 [El, D, F] this rank's experts ->
    [N, D], the same bits on every rank. The rank's decision record is the dispatcher's (its rows, k = 1, El),
    with an `ep` sub-dict."""
    import torch.distributed as dist

    group = dispatcher.engine.expert_group
    config, device = dispatcher.engine.config, h.device
    ranks, rank = group.size, group.rank
    n_tokens, k, dim = h.shape[0], topk_ids.shape[1], h.shape[1]
    per_rank = config.n_experts // ranks
    lo, hi = owned_range(n_tokens, rank, ranks)
    timer = dispatcher.timer
    # each leg's "us" is set at the step's sync (the dispatcher's pending_times), the sum by `gather_records`
    dispatch, combine = {"bytes": 0, "us": None}, {"bytes": 0, "us": None}
    started = timer.start()  # always: the bench, which times no layer, reports the exchange's share of a step

    # 1. dispatch: this rank's owned pairs, sorted by the rank holding each pair's expert
    ids = topk_ids[lo:hi].reshape(-1).long()  # [P]
    order = torch.argsort(torch.div(ids, per_rank, rounding_mode="floor"), stable=True)  # [P]
    pair_token = torch.arange(lo, hi, device=device).repeat_interleave(k)[order]  # [P] token of each sorted pair
    sorted_ids = ids[order]  # [P]
    destination = torch.div(sorted_ids, per_rank, rounding_mode="floor")
    send_counts = torch.bincount(destination, minlength=ranks).to(torch.int64)  # [W]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()  # the layer's one host read (module docstring)
    rows = sum(recv)
    # (local expert id, weight) per pair, in fp32: ids below 2^24 are exact
    meta = torch.stack([(sorted_ids - destination * per_rank).float(),
                        topk_weights[lo:hi].reshape(-1)[order].float()], dim=1)  # [P, 2]
    meta_in = torch.empty((rows, 2), dtype=torch.float32, device=device)
    _all_to_all(meta_in, meta, recv, send, group)
    hidden_in = torch.empty((rows, dim), dtype=h.dtype, device=device)
    _all_to_all(hidden_in, h[pair_token].contiguous(), recv, send, group)  # [R, D]
    dispatcher.pending_times.append((dispatch, timer.stop(started)))

    # 2. the rank's own decision and arm: R rows, one local expert each
    local_ids = meta_in[:, 0].to(torch.int32).reshape(rows, 1)  # [R, 1]
    local_weights = meta_in[:, 1].to(h.dtype).reshape(rows, 1)  # [R, 1]
    out_rows = dispatcher.moe_arm(layer, hidden_in, w13, w2, local_ids, local_weights, experts=experts,
                                  k=1, n_experts=per_rank, record_routing=False)  # [R, D]
    record = dispatcher.moe_records[-1]

    # 3. combine, 4. gather
    restarted = timer.start()
    back = torch.empty((len(pair_token), dim), dtype=out_rows.dtype, device=device)
    _all_to_all(back, out_rows.contiguous(), send, recv, group)  # [P, D]
    owned = torch.zeros((n_tokens, dim), dtype=torch.float32, device=device)
    owned.index_add_(0, pair_token, back.float())
    width = -(-n_tokens // ranks)  # ceil(N / W): all_gather takes one shape from every rank
    padded = torch.zeros((width, dim), dtype=h.dtype, device=device)
    padded[:hi - lo] = owned[lo:hi].to(h.dtype)
    pieces = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(pieces, padded, group=group.group)
    out = torch.cat([piece[:b - a] for piece, (a, b) in
                     zip(pieces, (owned_range(n_tokens, other, ranks) for other in range(ranks)))])  # [N, D]
    dispatcher.pending_times.append((combine, timer.stop(restarted)))

    # bytes this rank sends: each pair's row and its (id, weight); the rows back; its owned rows to every other rank
    dispatch["bytes"] = len(pair_token) * (dim * h.element_size() + 8)
    combine["bytes"] = rows * dim * out_rows.element_size() + (ranks - 1) * width * dim * h.element_size()
    exchange = {"dispatch": dispatch, "combine": combine, "bytes": dispatch["bytes"] + combine["bytes"], "us": None,
                "method": ("cuda events" if timer.cuda else "cpu wall clock")
                          + " around the dispatch, and around the combine with the gather (a rank's time includes "
                            "its wait for the slowest peer)"}
    record["ep"] = {"rank": rank, "ranks": ranks, "backend": group.backend, "tokens": n_tokens, "top_k": k,
                    "experts": config.n_experts, "local_experts": per_rank, "first_expert": rank * per_rank,
                    "owned_tokens": hi - lo, "pairs_sent": len(pair_token), "rows": rows,
                    "rows_from": recv, "exchange": exchange}
    if dispatcher.routing is not None:  # the layer's global routing, as a one-device run records it
        dispatcher.pending_routing.append((layer, topk_ids, topk_weights))
    return out if shared is None else out + shared(h)


RANK_FIELDS = ("rank", "rows", "local_experts", "woken_observed", "woken_predicted", "pairs_per_woken_observed",
               "fill", "decided_arm", "executed_arm", "variant", "us")


def rank_view(record: dict) -> dict:
    """What rank 0 shows of one rank's MoE record: its decision on its own rows and its exchange."""
    ep = record["ep"]
    view = {name: record.get(name) for name in RANK_FIELDS if name in record}
    view.update(rank=ep["rank"], rows=ep["rows"], local_experts=ep["local_experts"], pairs_sent=ep["pairs_sent"],
                exchange={key: value for key, value in ep["exchange"].items() if key != "method"})
    return view


def imbalance(rows: list[int]) -> float | None:
    """max / mean of the routed pairs per rank (1.0 = even; None when no pair was routed)."""
    mean = sum(rows) / len(rows) if rows else 0
    return round(max(rows) / mean, 3) if mean else None


def gather_records(group: ExpertGroup, steps: list[dict]) -> None:
    """Every rank's MoE records to rank 0 (a collective: every rank calls it after the same steps): rank 0's
    records each get `ranks` (every rank's `rank_view`, in rank order) and `imbalance`. Other ranks' steps
    are left as they are."""
    import torch.distributed as dist

    for step in steps:
        for record in step["moe"]:
            exchange = record.get("ep", {}).get("exchange")
            if exchange is not None and exchange["dispatch"]["us"] is not None:
                exchange["us"] = round(exchange["dispatch"]["us"] + exchange["combine"]["us"], 1)
    mine = [[rank_view(record) for record in step["moe"] if "ep" in record] for step in steps]
    gathered = [None] * group.size if group.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=group.group)
    if group.rank != 0:
        return
    for index, step in enumerate(steps):
        records = [record for record in step["moe"] if "ep" in record]
        for position, record in enumerate(records):
            views = [gathered[rank][index][position] for rank in range(group.size)]
            record["ranks"] = views
            record["imbalance"] = imbalance([view["rows"] for view in views])
