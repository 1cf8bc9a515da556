"""The decode attention check: does the split-KV decode kernel the decode step runs (the dispatcher's `fused`
arm, `kernels.attention_decode.flash_decode`) compute causal or sliding-window attention over a KV cache, or
read keys it must not?

At decode, causal and unmasked attention select the same keys when the cache holds exactly the keys seen so
far, so this check builds the cache a graphed step reads: B sequences at different positions p_b in one launch,
each over the cache's whole capacity C (the step passes C keys and relies on the mask), the entries past p_b
stale (large random garbage, never zeros). Each failure mode a decode kernel over a cache can have is a
reference of its own, computed naively in float32 from the working-dtype inputs upcast (exact):

    ok                    keys max(0, p - W + 1) .. p            what the model needs (W: the window, or none)
    reads_stale           every cache entry 0 .. C - 1           the mask not applied: stale entries read
    misses_newest         ok without key p                       the key written this step not read
    off_by_one_behind     the query at p - 1 (window models)     a position one behind: newest key lost, one old
    off_by_one_ahead      the query at p + 1                     a count for a position: stale entry p + 1 read
    window_ignored        keys 0 .. p                            plain causal where the layer has a window
    window_wide           keys p - W .. p                        i - j = W taken as visible
    window_narrow         keys p - W + 2 .. p                    i - j = W - 1 taken as invisible
    kv_heads_interleaved  query head h reads kv head h % Hkv     the GQA group mapping wrong (Hq / Hkv > 1)
    sink_ignored          no sink column (models with sinks)     the learned sink left out of the softmax
(only those that differ from `ok` at this shape are computed). To make each mode move the reference by far
more than the 1-ULP control, the keys at its boundaries are planted heavy (their scores raised towards the
group's queries, so each carries a large share of the softmax): the newest key p and, with a window, keys
p - W + 1 (the oldest visible), p - W and p - W - 1 (the first two invisible).

Every sequence is compared on its own rows, against its own control (one ULP of the working dtype on its `ok`
output): the kernel output "sits on" the references within SITS_ON_MULTIPLE controls there, and the verdict is
the one reference it sits on in every sequence (a mode that cannot differ from `ok` on one sequence, such as
reads_stale at p = C - 1, sits there too and is decided by the others). Discrimination: each mode's reference
must be more than DISCRIMINATION_RATIO controls from `ok` on some sequence, or no verdict could rule it out.

The kernel runs four ways (the split counts): through the dispatcher's arm with its default split count and
merge (what the step launches), as one split (written directly), and as several splits merged by the last
split ("last") and by the combine kernel ("kernel"); each run gets a verdict, and the check's verdict is `ok`
when all are, else the one wrong mode they share (`none` when they share none). `mode=drop` launches the kernel
with no mask over the whole capacity (the verdict must then be reads_stale).
Knows nothing of the CLI or screens; returns a plain dict. Importable without textual.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from engine.compare import (DTYPES, HEAD_DIMS, _relative, check_mode_and_dtype, require_interpreter, resolve_device,
                            ulp_control)
from engine.errors import UserError
from engine.progress import advance
from kernels import launches
from kernels.reference import MaskSpec, attention_reference

OK = "ok"
VERDICTS = ("ok", "reads_stale", "misses_newest", "off_by_one_behind", "off_by_one_ahead", "window_ignored",
            "window_wide", "window_narrow", "kv_heads_interleaved", "sink_ignored", "none")
DISCRIMINATION_RATIO = 100.0
# The kernel output "sits on" a reference (on one sequence's rows) within this many controls of it:
# - float32: the kernel's exp2 and its tile-by-tile (and split-by-split) rescaling round differently from the
#   reference's exp. The planted scores and the sinks reach ~10 in the exponent, which rounds to |x| 2^-24: a
#   relative error of ~|x| / 2 controls per probability. Measured 7-24 controls per sequence under the
#   interpreter (seeds 0-3; causal and window 16/40/100; GQA 1, 2, 4 and 8; with and without sinks; 2 heads x 64
#   dims, the noisiest); 64 is still 10^4 times below every mode's distance in float32 (~10^6-10^8 controls).
# - 16-bit: the output is rounded once to the working dtype (0.5 ULP) and the probabilities before P.V (0.5 ULP
#   per term, averaging down); measured 0.31-0.34 controls per sequence in fp16 under the interpreter (its dot
#   made exact by tests/conftest.py), bf16 has the same roundings in its own ULPs: 4 as for the sinks kernel.
# Every wrong mode sits at least DISCRIMINATION_RATIO controls away on some sequence (checked each run).
SITS_ON_MULTIPLE = {torch.float32: 64.0, torch.float16: 4.0, torch.bfloat16: 4.0}
GARBAGE_SCALE = 8.0  # stale entries: keys and values this many times the live ones' scale
INVISIBLE_VALUE_SCALE = 4.0  # the invisible probes' values (see _draw_inputs)
MAX_BATCH = 256  # sequences of one check (a decode step's batch is at most a few hundred)
MAX_SEQ_LEN = 1 << 20  # cache capacity (keys per sequence); the memory check bounds it further
CHECK_PARTS = 5  # progress steps at most: the references, then up to four runs of the kernel
# kernels.attention_decode.MAX_ROWS (a test keeps them equal): not imported here, so that a CPU run can still set
# the interpreter before the kernel module is first imported.
MAX_ROWS = 64

# The CPU run (the Triton interpreter) takes seconds: a capacity of three key tiles at head_dim 64, so the
# causal walk splits three ways. CUDA: a serving-sized cache at Qwen3-30B-A3B's attention shape.
DEFAULTS = {
    "cpu": dict(seq_len=160, batch=4, head_dim=64, heads=4, kv_heads=2, window=None, sinks=False),
    "cuda": dict(seq_len=4096, batch=8, head_dim=128, heads=32, kv_heads=4, window=None, sinks=False),
}


@dataclass(frozen=True)
class DecodeCheckConfig:
    seq_len: int  # C: the cache capacity every launch reads (keys per sequence)
    batch: int  # B: sequences in one launch, each at its own position
    head_dim: int
    heads: int
    kv_heads: int
    window: int | None  # the sliding window W (i - j < W visible), None: plain causal
    sinks: bool  # learned per-head sinks (gpt-oss), drawn at random
    mode: str  # honor: the kernel gets the layer's mask; drop: no mask over the whole capacity
    device: str
    dtype: str
    seed: int

    def __post_init__(self) -> None:
        if self.seq_len < 3:
            raise UserError(f"--seq-len must be >= 3 (the cache capacity: two sequences at their own positions, "
                            f"a stale entry past one of them), got {self.seq_len}")
        if self.seq_len > MAX_SEQ_LEN:
            raise UserError(f"--seq-len {self.seq_len} is more than {MAX_SEQ_LEN} keys per sequence")
        if not 2 <= self.batch <= min(MAX_BATCH, self.seq_len - 1):
            raise UserError(f"--batch must be in 2..{min(MAX_BATCH, self.seq_len - 1)} (sequences in one launch, each "
                            f"at its own position below --seq-len, up to {MAX_BATCH}), got {self.batch}")
        if self.head_dim not in HEAD_DIMS:
            raise UserError(f"--head-dim must be one of {', '.join(map(str, HEAD_DIMS))} (the decode kernel's), "
                            f"got {self.head_dim}")
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise UserError(f"--heads ({self.heads}) must be a positive multiple of --kv-heads ({self.kv_heads})")
        if self.heads // self.kv_heads > MAX_ROWS:
            raise UserError(f"--heads / --kv-heads = {self.heads // self.kv_heads} query heads per kv head: the "
                            f"decode kernel takes at most {MAX_ROWS} (the arm sends more to the prefill kernel)")
        if self.window is not None and not 1 <= self.window <= self.seq_len - 2:
            raise UserError(f"--window {self.window}: the window must be in 1..seq_len - 2 = {self.seq_len - 2} "
                            f"to bind in a cache of {self.seq_len} (key p - W - 1 must exist); raise --seq-len")
        check_mode_and_dtype(self.mode, self.dtype, self.device)

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec("causal") if self.window is None else MaskSpec("window", window=self.window)


def model_declines(model) -> str:
    """Why the decode check takes no dims from this model (an engine.config.ModelConfig), "" when it does: its
    layers must run the fused decode kernel with a causal or sliding-window mask."""
    if model.latent_attention is not None:
        return f"model {model.name} runs latent attention (MLA): check-attention --mla checks its kernel"
    if model.head_dim not in HEAD_DIMS:
        return (f"model {model.name} has head_dim {model.head_dim}: the fused kernels take "
                f"{', '.join(map(str, HEAD_DIMS))}, so its layers run the unfused reference")
    if any(mask.kind == "composite" for mask in model.layer_masks):
        return (f"model {model.name} runs a composite mask (window + block starts): check-attention without "
                f"--decode checks it")
    return ""


def model_dims(model) -> dict:
    """check_decode's dims of a model: its heads, kv heads, head dim, sinks, and the window of its first
    sliding-window layer (None: every layer causal). Call model_declines first."""
    window = next((mask.window for mask in model.layer_masks if mask.kind == "window"), None)
    return {"head_dim": model.head_dim, "heads": model.n_heads, "kv_heads": model.n_kv_heads, "window": window,
            "sinks": bool(model.sinks)}


def default_seq_len(device: str, window: int | None, max_seq_len: int | None = None) -> int:
    """The default cache capacity: DEFAULTS', raised to 2 W + 2 so a window binds in most sequences, within the
    model's context."""
    seq_len = max(DEFAULTS[device]["seq_len"], 0 if window is None else 2 * window + 2)
    return seq_len if max_seq_len is None else min(seq_len, max_seq_len)


