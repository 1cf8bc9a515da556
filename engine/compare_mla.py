"""The magnitude check of the fused (absorbed) latent attention against the decompressed reference:
does the Triton walk over the latent cache compute causal multi-head latent attention, attention
that ignores causality, or attention without the decoupled RoPE key?

As in engine.compare (the sinks kernel's check), distances are relative, ‖a − b‖ / ‖b‖ in float32,
read beside a 1-ULP control (the reference OUTPUT perturbed by one ULP of the working dtype):
1. discrimination: ‖causal_ref − unmasked_ref‖ / ‖causal_ref‖ must be ≫ the control;
2. the fused output's distance to three references, each computed the naive way (K and V
   decompressed per head, float32, from the working-dtype inputs upcast: exact):
       causal     what the model needs
       unmasked   every key visible to every query (causality lost: a wrong position or q_start)
       no_rope    the q_r . k_r term left out (the decoupled RoPE key lost)
3. the worst query row and head, and a verdict naming the reference the output sits on.

The fused side is the engine's arm itself, absorbed in the working dtype: q W_UK, the kernel
(kernels.attention_mla.mla_decode, under the Triton interpreter on a CPU), then W_UV. `mode=drop`
launches the kernel with every query at the last position (q_start = T - 1: each row sees every
key): the check must then say `unmasked`.
Knows nothing of the CLI or screens; returns a plain dict. Importable without textual.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from engine.compare import (DTYPES, SEPARATION, _relative, check_mode_and_dtype, require_interpreter, resolve_device,
                            ulp_control)
from engine.errors import UserError
from engine.progress import advance
from kernels import launches
from kernels.reference import mla_decompressed_reference

DISCRIMINATION_RATIO = 100.0
# The fused output "sits on" a reference within this many controls. The absorbed form sums in another
# order than the naive one (q W_UK first, then . c, against c W_UK^T first, then . q) and rounds where it does
# not: q W_UK to the working dtype before the walk, the probabilities before P c, the latent output before W_UV.
# Measured under the interpreter at the CPU defaults, seeds 0-2, both modes (against the reference each sits
# on): fp32 3.2-4.5 controls (the reordering, a few fp32 ULPs), fp16 0.46-0.52 (the dot accumulates in fp32;
# the roundings average down over R terms). bf16 (GPU) has the same roundings in units of its own ULP: 4 leaves
# room for the MMA order. A lost causal mask sits ~10^3 (fp16) to ~10^7 (fp32) controls away at the defaults.
SITS_ON_MULTIPLE = {torch.float32: 8.0, torch.float16: 4.0, torch.bfloat16: 4.0}
CHECK_PARTS = 2  # progress steps: the references, the fused call

# Seconds under the interpreter on a CPU; on CUDA DeepSeek-V3's shape (latent 512 + rope 64, 128 heads).
DEFAULTS = {
    "cpu": dict(seq_len=48, heads=4, kv_lora_rank=64, rope_dim=16, nope_dim=32, v_dim=32),
    "cuda": dict(seq_len=1024, heads=128, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128),
}


@dataclass(frozen=True)
class MlaCheckConfig:
    seq_len: int  # queries = keys (a prefill from position 0)
    heads: int
    kv_lora_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    mode: str
    device: str
    dtype: str
    seed: int

    def __post_init__(self) -> None:
        from engine.attention_dispatch import mla_kernel_declines

        for name in ("seq_len", "heads", "nope_dim", "v_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise UserError("--seq-len must be >= 2: with one key causal and unmasked attention are the same")
        why = mla_kernel_declines(self.kv_lora_rank, self.rope_dim)
        if why:
            raise UserError(f"--kv-lora-rank {self.kv_lora_rank} --rope-dim {self.rope_dim}: the fused MLA kernel "
                            f"takes no such shape ({why})")
        check_mode_and_dtype(self.mode, self.dtype, self.device)

    @property
    def scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5


def latent_dims(latent) -> dict[str, int]:
    """check_mla's four dims of a model's latent attention (an engine.config.LatentAttention)."""
    return {"kv_lora_rank": latent.kv_lora_rank, "rope_dim": latent.qk_rope_head_dim,
            "nope_dim": latent.qk_nope_head_dim, "v_dim": latent.v_head_dim}


def check_request(seq_len: int, heads: int, kv_lora_rank: int, rope_dim: int, device, where: str,
                  nope_dim: int = 0, v_dim: int = 0) -> None:
    """The check's memory at this shape, bounded before anything is allocated (engine.limits): the latent scores
    [heads, T, T + 1], as for attention over one kv head of kv_lora_rank + rope_dim, and, given nope_dim and v_dim,
    the projections around them."""
    from engine.limits import check_attention_request, require_fits

    check_attention_request(seq_len, heads, 1, kv_lora_rank + rope_dim, device, where)
    if min(seq_len, heads, nope_dim, v_dim, kv_lora_rank) < 1:
        return  # the config's validation names the bad value
    # the projections in fp32 and their working copies: q [T, H, n + r], W_UK [H, n, R], W_UV [H, v, R], the
    # absorbed query and latent output [T, H, R] and the outputs [T, H, v], about three of each alive
    floats = (seq_len * heads * (nope_dim + rope_dim + 2 * kv_lora_rank + v_dim)
              + heads * (nope_dim + v_dim) * kv_lora_rank)
    require_fits(3 * 4 * floats, device, f"{where}: the latent projections at seq_len {seq_len}, {heads} heads, "
                 f"latent {kv_lora_rank}, no-RoPE {nope_dim}, value {v_dim} dims", "lower seq_len, heads or the dims")


def _kernel(device: str):
    """kernels.attention_mla.mla_decode, imported late: on a CPU under the interpreter, which Triton reads
    when the kernel module is first imported."""
    require_interpreter(device, "kernels.attention_mla")
    from kernels.attention_mla import mla_decode

    return mla_decode


def check_mla(seq_len: int, heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int,
              mode: str = "honor", device: str = "auto", dtype: "str | torch.dtype | None" = None,
              seed: int = 0, progress=None) -> dict:
    """Run the check on fresh random inputs (module docstring). Raises UserError for bad options;
    `result["ok"]` is True when the discrimination fires and the fused output sits on the causal reference.
    `progress.advance` is called after the references and after the fused call (CHECK_PARTS calls), where a caller
    may stop the check by raising."""
    device = resolve_device(device)
    if isinstance(dtype, torch.dtype):
        dtype = next((name for name, value in DTYPES.items() if value == dtype), str(dtype))
    config = MlaCheckConfig(seq_len, heads, kv_lora_rank, rope_dim, nope_dim, v_dim, mode, device,
                            dtype or ("bf16" if device == "cuda" else "fp32"), seed)
    mla_decode = _kernel(device)
    working = DTYPES[config.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * scale).to(working)

    T, H, R, r = config.seq_len, config.heads, config.kv_lora_rank, config.rope_dim
    q = draw(1, T, H, config.nope_dim + r)  # [1, T, Hq, n + r]
    cache = draw(1, T, 1, R + r)  # [1, T, 1, R + r]: unit latents (RMS-normed, as the model's) and RoPE keys
    # W_UK at 1 / sqrt(R) keeps the decompressed keys at unit scale, so the scores are O(1) and softmax is neither
    # uniform nor one-hot; W_UV likewise
    w_uk, w_uv = draw(H, config.nope_dim, R, scale=R ** -0.5), draw(H, v_dim, R, scale=R ** -0.5)
    q32, cache32, w_uk32, w_uv32 = q.float(), cache.float(), w_uk.float(), w_uv.float()

    def reference(last_position: bool = False, rope: bool = True) -> torch.Tensor:
        query = q32 if rope else torch.cat([q32[..., :nope_dim], torch.zeros_like(q32[..., nope_dim:])], dim=-1)
        return mla_decompressed_reference(query, cache32, w_uk32, w_uv32, config.scale, T - 1 if last_position else 0)

    before = launches.snapshot()
    causal_ref = reference()
    unmasked_ref = reference(last_position=True)
    no_rope_ref = reference(rope=False)
    control = ulp_control(causal_ref, working)
    advance(progress, "references")
    causal_vs_unmasked = _relative(unmasked_ref, causal_ref)
    discrimination = {"causal_vs_unmasked": causal_vs_unmasked, "causal_vs_no_rope": _relative(no_rope_ref, causal_ref),
                      "control": control, "ratio": causal_vs_unmasked / control, "threshold": DISCRIMINATION_RATIO,
                      "fires": causal_vs_unmasked > DISCRIMINATION_RATIO * control}

    q_absorbed = torch.cat([torch.einsum("bthn,hnr->bthr", q[..., :nope_dim], w_uk), q[..., nope_dim:]], dim=-1)
    out_latent = mla_decode(q_absorbed, cache, R, config.scale, T - 1 if mode == "drop" else 0)  # [1, T, Hq, R]
    fused = torch.einsum("bthr,hvr->bthv", out_latent, w_uv).float()  # [1, T, Hq, v]
    advance(progress, "fused kernel")
    errors = {"causal": _relative(fused, causal_ref), "unmasked": _relative(fused, unmasked_ref),
              "no_rope": _relative(fused, no_rope_ref)}
    multiple = SITS_ON_MULTIPLE[working]
    verdict = "none"
    if discrimination["fires"]:
        for name, error in errors.items():
            others = [other for key, other in errors.items() if key != name]
            if error <= multiple * control and all(other >= SEPARATION * max(error, control) for other in others):
                verdict = name
    row_error = (fused - causal_ref).norm(dim=-1)[0]  # [T, Hq]
    query, head = divmod(int(row_error.argmax()), H)
    rms_row = causal_ref.norm(dim=-1).pow(2).mean().sqrt().clamp_min(1e-30)
    element = torch.finfo(working).bits // 8
    return {
        "config": {**asdict(config), "scale": config.scale,
                   "kernel": "mla_decode (Triton" + (", interpreter)" if device == "cpu" else ")")},
        "discrimination": discrimination,
        "errors": errors,
        "control": control,
        "sits_on_multiple": multiple,
        "worst": {"query": query, "head": head, "row_error": float(row_error[query, head] / rms_row)},
        "cache_bytes_per_token": {"latent": (R + r) * element, "decompressed": H * (nope_dim + r + v_dim) * element},
        "verdict": verdict,
        "sentence": _sentence(verdict, errors, control, discrimination),
        "ok": bool(discrimination["fires"] and verdict == "causal"),
        "launches": launches.since(before),
    }


def _sentence(verdict: str, errors: dict, control: float, discrimination: dict) -> str:
    def times(name: str) -> str:
        return f"{errors[name] / control:.3g}x"

    if not discrimination["fires"]:
        return (f"Causality does not discriminate here: the unmasked reference is only {discrimination['ratio']:.3g}x "
                f"the 1-ULP control from the causal one (needs > {DISCRIMINATION_RATIO:g}x); use a longer --seq-len.")
    if verdict == "causal":
        return (f"The fused output sits on the causal reference ({times('causal')} the 1-ULP control; unmasked "
                f"{times('unmasked')}, no RoPE key {times('no_rope')} away): the absorbed kernel computes latent "
                f"attention.")
    if verdict == "unmasked":
        return (f"The fused output sits on the UNMASKED reference ({times('unmasked')} against {times('causal')} the "
                f"control): every query sees every key, causality is lost (a wrong query position or q_start).")
    if verdict == "no_rope":
        return (f"The fused output sits on the reference WITHOUT the RoPE key ({times('no_rope')} the control): the "
                f"decoupled q_r . k_r term is lost.")
    nearest = min(errors, key=errors.get)
    return (f"The fused output sits on none of the references (causal {times('causal')}, unmasked "
            f"{times('unmasked')}, no RoPE key {times('no_rope')} the control); nearest: {nearest}.")
