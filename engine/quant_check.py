"""The magnitude check of a trellis MoE arm (`check-quant`): does it compute the dequantized experts, and how
far are those from the original weights?

For one MoE layer of a trellis checkpoint and each token count, fresh random inputs (rows of N(0, 1), routed
uniformly, top-k weights from a softmax) go through
    the arm under test                  (a registered trellis arm, or the torch rotated-basis form)
    the dequantized reference           kernels.reference.moe_reference on the dequantized stacks, float32
    the original reference              kernels.reference.moe_reference on the source model's weights
and the distances, each relative ‖a − b‖ / ‖b‖ in float32, are read beside a control: the relative change
of the dequantized reference's output moved by one ULP of the working dtype (engine.compare's). Order:
1. discrimination: ‖dequantized − original‖ must be ≫ the control (the quantization error is visible),
   else no verdict can tell an arm that decodes from one that reads the original weights;
2. the arm's distance to each reference;
3. a verdict: the reference the arm sits on (within SITS_ON_MULTIPLE controls, the other SEPARATION
   times farther), and, for people, the quantization error itself (dequantized vs original).

Knows nothing of the CLI; returns a plain dict.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from engine import limits
from engine.compare import DTYPES, _relative, resolve_device, ulp_control
from engine.errors import UserError
from kernels import launches
from kernels.reference import moe_reference
from kernels.trellis_reference import TrellisMatrix, dequantize, moe_trellis_rotated

# The quantization error must exceed this many controls for a verdict: SITS_ON_MULTIPLE (bf16) times
# SEPARATION. Lower than check-attention's 100: one bf16 ULP is ~0.55 % of the output, and a 2-bit layer's
# output moves by ~40 % (about 70 controls), a 4-bit one's by ~10 % (about 20), both well clear of an arm's
# own rounding (~0.3-1 control), which is all the verdict has to separate them from.
DISCRIMINATION_RATIO = 16.0
# The other reference must be at least this many times farther than the one the arm sits on.
SEPARATION = 4.0
# The arm "sits on" a reference within this many controls:
# - float32 (the torch rotated form on a CPU): its Hadamard butterflies and products round in another order
#   than the reference's dequantize-then-multiply: measured 2.1-3.3 controls of 1 fp32 ULP on the tiny test
#   checkpoint of tests/test_trellis_checkpoint.py, 5.6-6.6 on the demo's 2-bit HYB checkpoint (D = 256:
#   longer sums); the quantization error sits 10^6 controls away on both.
# - bf16 (kernels on a GPU): the arm multiplies bf16-rounded decoded weights and activations, the reference
#   is float32 throughout: about one bf16 rounding of each product, averaging down over the sums.
SITS_ON_MULTIPLE = {torch.float32: 16.0, torch.float16: 4.0, torch.bfloat16: 4.0}
ROTATED = "rotated-torch"
DEFAULT_TOKENS = {"cpu": (1, 33), "cuda": (1, 64, 2048)}


def trellis_arms(device: str) -> dict[str, object]:
    """Arms that take trellis stacks: engine.arms' registered `trellis*` MoE arms that run on `device`, and the
    torch rotated-basis form (always)."""
    from engine.arms import ARMS

    arms: dict[str, object] = {}
    for name, arm in ARMS.items():
        if arm.family == "moe" and name.startswith("trellis") and arm.supports(torch.device(device)):
            arms[name] = lambda x, w13, w2, ids, weights, launch=arm.launch: launch(x, w13, w2, ids, weights,
                                                                                   tile_m=16, variant=None)
    arms[ROTATED] = moe_trellis_rotated
    return arms


def verified_source(directory: Path, original: str | None, option: str = "--original"
                    ) -> tuple[str, str, int, str | None]:
    """The model to measure against (config.json's source, or `original`) as (model, weights, seed, note). It must
    match the fingerprint quantize recorded (engine.source_fingerprint), else a UserError names what differs:
    against another model, or a source changed since, the "quantization error" would measure two models apart.
    A directory written before fingerprints were recorded cannot be verified: `note` says so (else None). A relative
    source path (a hand edit; quantize records absolute ones) is read against `directory`, not the cwd.
    `option`: the caller's option that names another model (check-quant's --original, compare's --b-model)."""
    from engine.config import PRESETS
    from engine.limits import MAX_SEED
    from engine.printable import printable
    from engine.source_fingerprint import differences, fingerprint
    from engine.trellis_checkpoint import source_of

    source = source_of(directory)
    model = original or source.get("model")
    weights = source.get("weights") if source.get("weights") in ("auto", "random") else "auto"
    if not model:
        raise UserError(f"{directory}: config.json names no source model: give {option} MODEL")
    if not isinstance(model, str):
        raise UserError(f"{directory}: config.json's source model is {type(model).__name__}, not a name or a path: "
                        f"give {option} MODEL, or quantize again")
    if not original and model not in PRESETS and not Path(model).expanduser().is_absolute():
        model = str(Path(directory) / model)  # a relative source (a hand edit) is the config's neighbour, not cwd's
    seed = source.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise UserError(f"{directory}: config.json's source seed is {printable(repr(seed), 40)}, not an integer "
                        f"from 0 to {MAX_SEED}: quantize again, or give {option} MODEL with its own weights")
    recorded, note = source.get("fingerprint"), None
    if not isinstance(recorded, dict):
        note = (f"{directory} records no fingerprint of its source (quantized before they were recorded): cannot "
                f"verify that {model} is the model it was quantized from")
    elif Path(model).expanduser().is_dir() or model in PRESETS:  # else Engine.load refuses it in its own words
        differ = differences(recorded, fingerprint(model, weights, seed))
        if differ:
            which = f"{option} {model}" if original else f"{directory}'s source {model}"
            raise UserError(f"{which} is not the model {directory} was quantized from ({'; '.join(differ[:3])}): "
                            f"the error would measure two models apart, not the quantization; give the original "
                            f"with {option} MODEL, or quantize again")
    return model, weights, seed, note


def _original_weights(directory: Path, layer: int, source: tuple[str, str, int, str | None], device: str,
                      given: bool = False, option: str = "--original"):
    """The w13 and w2 of `layer` of the source model `verified_source` gave, float32 (`given`: by `option`)."""
    from engine.config import PRESETS
    from engine.runtime import Engine
    from engine.trellis_checkpoint import is_trellis_directory

    model, weights, seed, _ = source
    names = [f"layers.{layer}.w13", f"layers.{layer}.w2"]
    path = Path(model).expanduser()
    try:
        if model not in PRESETS and weights == "auto" and path.is_dir() and not is_trellis_directory(path):
            from engine.hf_loader import load_some  # the layer's two tensors, not the model

            torch_device = torch.device(device)
            w13, w2 = load_some(path, names, torch_device, Engine.dtype_for(torch_device)).values()
        else:  # drawn weights are drawn whole (the seed's stream); a trellis "original" is refused below
            engine = Engine.load(model, device=device, seed=seed, weights=weights)
            w13, w2 = (engine.weights[name] for name in names)
    except UserError as error:
        raise UserError(f"the source model of {directory} ({model}) does not load ({error}): give {option} "
                        f"MODEL") from None
    if isinstance(w13, TrellisMatrix):
        which = f"{option} {model}" if given else f"{directory}'s recorded source {model}"
        raise UserError(f"{which}: its experts are trellis-coded too; give the unquantized model with {option} "
                        f"MODEL")
    return w13.float(), w2.float()


def moe_layer(config, layer: int | None, option: str = "--layer") -> int:
    """`layer`, or the first MoE layer when None; UserError for a layer the model lacks or a dense one (no experts).
    `option`: how the caller's user wrote it (a session step's `layer` key)."""
    if layer is None:
        return config.moe_layers[0]
    if not 0 <= layer < config.n_layers:
        raise UserError(f"{option} {layer}: {config.name} has layers 0..{config.n_layers - 1}")
    if layer not in config.moe_layers:
        raise UserError(f"{option} {layer}: a dense layer of {config.name}, without experts; give a MoE layer "
                        f"({_layer_list(config.moe_layers)})")
    return layer


def trellis_arm(arm: str | None, device: str, option: str = "--arm") -> str:
    """`arm`, or the first trellis arm `device` runs when None; UserError naming the ones it runs."""
    arms = trellis_arms(device)
    if arm is not None and arm not in arms:
        raise UserError(f"{option} {arm}: choose one of {', '.join(arms)} on {device}")
    return arm or next(iter(arms))


def _layer_list(layers: tuple[int, ...]) -> str:
    contiguous = list(layers) == list(range(layers[0], layers[-1] + 1))
    return f"{layers[0]}..{layers[-1]}" if contiguous and len(layers) > 2 else ", ".join(map(str, layers))


def check_quant(model: str, layer: int | None = None, tokens: tuple[int, ...] | None = None, arm: str | None = None,
                device: str = "auto", seed: int = 0, original: str | None = None) -> dict:
    """The check on `model` (a trellis checkpoint directory) at MoE layer `layer` (None: the first one; a dense
    layer is refused); UserError for bad options. `result["ok"]` when the arm sits on the dequantized reference
    at every token count."""
    from engine.model_source import model_config
    from engine.runtime import Engine
    from engine.trellis_checkpoint import is_trellis_directory

    device = resolve_device(device)
    config = model_config(model)  # config.json alone: a bad --layer is refused before a weight loads
    layer = moe_layer(config, layer)
    if tokens:
        limits.check_quant_request(config, tokens, device, "--tokens")
    # before the checkpoint loads; a directory that is not a trellis one is refused once loaded, in its own words
    directory = Path(model)
    trellis = is_trellis_directory(directory)
    if trellis and not any(directory.glob("*.safetensors")):
        raise UserError(f"--model {model}: a trellis shape (config.json alone, no codes): check-quant measures "
                        f"quantized codes against the weights they came from; quantize the model without "
                        f"--shape-only")
    source = verified_source(directory, original) if trellis else None
    engine = Engine.load(model, device=device)
    return check_quant_engine(engine, Path(model), layer=layer, tokens=tokens, arm=arm, seed=seed, original=original,
                              source=source)


def check_quant_engine(engine, directory: Path, layer: int | None = None, tokens: tuple[int, ...] | None = None,
                       arm: str | None = None, seed: int = 0, original: str | None = None,
                       source: tuple | None = None, option: str = "--original") -> dict:
    """`check_quant` on a loaded engine (a session's) whose model is the trellis directory `directory`; `source`:
    `verified_source`'s answer when the caller has it already."""
    device = engine.device.type
    model = str(directory)
    config = engine.config
    layer = moe_layer(config, layer)
    w13, w2 = engine.weights[f"layers.{layer}.w13"], engine.weights[f"layers.{layer}.w2"]
    if not isinstance(w13, TrellisMatrix):
        raise UserError(f"--model {model}: its experts are not trellis-coded; quantize it first with "
                        f"`moe-inspector quantize {shlex.quote(str(model))} --experts trellis:K=2,code=hyb --out DIR`")
    arm = trellis_arm(arm, device)
    arms = trellis_arms(device)
    tokens = tuple(tokens or DEFAULT_TOKENS[device])
    limits.check_quant_request(config, tokens, engine.device, "tokens")
    working = engine.dtype
    multiple = SITS_ON_MULTIPLE[working]
    source = source or verified_source(Path(directory), original, option)
    original13, original2 = _original_weights(Path(directory), layer, source, device, given=original is not None,
                                              option=option)
    source_note = source[3]
    dequantized13, dequantized2 = dequantize(w13), dequantize(w2)  # [E, 2F, D], [E, D, F] float32
    generator = torch.Generator(device=device).manual_seed(seed)
    rows, before = [], launches.snapshot()
    for count in tokens:
        x = torch.randn(count, config.hidden, generator=generator, device=device).to(working)  # [T, D]
        scores = torch.rand(count, config.n_experts, generator=generator, device=device)
        ids = scores.topk(config.top_k, dim=1).indices.to(torch.int32)  # [T, k] distinct experts per token
        weights = torch.softmax(torch.randn(count, config.top_k, generator=generator, device=device), dim=1)
        weights = weights.to(working)
        x32, weights32 = x.float(), weights.float()  # exact: the references see the arm's very inputs
        dequantized_ref = moe_reference(x32, dequantized13, dequantized2, ids, weights32)
        original_ref = moe_reference(x32, original13, original2, ids, weights32)
        out = arms[arm](x, w13, w2, ids, weights).float()
        control = ulp_control(dequantized_ref, working)
        gap = _relative(dequantized_ref, original_ref)
        errors = {"dequantized": _relative(out, dequantized_ref), "original": _relative(out, original_ref)}
        fires = gap > DISCRIMINATION_RATIO * control
        verdict = "none"
        if fires:
            for name, error in errors.items():
                other = errors["original" if name == "dequantized" else "dequantized"]
                if error <= multiple * control and other >= SEPARATION * max(error, control):
                    verdict = name
        rows.append({"tokens": count, "errors": errors, "control": control, "finite": bool(torch.isfinite(out).all()),
                     "discrimination": {"dequantized_vs_original": gap, "ratio": gap / control if control else 0.0,
                                        "threshold": DISCRIMINATION_RATIO, "fires": fires},
                     "verdict": verdict})
    ok = all(row["verdict"] == "dequantized" and row["finite"] for row in rows)
    fires = all(row["discrimination"]["fires"] for row in rows)
    return {"config": {"model": model, "layer": layer, "tokens": list(tokens), "arm": arm, "device": device,
                       "dtype": next(name for name, value in DTYPES.items() if value == working), "seed": seed,
                       "format": w13.code.describe(), "experts": config.n_experts, "top_k": config.top_k,
                       "hidden": config.hidden, "intermediate": config.intermediate},
            "rows": rows, "sits_on_multiple": multiple, "ok": ok, "discriminates": fires, "source_note": source_note,
            "sentence": _sentence(rows, arm, ok, fires, multiple), "launches": launches.since(before)}


def _sentence(rows, arm, ok, fires, multiple) -> str:
    gaps = [row["discrimination"]["dequantized_vs_original"] for row in rows]
    quantization = f"the quantization error (dequantized vs original) is {min(gaps):.3g}-{max(gaps):.3g} relative"
    if not fires:
        return (f"The dequantized and original references are within {DISCRIMINATION_RATIO:g} controls of each other "
                f"at some token count, so no verdict can tell them apart; {quantization}.")
    if ok:
        worst = max(row["errors"]["dequantized"] / row["control"] for row in rows)
        return (f"{arm} sits on the dequantized reference at every token count (at most {worst:.3g} controls; the "
                f"bound is {multiple:g}); {quantization}.")
    wrong = [row["tokens"] for row in rows if row["verdict"] != "dequantized"]
    return f"{arm} does not sit on the dequantized reference at {wrong} tokens; {quantization}."
