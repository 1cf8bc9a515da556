"""A session's check-attention step with `decode = true`: the decode check (engine.compare_decode.check_decode,
what `check-attention --decode` and F3 on a causal or sliding-window model run).

The step's head_dim, heads, kv_heads, window and sinks default to the model's (its first sliding-window layer's
window; none when every layer is causal); seq_len is the cache capacity and batch the sequences in one launch.
Refused before anything runs, one line naming the step: options or verdicts of the other checks beside
decode = true, decode options or verdicts without it, a model the check takes no dims from (latent attention, a
composite mask, a head_dim no fused kernel takes) unless the step gives them, and sizes the check refuses
(seq_len < 2, a window that cannot bind, a batch out of range, GQA groups the kernel does not take).
"""

from __future__ import annotations

import re
from typing import Any

from engine.errors import UserError

DECODE_ONLY = ("batch", "sinks")
NOT_DECODE = ("block", "kv_lora_rank", "rope_dim", "nope_dim", "v_dim")
DIMS = ("head_dim", "heads", "kv_heads")


def _decode_verdicts() -> tuple[str, ...]:
    from inspector.session import DECODE_VERDICTS

    return DECODE_VERDICTS


def refuse_decode_options(here: str, step) -> None:
    """A step without decode = true that carries the decode check's options or verdicts."""
    given = [name for name in DECODE_ONLY if getattr(step, name) is not None]
    verdict = step.expect if step.expect in _decode_verdicts() and step.expect != "none" else None
    if given or verdict:
        what = ", ".join(given) if given else f'expect = "{verdict}"'
        raise UserError(f"{here}: {what} belongs to the decode check; add decode = true, or drop it")


def decode_shape(step, model, here: str) -> dict[str, Any]:
    """check_decode's sizes and dims: the step's, else the model's (UserError naming the step where the model
    gives none and the step leaves some out)."""
    from engine import compare_decode

    declined = compare_decode.model_declines(model)
    from_model = {} if declined else compare_decode.model_dims(model)
    missing = [name for name in DIMS if getattr(step, name) is None and name not in from_model]
    if missing:
        raise UserError(f"{here}: {declined}; for the decode check set {' = ..., '.join(missing)} = ... in the "
                        f"step, or drop decode = true")
    shape = {name: getattr(step, name) if getattr(step, name) is not None else from_model[name] for name in DIMS}
    return {"seq_len": step.seq_len, "batch": step.batch or compare_decode.DEFAULTS["cpu"]["batch"], **shape,
            "window": (step.window or None) if step.window is not None else from_model.get("window"),  # 0: causal
            "sinks": step.sinks if step.sinks is not None else from_model.get("sinks", False)}


def preflight_decode(here: str, step, model, device) -> None:
    from engine import compare_decode

    if step.mla:
        raise UserError(f"{here}: mla = true and decode = true are two checks (the latent kernel, the decode "
                        f"kernel): keep one")
    given = [name for name in NOT_DECODE if getattr(step, name) is not None] + (["pad"] if step.pad else [])
    if given:
        raise UserError(f"{here}: {', '.join(given)} belongs to another check, not the decode one (decode = true); "
                        f"drop it")
    if step.expect is not None and step.expect not in _decode_verdicts():
        raise UserError(f'{here}: expect = "{step.expect}" is a verdict of another check; the decode check\'s are '
                        f"{', '.join(_decode_verdicts())}")
    shape = decode_shape(step, model, here)
    kind = getattr(device, "type", str(device))
    dtype = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(step.dtype or "",
                                                                         "bf16" if kind == "cuda" else "fp32")
    try:
        compare_decode.DecodeCheckConfig(**shape, mode=step.mode, device=kind, dtype=dtype, seed=0)
    except UserError as error:  # the check's own words, named for the step (its keys are the options' names)
        named = re.sub(r"--([a-z]+(?:-[a-z]+)*)", lambda match: match.group(1).replace("-", "_"), str(error))
        raise UserError(f"{here}: {named}") from None
    compare_decode.check_request(shape["seq_len"], shape["batch"], shape["heads"], shape["kv_heads"],
                                 shape["head_dim"], device, here)
