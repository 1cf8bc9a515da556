"""The magnitude check: does a fused attention output compute the masked attention the model
needs, plain causal attention, or unmasked attention?

Two implementations of the same math never agree bit for bit, so bit-equality proves nothing;
distances do. Every distance here is relative, ‖a − b‖ / ‖b‖ in float32, and is read beside a
control: the relative change from perturbing the masked reference's OUTPUT by one ULP of the
working dtype. (Perturbing a shared input would move both sides together and never fire.)

Order of the check (each part rules out a way the verdict could mislead):
1. discrimination — ‖masked_ref − causal_ref‖ / ‖masked_ref‖ must be ≫ the control, or no
   verdict can tell honouring the mask from dropping it;
2. the fused output's distance to the masked, causal and unmasked references;
3. ablation — the masked reference with the window, the block-start summaries, the padding each
   switched off, and the fused output's distance to each: where a failure lives;
4. the worst query row and, for it, the key whose visibility differs between the references;
5. a sink sweep sigma in {-inf, -5, 0, 5, +inf} (fused vs masked at each);
6. a verdict: the reference the fused output sits on, and a sentence for people.

The references are `kernels.reference.attention_reference` on the inputs upcast to float32
(exact: the inputs are representable), so they carry no rounding of the working dtype.
Knows nothing of the CLI or screens; returns a plain dict. Importable without textual.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

from engine.errors import UserError
from engine.progress import advance
from engine.runtime import resolve_device as resolve_engine_device
from engine.triton_support import require_triton
from kernels import launches
from kernels.reference import MaskSpec, attention_reference, visible_mask

MODES = ("honor", "drop")
HEAD_DIMS = (64, 128, 256, 512)
SINK_SWEEP = (float("-inf"), -5.0, 0.0, 5.0, float("inf"))
CHECK_PARTS = 5  # progress steps before the sink sweep: the references, the fused call, three ablations
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}

# The mask discriminates when switching it off moves the reference this many controls.
DISCRIMINATION_RATIO = 100.0
# The fused output "sits on" a reference when its error is within this many controls of it...
# - 16-bit: the output is rounded once to the working dtype (0.5 ULP) and the probabilities are
#   rounded to it before the P·V product (0.5 ULP per term, averaging down over the keys);
#   measured 0.34-0.40 controls in fp16 under the interpreter at the CLI's CPU defaults, every
#   sink of the sweep; 4 leaves room for bf16's coarser probabilities on the GPU.
# - float32: the kernel's exp2(x·log2 e) and its tile-by-tile rescaling round differently from
#   the reference's exp(x), a few ULPs per probability summed over the keys; measured 1.5-2.2
#   controls under the interpreter at the CLI's CPU defaults, every sink of the sweep.
# A dropped mask sits 10^3 (fp16) to 10^7 (fp32) controls away at those defaults.
SITS_ON_MULTIPLE = {torch.float32: 8.0, torch.float16: 4.0, torch.bfloat16: 4.0}
# ... and every other reference is at least this many times farther away.
SEPARATION = 10.0

# Sized so the CPU (Triton interpreter) run takes seconds and the GPU run is the incident's
# shape class (head_dim 512, windows and blocks of serving size).
DEFAULTS = {
    "cpu": dict(seq_len=96, head_dim=64, heads=2, kv_heads=None, window=16, block=8, pad=5),
    "cuda": dict(seq_len=2048, head_dim=512, heads=8, kv_heads=None, window=256, block=64, pad=64),
}


def check_mode_and_dtype(mode: str, dtype: str, device: str) -> None:
    """The options every magnitude check shares (this one and engine.compare_mla's); UserError naming the bad one."""
    if mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if device == "cpu" and dtype == "bf16":
        raise UserError("--dtype bf16 needs --device cuda: the Triton interpreter computes bf16 tl.dot "
                        "wrongly; use fp32 or fp16 on the CPU")


@dataclass(frozen=True)
class CheckConfig:
    seq_len: int
    head_dim: int
    heads: int
    kv_heads: int
    window: int
    block: int
    pad: int  # the first `pad` keys are padding (a left-padded sequence)
    mode: str  # honor: the fused kernel gets the mask; drop: plain causal (the incident)
    device: str
    dtype: str
    seed: int

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise UserError(f"--seq-len must be >= 1, got {self.seq_len}")
        if self.head_dim not in HEAD_DIMS:
            raise UserError(f"--head-dim must be one of {', '.join(map(str, HEAD_DIMS))} (a power of two "
                            f"in 64..512), got {self.head_dim}")
        if self.heads < 1 or self.kv_heads < 1:
            raise UserError(f"--heads and --kv-heads must be >= 1, got {self.heads} and {self.kv_heads}")
        if self.heads % self.kv_heads != 0:
            raise UserError(f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})")
        if self.window < 1:
            raise UserError(f"--window must be >= 1 (keys in the sliding window), got {self.window}")
        if self.block < 1:
            raise UserError(f"--block must be >= 1 (period of the block-start keys), got {self.block}")
        if not 0 <= self.pad < self.seq_len:
            raise UserError(f"--pad must be in 0..{self.seq_len - 1} (fewer padded keys than --seq-len), "
                            f"got {self.pad}")
        check_mode_and_dtype(self.mode, self.dtype, self.device)

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec("composite", window=self.window, block=self.block)


