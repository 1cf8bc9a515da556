"""MoE dispatch: the uniform-routing closed forms and the gate policies. Plain Python.

n = tokens in the step, k = experts per token, E = routed experts, TILE_M = grouped-GEMM m-tile.

    woken(n, k, E)           = E * (1 - (1 - k/E)^n)       expected distinct experts
    pairs_per_woken(n, k, E) = n*k / woken(n, k, E)          rows an average woken expert gets
    tile_fill                = pairs_per_woken / TILE_M
    tiles_amortize           = pairs_per_woken >= TILE_M     an average m-tile is full
    min_tokens(k, E, TILE_M) = smallest n with tiles_amortize   (683 at k=6, E=256, TILE_M=16)

Host scalars only, so a decision is safe inside CUDA-graph capture. Uniform routing is the
conservative assumption: a skewed router wakes fewer experts and fills tiles more than this
predicts. Knows nothing about tensors, kernels or flags parsing; callers pass plain values.

Group-limited routing (DeepSeek: E experts in G groups, each token's k experts from its best
topk_group groups) predicts the same woken experts: with exchangeable expert scores a group is kept
with probability topk_group / G and an expert of a kept group chosen with k / (topk_group * E / G),
so each expert's per-token probability is still k / E and the formula above holds unchanged
(tests/test_dispatch.py checks it against engine.routing on random logits). What grouping adds is
the groups a step wakes, G * (1 - (1 - topk_group / G)^n) (`RoutingShape.woken_groups`). Shared
experts run on every token and are not part of these counts or of the GEMV/grouped decision.

Trellis-coded experts (weight_format "trellis") take the same policies over their own three arms:
the GEMV side is `trellis_gemv`, the grouped side `trellis_grouped` (packed tiles decoded per
window, staged once per window as bf16 tiles are) or `trellis_dequant` (the woken experts decoded
to a bf16 copy once per step, then the bf16 grouped GEMM). In bytes, with P packed and B bf16
bytes per expert, a step moves

    gemv     n*k * P                  (each pair reads its expert; no deduplication)
    grouped  woken * P                (the bandwidth bound's numerator)
    dequant  woken * (P + 2*B)        (packed read once, the bf16 copy written and read back)

so dequantizing never moves fewer bytes: what it saves is decode work (once per expert instead of
once per window), which only a measurement prices. The gate therefore picks `trellis_dequant` only
from a measured crossover (`measured` with a calibration that has one) or when `moe_gate=dequant`
forces it; every other policy's grouped side is `trellis_grouped`. On bf16 experts `dequant` is the
grouped arm (there is nothing to decode), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

GEMV, GROUPED, REFERENCE, TORCH_GROUPED_MM = "gemv", "grouped", "reference", "torch_grouped_mm"
MOE_ARMS = (GEMV, GROUPED, TORCH_GROUPED_MM, REFERENCE)
# `measured` without a calibration falls back to threshold:16, the crossover the H200's sweep measured
# (bench/RESULTS.md, "MoE arms sweep").
FALLBACK_THRESHOLD = 16
TRELLIS_GEMV, TRELLIS_GROUPED, TRELLIS_DEQUANT = "trellis_gemv", "trellis_grouped", "trellis_dequant"
TRELLIS_ARMS = (TRELLIS_GEMV, TRELLIS_GROUPED, TRELLIS_DEQUANT, REFERENCE)
BF16, TRELLIS = "bf16", "trellis"
WEIGHT_FORMATS = (BF16, TRELLIS)


def woken_experts(n_tokens: int, k: int, n_experts: int) -> float:
    if n_tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** n_tokens)


def pairs_per_woken_expert(n_tokens: int, k: int, n_experts: int) -> float:
    woken = woken_experts(n_tokens, k, n_experts)
    return 0.0 if woken == 0.0 else n_tokens * k / woken


def tile_fill(n_tokens: int, k: int, n_experts: int, tile_m: int) -> float:
    return pairs_per_woken_expert(n_tokens, k, n_experts) / tile_m


def tiles_amortize(n_tokens: int, k: int, n_experts: int, tile_m: int) -> bool:
    return pairs_per_woken_expert(n_tokens, k, n_experts) >= tile_m


def min_tokens(k: int, n_experts: int, tile_m: int) -> int:
    """The exact flip point: tiles amortize at the returned n and not at n - 1.

    pairs_per_woken is non-decreasing in n (it equals n*k/E * 1/(1-(1-k/E)^n), whose second
    factor falls more slowly than n grows), so a doubling search then bisection finds it.
    """
    if not 1 <= k <= n_experts:
        raise ValueError(f"need 1 <= k <= E, got k={k}, E={n_experts}")
    if tile_m < 1:
        raise ValueError(f"tile_m must be >= 1, got {tile_m}")
    high = 1
    while not tiles_amortize(high, k, n_experts, tile_m):
        high *= 2
    low = high // 2  # does not amortize (or is 0)
    while high - low > 1:
        middle = (low + high) // 2
        if tiles_amortize(middle, k, n_experts, tile_m):
            high = middle
        else:
            low = middle
    return high


def moved_bytes(arm: str, n_tokens: int, k: int, n_experts: int, expert_bytes: int, dense_expert_bytes: int,
                woken: float | None = None) -> float:
    """Expected weight bytes one step's MoE layer moves through device memory on `arm` (uniform routing).

    expert_bytes: one expert's stored weights (w13 and w2: bf16 bytes, or packed codes plus their scales
    and signs); dense_expert_bytes: the same expert in bf16 (what the dequantize arm writes and reads back).
    GEMV reads each pair's expert on its own; the grouped arms stage each woken expert once. `woken`: the
    caller's woken_experts(n_tokens, k, n_experts), when it has it (a record per layer per step)."""
    if arm in (GEMV, TRELLIS_GEMV):
        return float(max(n_tokens, 0) * k * expert_bytes)
    woken = woken_experts(n_tokens, k, n_experts) if woken is None else woken
    if arm == TRELLIS_DEQUANT:
        return woken * (expert_bytes + 2 * dense_expert_bytes)
    return woken * expert_bytes