def check_request(seq_len: int, batch: int, heads: int, kv_heads: int, head_dim: int, device, where: str) -> None:
    """The check's memory, bounded before anything is allocated (engine.limits.require_fits): the float32
    cache draws and copies (about ten [B, C, Hkv, hd]) and one sequence's reference ([Hq, C, hd] keys and values
    repeated per head, its scores)."""
    from engine.limits import require_fits

    if min(seq_len, batch, heads, kv_heads, head_dim) < 1:
        return  # the config's validation names the bad value
    needed = 4 * (10 * batch * seq_len * kv_heads * head_dim + 4 * heads * seq_len * head_dim + 8 * heads * seq_len)
    require_fits(needed, device, f"{where}: the decode check at seq_len {seq_len}, batch {batch}, {heads} heads",
                 "lower seq_len or batch")


def decode_positions(batch: int, seq_len: int, window: int | None) -> list[int]:
    """Each sequence's position p_b (its newest key), covering the edges: the cache's last slot (C - 1: nothing
    stale, the longest walk), the middle, and with a window its edge (p = W: key 0 just outside) and p = W - 1
    (key 0 on the boundary, visible); without one, p = 1 (two keys) and C // 3; more spread evenly. All >= 1 and
    distinct (batch <= seq_len - 1)."""
    last = seq_len - 1
    edges = [last, seq_len // 2 + 1] + ([window, window - 1] if window is not None else [1, seq_len // 3])
    spread = [1 + (last - 1) * index // max(1, batch - 1) for index in range(batch)]
    chosen: list[int] = []
    for position in edges + spread[::-1] + list(range(1, seq_len)):
        position = min(max(1, position), last)
        if position not in chosen:
            chosen.append(position)
    return chosen[:batch]


def _intervals(name: str, positions: torch.Tensor, config: DecodeCheckConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) [B] of the keys reference `name` sees (inclusive), before clamping to the cache."""
    p, W, last = positions, config.window, config.seq_len - 1
    lo = p * 0 if W is None else p - W + 1
    table = {
        "reads_stale": (p * 0, p * 0 + last),
        "misses_newest": (lo, p - 1),
        "off_by_one_behind": (lo - 1, p - 1),
        "off_by_one_ahead": (lo + (W is not None), p + 1),
        "window_ignored": (p * 0, p),
        "window_wide": (lo - 1, p),
        "window_narrow": (lo + 1, p),
    }
    return table.get(name, (lo, p))


def reference_names(config: DecodeCheckConfig) -> list[str]:
    """The references that can differ from `ok` at this shape."""
    names = ["ok", "reads_stale", "misses_newest"]
    if config.window is not None:
        names.append("off_by_one_behind")
    names.append("off_by_one_ahead")
    if config.window is not None:
        names += ["window_ignored", "window_wide", "window_narrow"]
    if config.heads // config.kv_heads > 1 and config.kv_heads > 1:
        names.append("kv_heads_interleaved")
    if config.sinks:
        names.append("sink_ignored")
    return names


def _interleaved_heads(heads: int, kv_heads: int) -> list[int]:
    """perm with perm[h'] a query head h with h % Hkv == h' // G: reordering q by it makes the reference's
    h' // G mapping compute h % Hkv for the original heads."""
    group = heads // kv_heads
    return [kv + member * kv_heads for kv in range(kv_heads) for member in range(group)]


def _reference(name, q, k, v, sinks, positions, config) -> torch.Tensor:
    """[B, 1, Hq, hd] float32: reference `name` (module docstring) on float32 inputs; the visible keys as key
    padding on a causal mask at the last slot (every key j <= C - 1 is causal there)."""
    lo, hi = _intervals(name, positions, config)
    keys = torch.arange(config.seq_len, device=q.device)
    padded = (keys[None, :] < lo[:, None]) | (keys[None, :] > hi[:, None])  # [B, C] True = not seen
    last = config.seq_len - 1
    if name == "sink_ignored":
        sinks = None
    if name == "kv_heads_interleaved":
        perm = torch.tensor(_interleaved_heads(config.heads, config.kv_heads), device=q.device)
        out = attention_reference(q[:, :, perm], k, v, None if sinks is None else sinks[perm], MaskSpec("causal"),
                                  last, padded)
        return out[:, :, torch.argsort(perm)]
    return attention_reference(q, k, v, sinks, MaskSpec("causal"), last, padded)


def _draw_inputs(config: DecodeCheckConfig, positions: torch.Tensor, working: torch.dtype):
    """q [B, 1, Hq, hd], the cache k, v [B, C, Hkv, hd] (stale past each position), sinks [Hq] or None."""
    device = config.device
    generator = torch.Generator(device=device).manual_seed(config.seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)

    B, C, Hq, Hkv, hd = config.batch, config.seq_len, config.heads, config.kv_heads, config.head_dim
    group = Hq // Hkv
    q = draw(B, 1, Hq, hd).to(working).float()  # rounded first: the planting below aims at the kernel's q
    k, v = draw(B, C, Hkv, hd), draw(B, C, Hkv, hd)
    keys = torch.arange(C, device=device)
    stale = keys[None, :] > positions[:, None]  # [B, C]
    garbage = GARBAGE_SCALE * draw(2, B, C, Hkv, hd)
    k = torch.where(stale[:, :, None, None], garbage[0], k)
    v = torch.where(stale[:, :, None, None], garbage[1], v)
    # The probes: each boundary key's score raised by ln(visible keys) + 1 for the group's queries, so it carries
    # a large share of the softmax whoever reads it.
    queries = q[:, 0].reshape(B, Hkv, group, hd)  # [B, Hkv, G, hd]
    direction = queries.sum(2)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-30)  # [B, Hkv, hd]
    along = (queries * direction[:, :, None]).sum(-1).mean(-1).clamp_min(1e-3)  # [B, Hkv] mean q_h . u
    lo, hi = _intervals(OK, positions, config)
    visible = (hi - lo.clamp_min(0) + 1).float()  # [B]
    boost = (visible.log() + 1.0)[:, None] * math.sqrt(hd) / along  # [B, Hkv]: score += boost * q.u / sqrt(hd)
    # The first two invisible keys (window models) also carry large values: reading them moves the output far.
    probes = {0: 1.0}
    if config.window is not None:
        probes.update({config.window - 1: 1.0, config.window: INVISIBLE_VALUE_SCALE,
                       config.window + 1: INVISIBLE_VALUE_SCALE})
    for offset, value_scale in sorted(probes.items()):
        probe = positions - offset  # [B]
        for b in range(B):
            if int(probe[b]) >= 0:
                k[b, int(probe[b])] += boost[b, :, None] * direction[b]
                v[b, int(probe[b])] *= value_scale
    sinks = None
    if config.sinks:  # a probe's share of the softmax where the most keys are visible, so leaving it out shows
        sinks = 0.5 * draw(Hq) + float(visible.max().log()) + 3.0
    return q.to(working), k.to(working), v.to(working), sinks


def _kernel(device: str):
    """launch(q, k, v, sinks, spec, q_start, num_splits, combine, out): the dispatcher's fused arm when
    num_splits is None (engine.arms, what the decode step calls), else flash_decode with that split count and
    merge. Imported late: on a CPU under the interpreter, which Triton reads when the kernel module is first
    imported."""
    require_interpreter(device, "kernels.attention_decode")
    from engine.arms import ARMS
    from engine.triton_support import require_triton
    from kernels.attention_decode import flash_decode

    require_triton("check-attention --decode")

    def launch(q, k, v, sinks, spec, q_start, num_splits=None, combine=None, out=None):
        if num_splits is None:
            return ARMS["fused"].launch(q, k, v, sinks, spec, q_start, None)
        return flash_decode(q, k, v, sinks, spec, q_start, None, out=out, num_splits=num_splits, combine=combine)

    return launch


def _splits(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec) -> tuple[int, int]:
    """(the step's split count on this device, the merged runs' count: up to 4, as many as the walk has tiles)."""
    from kernels.attention_decode import default_num_splits

    meta = [torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") for tensor in (q, k)]
    return default_num_splits(q, k, spec), default_num_splits(*meta, spec)  # meta: the interpreter's min(4, tiles)


def _sits_on(output: torch.Tensor, references: dict, controls: list[float], multiple: float):
    """Per sequence: {reference: error / control} and the set within `multiple` controls; NaN sits nowhere."""
    per_sequence = []
    for b, control in enumerate(controls):
        ratios = {name: _relative(output[b], ref[b]) / control for name, ref in references.items()}
        finite = bool(torch.isfinite(output[b]).all())
        per_sequence.append((ratios, {name for name, ratio in ratios.items() if finite and ratio <= multiple}))
    return per_sequence


def _run_verdict(per_sequence, names: list[str]) -> str:
    common = set(names)
    for _, sits in per_sequence:
        common &= sits
    if OK in common:
        return OK
    return common.pop() if len(common) == 1 else "none"


def check_decode(seq_len: int, batch: int, head_dim: int, heads: int, kv_heads: int | None = None,
                 window: int | None = None, sinks: bool = False, mode: str = "honor", device: str = "auto",
                 dtype: "str | torch.dtype | None" = None, seed: int = 0, progress=None) -> dict:
    """Run the check on fresh random inputs (module docstring). Raises UserError for bad options;
    `result["ok"]` is True when every mode discriminates and every run sits on `ok`. `progress.advance` is called
    after the references and after each run of the kernel (at most CHECK_PARTS calls), where a caller may stop
    the check by raising."""
    device = resolve_device(device)
    if isinstance(dtype, torch.dtype):
        dtype = next((name for name, value in DTYPES.items() if value == dtype), str(dtype))
    config = DecodeCheckConfig(seq_len, batch, head_dim, heads, heads if kv_heads is None else kv_heads,
                               window or None, bool(sinks), mode, device,
                               dtype or ("bf16" if device == "cuda" else "fp32"), seed)
    launch = _kernel(device)
    working = DTYPES[config.dtype]
    multiple = SITS_ON_MULTIPLE[working]
    positions = torch.tensor(decode_positions(config.batch, config.seq_len, config.window), device=device)
    q, k, v, sink_logits = _draw_inputs(config, positions, working)
    q32, k32, v32 = q.float(), k.float(), v.float()

    before = launches.snapshot()
    names = reference_names(config)
    references = {name: _reference(name, q32, k32, v32, sink_logits, positions, config) for name in names}
    controls = [max(ulp_control(references[OK][b], working), 1e-30) for b in range(config.batch)]
    discrimination = {}
    for name in names[1:]:
        ratios = [_relative(references[name][b], references[OK][b]) / controls[b] for b in range(config.batch)]
        best = max(range(config.batch), key=ratios.__getitem__)
        discrimination[name] = {"ratio": ratios[best], "sequence": best, "fires": ratios[best] > DISCRIMINATION_RATIO}
    fires = all(row["fires"] for row in discrimination.values())
    advance(progress, "references")

    q_start = positions.to(torch.int32)
    spec = config.spec if mode == "honor" else MaskSpec("none")  # drop: no mask over the whole capacity
    step_splits, many = _splits(q, k, spec)
    plans = [("step", None, None, step_splits), ("one split", 1, None, 1)]
    if many >= 2:
        plans += [("merged by the last split", many, "last", many), ("merged by the combine kernel", many, "kernel",
                                                                      many)]
    runs = []
    for label, num_splits, combine, shown_splits in plans:
        poisoned = None if num_splits is None else torch.full_like(q, float("nan"))
        out = launch(q, k, v, sink_logits, spec, q_start, num_splits, combine, poisoned).float()
        per_sequence = _sits_on(out, references, controls, multiple)
        errors = {name: _relative(out, ref) for name, ref in references.items()}
        runs.append({"run": label, "splits": shown_splits, "combine": combine or "default",
                     "errors": errors, "finite": bool(torch.isfinite(out).all()),
                     "verdict": _run_verdict(per_sequence, names) if fires else "none",
                     "sequences": [sorted(sits) for _, sits in per_sequence],
                     "_rows": (out - references[OK]).norm(dim=-1)[:, 0]})  # [B, Hq]
        advance(progress, label)

    wrong = {run["verdict"] for run in runs} - {OK}  # a mode some runs show (a merge's alone, say) names the check
    verdict = OK if not wrong else wrong.pop() if len(wrong) == 1 else "none"
    worst = _worst(runs, references[OK], controls, positions)
    control = ulp_control(references[OK], working)
    return {
        "config": {**asdict(config), "mask": config.spec.describe(), "positions": positions.tolist(),
                   "kernel": "flash_decode (Triton" + (", interpreter)" if device == "cpu" else ")")},
        "discrimination": {"modes": discrimination, "threshold": DISCRIMINATION_RATIO, "fires": fires},
        "control": control,
        "sits_on_multiple": multiple,
        "errors": runs[0]["errors"],
        "runs": [{key: value for key, value in run.items() if key != "_rows"} for run in runs],
        "merged": many >= 2,
        "worst": worst,
        "verdict": verdict,
        "sentence": _sentence(verdict, runs, discrimination, fires, config, many),
        "ok": bool(fires and verdict == OK),
        "launches": launches.since(before),
    }


def _worst(runs: list[dict], ok_ref: torch.Tensor, controls: list[float], positions: torch.Tensor) -> dict:
    """The (run, sequence, head) farthest from `ok`, in that sequence's controls of its RMS row."""
    best = None
    for run in runs:
        rows = run["_rows"].nan_to_num(float("inf"))  # [B, Hq]
        rms = ok_ref.norm(dim=-1)[:, 0].pow(2).mean(-1).sqrt().clamp_min(1e-30)  # [B]
        scaled = rows / rms[:, None] / torch.tensor(controls, device=rows.device)[:, None]
        flat = int(scaled.argmax())
        sequence, head = divmod(flat, rows.shape[1])
        value = float(scaled[sequence, head])
        if best is None or value > best["controls"]:
            best = {"run": run["run"], "sequence": sequence, "position": int(positions[sequence]), "head": head,
                    "controls": value, "sits_on": run["sequences"][sequence]}
    return best


def _sentence(verdict, runs, discrimination, fires, config, many) -> str:
    if not fires:
        weak = [name for name, row in discrimination.items() if not row["fires"]]
        return (f"The check does not discriminate here: {', '.join(weak)} moves the reference by at most "
                f"{min(discrimination[name]['ratio'] for name in weak):.3g}x the 1-ULP control (needs > "
                f"{DISCRIMINATION_RATIO:g}x); use a longer --seq-len or more --batch.")
    merged = "" if many >= 2 else (f" (the walk is one key tile here, so the kernel never merges splits; a "
                                   f"longer {'--window' if config.window else '--seq-len'} makes it)")
    if verdict == OK:
        return (f"Every run sits on the {config.spec.describe()} reference on every sequence, each wrong mode more "
                f"than {DISCRIMINATION_RATIO:g}x the control away on some sequence: the decode kernel reads keys "
                f"{'p - W + 1' if config.window else '0'}..p and nothing stale{merged}.")
    bad = [f"{run['run']} ({run['splits']} split{'s' if run['splits'] != 1 else ''}): {run['verdict']}"
           for run in runs if run["verdict"] != OK]
    if verdict == "none":
        return "The kernel output sits on no single reference: " + "; ".join(bad) + "."
    return f"The kernel output sits on the {verdict.upper()} reference, not ok: " + "; ".join(bad) + "."