def resolve_device(device: "str | torch.device") -> str:
    """auto -> cuda when a GPU is visible, else cpu; cuda without one is the user's error (the
    engine's own resolver, so check-attention and generate accept and refuse the same devices)."""
    if isinstance(device, torch.device):
        device = str(device)
    return resolve_engine_device(device).type


def require_interpreter(device: str, kernel_module: str) -> None:
    """On the CPU a check's kernel runs under Triton's interpreter, which Triton reads when `kernel_module` is
    first imported: set it then, or refuse (UserError) where the module was imported without it."""
    if device != "cpu":
        return
    if kernel_module not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("--device cpu runs the Triton kernel under its interpreter: start with TRITON_INTERPRET=1")


def _fused_attention(device: str):
    """The Triton launcher, imported late: on the CPU it must run under the interpreter, which
    Triton reads when the kernel module is first imported."""
    require_interpreter(device, "kernels.attention")
    require_triton("check-attention")
    from kernels.attention import flash_attention

    return flash_attention


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float32; against an all-zero b, the absolute ‖a‖."""
    a, b = a.float(), b.float()
    denominator = b.norm().item()
    difference = (a - b).norm().item()
    return difference / denominator if denominator > 0 else difference


def one_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each element of x (float32 in, float32 out)."""
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(x.float().abs().clamp_min(tiny)))
    return torch.exp2(exponent - _MANTISSA_BITS[dtype])


