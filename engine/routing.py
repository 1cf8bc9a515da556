"""The group-limited routers of DeepSeek-V2 and V3: which k of E experts a token runs, and their weights.

Shapes: N = tokens, D = hidden, E = routed experts, G = expert groups (E / G experts each), k = top-k.

    softmax_group_topk (V2, topk_method group_limited_greedy)
        s = softmax(h W^T) [N, E]; a group's score is its largest s; the topk_group best groups are
        kept, every other expert's s set to 0; the top k of s; weights s of those k
    sigmoid_group_topk (V3, noaux_tc)
        s = sigmoid(h W^T) [N, E]; c = s + b (the correction bias, for the choice only); a group's
        score is the sum of its two largest c; the topk_group best groups are kept, every other
        expert's c set to -inf; the top k of c; weights s (not c) of those k, renormalised to sum 1
        when norm_topk_prob (+1e-20, as DeepSeek's code)

Both then multiply the weights by routed_scaling_factor (engine.model does it for every router). The
logits are float32 whatever the weights' dtype, as the references compute them. Knows nothing of
dispatch or kernels; the uniform-routing prediction for these routers is engine.dispatch's.
"""

from __future__ import annotations

import torch


def group_limited_topk(h: torch.Tensor, router: torch.Tensor, k: int, n_group: int, topk_group: int, kind: str,
                       correction_bias: torch.Tensor | None = None, norm_topk_prob: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, D], router [E, D] (, correction_bias [E]) -> topk_ids [N, k] int32, topk_weights [N, k] float32
    (before routed_scaling_factor)."""
    logits = h.float() @ router.float().t()  # [N, E]
    tokens, experts = logits.shape
    if kind == "softmax_group_topk":
        scores = torch.softmax(logits, dim=-1)
        group_scores = scores.view(tokens, n_group, experts // n_group).amax(dim=-1)  # [N, G]
        choice, masked = scores, 0.0
    elif kind == "sigmoid_group_topk":
        scores = torch.sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        group_scores = choice.view(tokens, n_group, experts // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        masked = float("-inf")
    else:
        raise ValueError(f"{kind!r} is not a group-limited router")
    kept_groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)  # [N, G]
    expert_mask = group_mask.repeat_interleave(experts // n_group, dim=1)  # [N, E]
    choice = choice.masked_fill(~expert_mask, masked)
    topk_ids = torch.topk(choice, k, dim=-1, sorted=False).indices  # [N, k]
    # V2 weighs by the masked scores it chose from (a kept expert's softmax score), V3 by the unbiased sigmoid
    topk_weights = (choice if kind == "softmax_group_topk" else scores).gather(1, topk_ids)
    if norm_topk_prob and kind == "sigmoid_group_topk":
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids.to(torch.int32), topk_weights


def describe(kind: str, n_group: int, topk_group: int, experts: int) -> str:
    """The router in words, for the MoE records."""
    scores = "sigmoid scores + correction bias" if kind == "sigmoid_group_topk" else "softmax scores"
    group_score = "top-2 sum" if kind == "sigmoid_group_topk" else "max"
    return (f"group-limited: {scores}, the best {topk_group} of {n_group} groups of {experts // n_group} experts "
            f"(group score: {group_score})")


def record_fields(config) -> dict:
    """What every MoE record of this model adds (engine.runtime.Dispatcher.moe): the group-limited router
    and the shared experts, where the family has them; {} for the others (their records are unchanged)."""
    fields = {}
    if config.router in ("softmax_group_topk", "sigmoid_group_topk"):
        fields["routing"] = describe(config.router, config.n_group, config.topk_group, config.n_experts) \
            + (f"; weights x {config.routed_scaling_factor:g}" if config.routed_scaling_factor != 1.0 else "")
    if config.shared_experts is not None:
        fields["shared_experts"] = (f"{config.shared_experts.describe()}: always on, every token, outside the "
                                    f"GEMV/grouped decision and the woken count; inside the GEMV arm's launches or "
                                    f"apart (a dense SwiGLU added after the arm) as shared_path says")
    if config.latent_attention is not None or config.shared_experts is not None or config.dense_layers:
        from engine.decode_fused import ineligible

        reason = ineligible(config)
        fields["forward"] = (f"torch forward: engine.decode_fused's decode glue lacks {reason}" if reason else
                             "decode steps on a GPU: engine.decode_fused's fused glue; prefill and CPU steps: the "
                             "torch forward")
    return fields