def curve_row(n_tokens: int, k: int, n_experts: int, tile_m: int, routing: "RoutingShape | None" = None) -> dict:
    row = {
        "n": n_tokens,
        "woken": woken_experts(n_tokens, k, n_experts),
        "pairs_per_woken": pairs_per_woken_expert(n_tokens, k, n_experts),
        "fill": tile_fill(n_tokens, k, n_experts, tile_m),
        "amortizes": tiles_amortize(n_tokens, k, n_experts, tile_m),
    }
    if routing is not None and routing.grouped:
        row["woken_groups"] = routing.woken_groups(n_tokens)
    return row


@dataclass(frozen=True)
class RoutingShape:
    """What the prediction knows of a model's router: k of E routed experts, optionally from the best
    `topk_group` of `n_group` groups; `shared` experts beside them, always on (not counted)."""

    k: int
    n_experts: int
    n_group: int = 1
    topk_group: int = 1
    shared: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.n_experts:
            raise ValueError(f"need 1 <= k <= E, got k={self.k}, E={self.n_experts}")
        if self.n_group < 1 or self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"need 1 <= topk_group <= n_group dividing E, got {self.topk_group} of {self.n_group} "
                             f"groups, E={self.n_experts}")
        if self.k > self.topk_group * (self.n_experts // self.n_group):
            raise ValueError(f"top-{self.k} does not fit in {self.topk_group} groups of "
                             f"{self.n_experts // self.n_group} experts")

    @property
    def grouped(self) -> bool:
        return self.topk_group < self.n_group

    def woken(self, n_tokens: int) -> float:
        """Expected distinct routed experts: the ungrouped formula (the module docstring says why)."""
        return woken_experts(n_tokens, self.k, self.n_experts)

    def woken_groups(self, n_tokens: int) -> float:
        """Expected distinct groups a step's tokens keep: G * (1 - (1 - topk_group / G)^n)."""
        return woken_experts(n_tokens, self.topk_group, self.n_group)

    def describe(self) -> str:
        text = f"top-{self.k} of {self.n_experts} experts"
        if self.grouped:
            text += f" within the best {self.topk_group} of {self.n_group} groups of {self.n_experts // self.n_group}"
        if self.shared:
            text += f", + {self.shared} shared (always on, not routed)"
        return text


def routing_shape(config) -> RoutingShape:
    """The RoutingShape of an engine.config.ModelConfig (duck-typed: this module imports no engine code)."""
    shared = config.shared_experts.count if config.shared_experts is not None else 0
    return RoutingShape(config.top_k, config.n_experts, config.n_group, config.topk_group, shared)



# --------------------------------------------------------------------------------------------
# Gate policies
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GateInputs:
    """Everything a gate reads: host scalars only."""

    n_tokens: int
    k: int
    n_experts: int
    tile_m: int
    policy: str  # "floor", "tile-fill", "threshold:N", "measured", "gemv", "grouped", "reference"
    decode_floor: int = 8
    moe_max_tokens: int = 0
    grouped_variant: int = 2
    measured_crossover: int | None = None  # from the calibration file, None when absent
    measured_source: str = ""  # where a per-layer crossover came from ("" for the shape's one crossover)
    weight_format: str = BF16  # "bf16" or "trellis": which arms the decision names
    expert_bytes: int = 0  # one expert's stored w13 + w2 (packed codes, scales, signs for trellis); 0 = not given
    dense_expert_bytes: int = 0  # the same expert in bf16 (what trellis_dequant writes and reads back)
    measured_dequant_crossover: int | None = None  # calibration: trellis_dequant beats trellis_grouped from here


@dataclass(frozen=True)
class Decision:
    arm: str
    variant: int | None  # grouped-GEMM variant when arm is grouped
    reason: str  # in words, for people
    boundary: int | None  # the token count from which this policy picks grouped, if it has one
    inputs: dict = field(default_factory=dict)
    dequant_boundary: int | None = None  # trellis: the token count from which the grouped side is trellis_dequant


def _describe_fill(g: GateInputs) -> str:
    pairs = pairs_per_woken_expert(g.n_tokens, g.k, g.n_experts)
    return (f"{g.n_tokens} tokens x top-{g.k} of {g.n_experts} experts -> {pairs:.2f} pairs per woken "
            f"expert, m-tiles {100 * pairs / g.tile_m:.1f}% full at TILE_M={g.tile_m}")


def _adaptive(g: GateInputs, boundary: int, rule: str) -> Decision:
    """Shared tail of the floor/tile-fill/threshold/measured policies: the decode floor first,
    then grouped from `boundary` tokens on."""
    if g.n_tokens <= g.decode_floor:
        return Decision(GEMV, None, f"{rule}; but {g.n_tokens} <= decode_floor {g.decode_floor}: GEMV",
                        boundary, _inputs(g))
    if g.n_tokens >= boundary:
        return Decision(GROUPED, g.grouped_variant,
                        f"{rule}; {g.n_tokens} >= {boundary}: grouped v{g.grouped_variant}", boundary, _inputs(g))
    return Decision(GEMV, None, f"{rule}; {g.n_tokens} < {boundary}: GEMV", boundary, _inputs(g))


def _inputs(g: GateInputs) -> dict:
    return {
        "n_tokens": g.n_tokens, "k": g.k, "n_experts": g.n_experts, "tile_m": g.tile_m,
        "policy": g.policy, "decode_floor": g.decode_floor, "moe_max_tokens": g.moe_max_tokens,
        "measured_crossover": g.measured_crossover,
        **({"weight_format": g.weight_format, "expert_bytes": g.expert_bytes,
            "measured_dequant_crossover": g.measured_dequant_crossover} if g.weight_format != BF16 else {}),
    }


def _floor(g: GateInputs) -> Decision:
    boundary = g.decode_floor + 1
    return _adaptive(g, boundary, f"floor: grouped iff n > decode_floor {g.decode_floor}")


def _tile_fill(g: GateInputs) -> Decision:
    boundary = min_tokens(g.k, g.n_experts, g.tile_m)
    return _adaptive(g, boundary, f"tile-fill: {_describe_fill(g)}; tiles amortize from {boundary} tokens")


def _threshold(g: GateInputs) -> Decision:
    boundary = int(g.policy.split(":", 1)[1])
    return _adaptive(g, boundary, f"threshold: grouped from {boundary} tokens")


def _measured(g: GateInputs) -> Decision:
    if g.measured_crossover is None:
        return _adaptive(g, FALLBACK_THRESHOLD,
                         f"measured: no calibration for this device and routing shape (run `moe-inspector sweep`), "
                         f"falling back to threshold:{FALLBACK_THRESHOLD}")
    source = f" on {g.measured_source}" if g.measured_source else ""
    return _adaptive(g, g.measured_crossover,
                     f"measured: this GPU's sweep{source} crossed over at {g.measured_crossover} tokens")


def _forced(arm: str, name: str | None = None) -> Callable[[GateInputs], Decision]:
    """moe_gate=`name` (default: the arm's name) forces `arm`; `dequant` forces the grouped side, which on
    trellis experts is trellis_dequant (`_trellis`) and on bf16 ones the grouped arm itself."""
    name = name or arm

    def decide(g: GateInputs) -> Decision:
        variant = g.grouped_variant if arm == GROUPED else None
        label = f"grouped v{variant}" if arm == GROUPED else arm
        note = " (bf16 experts have nothing to dequantize)" if name != arm and g.weight_format == BF16 else ""
        return Decision(arm, variant, f"forced by moe_gate={name}: {label}{note}", None, _inputs(g))
    return decide


POLICIES: dict[str, Callable[[GateInputs], Decision]] = {
    "floor": _floor,
    "tile-fill": _tile_fill,
    "threshold": _threshold,
    "measured": _measured,
    "gemv": _forced(GEMV),
    "grouped": _forced(GROUPED),
    "reference": _forced(REFERENCE),
    "dequant": _forced(GROUPED, "dequant"),
}


def decide(g: GateInputs) -> Decision:
    """The arm for one MoE layer of one step.

    `moe_max_tokens` pins GEMV for n <= value under every policy except `reference`, which is
    the correctness arm of side-by-side checks and must stay what it says. A trellis layer's
    decision names the trellis arm of the side the policy chose (`_trellis`).
    """
    if g.weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {g.weight_format!r}")
    name = g.policy.split(":", 1)[0]
    decision = POLICIES[name](g)
    if g.moe_max_tokens and g.n_tokens <= g.moe_max_tokens and name != "reference":
        decision = Decision(GEMV, None,
                            f"moe_max_tokens={g.moe_max_tokens} pins GEMV for n <= {g.moe_max_tokens} "
                            f"(the policy alone said {decision.arm}: {decision.reason})",
                            decision.boundary, decision.inputs)
    return _trellis(decision, g, name) if g.weight_format == TRELLIS else decision


def _megabytes(value: float) -> str:
    """Bytes in MB, or in KB below 0.1 MB (a tiny model's experts would read "0.0 MB")."""
    return f"{value / 1e6:,.1f} MB" if value >= 1e5 else f"{value / 1e3:,.1f} KB"


def _trellis(decision: Decision, g: GateInputs, policy: str) -> Decision:
    """The trellis arm of the side `decision` chose: GEMV -> trellis_gemv; grouped -> trellis_grouped, or
    trellis_dequant when forced (moe_gate=dequant) or, under `measured`, from the calibration's dequantize
    crossover on (the byte arithmetic never favours dequantizing: module docstring)."""
    if decision.arm == REFERENCE:
        return decision
    n, k, experts = g.n_tokens, g.k, g.n_experts
    dequant_boundary = None
    if decision.arm == GEMV:
        arm, why = TRELLIS_GEMV, "trellis_gemv decodes in registers"
    elif policy == "dequant":
        arm, why = TRELLIS_DEQUANT, "trellis_dequant decodes the woken experts, then multiplies"
    elif policy == "measured" and g.measured_dequant_crossover is not None:
        dequant_boundary = g.measured_dequant_crossover
        arm = TRELLIS_DEQUANT if n >= dequant_boundary else TRELLIS_GROUPED
        why = (f"this GPU's sweep measured trellis_dequant faster from {dequant_boundary} tokens: "
               f"{n} {'>=' if arm == TRELLIS_DEQUANT else '<'} {dequant_boundary}: {arm}")
    else:
        arm = TRELLIS_GROUPED
        why = "trellis_grouped (dequantizing moves more bytes; no measured crossover says it decodes faster)"
    if g.expert_bytes:
        why += f"; moves {_megabytes(moved_bytes(arm, n, k, experts, g.expert_bytes, g.dense_expert_bytes))} of weights"
    return Decision(arm, None, f"{decision.reason}; trellis experts: {why}", decision.boundary, decision.inputs,
                    dequant_boundary)