def ulp_control(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative change of the reference output when every element moves by one ULP."""
    return _relative(reference.float() + one_ulp(reference, dtype), reference)


def _sink_label(value: float) -> str | float:
    return value if math.isfinite(value) else ("+inf" if value > 0 else "-inf")


def _verdict(errors: dict[str, float], control: float, multiple: float) -> str:
    for name, error in errors.items():
        others = [other for key, other in errors.items() if key != name]
        if error <= multiple * control and all(other >= SEPARATION * max(error, control) for other in others):
            return name
    return "none"


def _worst_position(
    fused: torch.Tensor,  # [1, T, Hq, hd] float32
    masked_ref: torch.Tensor,  # [1, T, Hq, hd]
    q: torch.Tensor, k: torch.Tensor,  # float32 inputs
    sinks: torch.Tensor,
    config: CheckConfig,
    padding: torch.Tensor,  # [1, T] bool
    other_name: str,  # causal or unmasked: references without padding
    other_spec: MaskSpec,
) -> dict:
    """The query row farthest from the masked reference and, for it, the key whose visibility
    differs between the masked and the `other` reference that carries the most weight there."""
    row_error = (fused - masked_ref).norm(dim=-1)[0]  # [T, Hq]
    rms_row = masked_ref.norm(dim=-1).pow(2).mean().sqrt().clamp_min(1e-30)
    flat = int(row_error.argmax())
    query, head = divmod(flat, config.heads)
    positions = torch.arange(config.seq_len, device=q.device)
    row = torch.tensor([query], device=q.device)
    masked_visible = visible_mask(config.spec, row, positions, padding[0])[0]  # [T]
    other_visible = visible_mask(other_spec, row, positions)[0]
    differs = masked_visible != other_visible
    worst = {
        "query": query,
        "head": head,
        "row_error": float(row_error[query, head] / rms_row),  # relative to the RMS row norm
        "compared_with": other_name,
        "key": None,
    }
    if not bool(differs.any()):
        return worst
    kv_head = head // (config.heads // config.kv_heads)
    scores = (k[0, :, kv_head] @ q[0, query, head]) / math.sqrt(config.head_dim)  # [T]
    scores = torch.cat([scores.masked_fill(~other_visible, float("-inf")), sinks[head].reshape(1).float()])
    weight_in_other = torch.softmax(scores, dim=0)[:-1].nan_to_num(0.0)
    key = int(torch.where(differs, weight_in_other, torch.full_like(weight_in_other, -1.0)).argmax())
    distance = query - key
    if key > query:
        why = "a future key (j > i)"
    elif bool(padding[0, key]):
        why = "a padded key"
    else:
        why = f"outside the window (i - j = {distance} >= W = {config.window}) and not a block start (j % {config.block} = {key % config.block})"
    worst.update({
        "key": key,
        "visible_in_masked": bool(masked_visible[key]),
        f"visible_in_{other_name}": bool(other_visible[key]),
        "weight_in_" + other_name: float(weight_in_other[key]),
        "why_masked_differs": why if not bool(masked_visible[key]) else "visible in the masked reference only",
    })
    return worst


def check_attention(
    seq_len: int,
    head_dim: int,
    heads: int,
    kv_heads: int | None,
    window: int,
    block: int,
    pad: int,
    mode: str = "honor",
    device: str = "auto",
    dtype: "str | torch.dtype | None" = None,  # None: bf16 on cuda, fp32 on cpu
    seed: int = 0,
    sink_values: tuple[float, ...] = SINK_SWEEP,
    progress=None,  # engine.progress.Progress-like: advance() after each kernel call or reference (may raise)
) -> dict:
    """Run the magnitude check on fresh random inputs; see the module docstring for the parts.
    Raises UserError for bad options. `result["ok"]` is True when the fused output sits on the
    masked reference and every sink of the sweep does too. `progress.advance` is called between the parts
    (CHECK_PARTS + len(sink_values) calls), where a caller may stop the check by raising."""
    device = resolve_device(device)
    if isinstance(dtype, torch.dtype):
        dtype = next((name for name, value in DTYPES.items() if value == dtype), str(dtype))
    config = CheckConfig(
        seq_len=seq_len, head_dim=head_dim, heads=heads, kv_heads=heads if kv_heads is None else kv_heads,
        window=window, block=block, pad=pad, mode=mode, device=device,
        dtype=dtype or ("bf16" if device == "cuda" else "fp32"), seed=seed,
    )
    flash_attention = _fused_attention(device)
    working = DTYPES[config.dtype]
    multiple = SITS_ON_MULTIPLE[working]

    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)

    T, H, Hkv, hd = config.seq_len, config.heads, config.kv_heads, config.head_dim
    q = draw(1, T, H, hd).to(working)  # [1, T, Hq, hd]
    k = draw(1, T, Hkv, hd).to(working)  # [1, T, Hkv, hd]
    v = draw(1, T, Hkv, hd).to(working)
    sinks = draw(H)  # [Hq]
    padding = torch.zeros(1, T, dtype=torch.bool, device=device)  # [1, T], True = padded
    padding[0, : config.pad] = True
    q32, k32, v32 = q.float(), k.float(), v.float()

    def reference(spec: MaskSpec, key_padding: torch.Tensor | None, sink_logits=sinks) -> torch.Tensor:
        return attention_reference(q32, k32, v32, sink_logits, spec, 0, key_padding)

    def fused(sink_logits: torch.Tensor) -> torch.Tensor:
        if config.mode == "drop":
            # The incident: the fused kernel is given no mask, so it computes plain causal.
            return flash_attention(q, k, v, sink_logits, MaskSpec("causal"), 0, None).float()
        return flash_attention(q, k, v, sink_logits, config.spec, 0, padding).float()

    before = launches.snapshot()
    masked_ref = reference(config.spec, padding)
    causal_ref = reference(MaskSpec("causal"), None)
    unmasked_ref = reference(MaskSpec("none"), None)
    control = ulp_control(masked_ref, working)
    advance(progress, "references")

    masked_vs_causal = _relative(causal_ref, masked_ref)
    discrimination = {
        "masked_vs_causal": masked_vs_causal,
        "masked_vs_unmasked": _relative(unmasked_ref, masked_ref),
        "control": control,
        "ratio": masked_vs_causal / control,
        "threshold": DISCRIMINATION_RATIO,
        "fires": masked_vs_causal > DISCRIMINATION_RATIO * control,
    }

    fused_out = fused(sinks)
    advance(progress, "fused kernel")
    errors = {
        "masked": _relative(fused_out, masked_ref),
        "causal": _relative(fused_out, causal_ref),
        "unmasked": _relative(fused_out, unmasked_ref),
    }
    verdict = _verdict(errors, control, multiple) if discrimination["fires"] else "none"

    ablation_specs = {
        # With no window every earlier key is visible, so the summaries change nothing either.
        "window_off": (MaskSpec("causal"), padding),
        "summaries_off": (MaskSpec("window", window=config.window), padding),
        "padding_off": (config.spec, None),
    }
    ablation = {}
    for name, (spec, key_padding) in ablation_specs.items():
        ablated = reference(spec, key_padding)
        ablation[name] = {
            "effect": _relative(ablated, masked_ref),  # how much this part of the mask matters here
            "fused": _relative(fused_out, ablated),  # the fused output's distance to it
        }
        advance(progress, f"ablation {name}")
    nearest_ablation = min(ablation, key=lambda name: ablation[name]["fused"])

    other_name = verdict if verdict in ("causal", "unmasked") else min(("causal", "unmasked"), key=errors.get)
    other_spec = MaskSpec(other_name if other_name == "causal" else "none")
    worst = _worst_position(fused_out, masked_ref, q32, k32, sinks, config, padding, other_name, other_spec)

    sink_sweep = []
    for sink_value in sink_values:
        sink_logits = torch.full((H,), sink_value, device=device)
        swept_ref = reference(config.spec, padding, sink_logits)
        swept = fused(sink_logits)
        advance(progress, f"sink {_sink_label(sink_value)}")
        sweep_control = ulp_control(swept_ref, working)
        error = _relative(swept, swept_ref)
        finite = bool(torch.isfinite(swept).all())
        if swept_ref.norm().item() == 0:  # sigma = +inf: all mass on the sink, both are zero
            ok = finite and error == 0.0
        else:
            ok = finite and error <= multiple * sweep_control
        sink_sweep.append({
            "sink": _sink_label(sink_value), "error": error, "control": sweep_control, "finite": finite, "ok": ok,
        })

    ok = discrimination["fires"] and verdict == "masked" and all(row["ok"] for row in sink_sweep)
    return {
        "config": {**asdict(config), "mask": config.spec.describe(), "kernel": "flash_attention (Triton"
                   + (", interpreter)" if device == "cpu" else ")")},
        "discrimination": discrimination,
        "errors": errors,
        "control": control,
        "sits_on_multiple": multiple,
        "ablation": {**ablation, "nearest": nearest_ablation},
        "worst": worst,
        "sink_sweep": sink_sweep,
        "verdict": verdict,
        "sentence": _sentence(verdict, errors, control, discrimination, ablation, nearest_ablation, sink_sweep, config),
        "ok": ok,
        "launches": launches.since(before),
    }


def _sentence(verdict, errors, control, discrimination, ablation, nearest_ablation, sink_sweep, config) -> str:
    def times(name: str) -> str:
        return f"{errors[name] / control:.3g}×"

    if not discrimination["fires"]:
        return (
            f"The mask does not discriminate here: switching it off moves the reference by only "
            f"{discrimination['ratio']:.3g}× the 1-ULP control (needs > {DISCRIMINATION_RATIO:g}×), so no "
            f"verdict can tell honouring the mask from dropping it; use a longer --seq-len, a smaller "
            f"--window or some --pad."
        )
    failed_sinks = [str(row["sink"]) for row in sink_sweep if not row["ok"]]
    if verdict == "masked":
        sentence = (
            f"The fused output sits on the masked reference ({times('masked')} the 1-ULP control; causal "
            f"{times('causal')}, unmasked {times('unmasked')} away): the mask is honoured."
        )
        if failed_sinks:
            sentence += f" But the sink sweep fails at sigma = {', '.join(failed_sinks)}."
        return sentence
    if verdict == "causal":
        return (
            f"The fused output sits on the CAUSAL reference, not the masked one ({times('causal')} vs "
            f"{times('masked')} the control): it computes plain causal attention and drops the mask "
            f"(window, block-start summaries, padding). Its error against the masked reference "
            f"({errors['masked']:.3g}) is the size of the mask's whole effect "
            f"({discrimination['masked_vs_causal']:.3g})."
        )
    if verdict == "unmasked":
        return (
            f"The fused output sits on the UNMASKED reference ({times('unmasked')} the control): it ignores "
            f"causality as well as the mask."
        )
    return (
        f"The fused output sits on none of the references (masked {times('masked')}, causal "
        f"{times('causal')}, unmasked {times('unmasked')} the control); nearest partial mask: "
        f"{nearest_ablation.replace('_', ' ')} (distance {ablation[nearest_ablation]['fused']:.3g})."
    )
