"""`moe-inspector check-attention`: the magnitude check of the fused sinks attention kernel
against the masked, causal and unmasked references (engine.compare), as a table or JSON.

Exit 0 when the fused output sits on the masked reference (and every sink of the sweep does);
1 when it sits elsewhere; 2 for bad options, or when the mask does not discriminate at the chosen
sizes (the measurement could not tell honouring the mask from dropping it).

`--mla`: the same check for multi-head latent attention (engine.compare_mla): the absorbed kernel over
the latent cache against the decompressed references (causal, unmasked, without the RoPE key); exit 0
when it sits on the causal one. `--model` (after the command, or the global one when it is not the default)
takes the heads and latent dims from a preset or a checkpoint directory's config.json. The sinks check takes
`--model`'s head_dim, heads, kv heads and first masked layer's window and block (the F3 screen's sizes); a model
whose layers another check fits (--decode, --mla) or none is refused in one line naming it. `--model` means the
same given before the command or after it.

`--decode`: the decode check (engine.compare_decode): the split-KV decode kernel the decode step runs, over a
cache of --seq-len slots holding --batch sequences at different positions with stale garbage past each, against
the causal or sliding-window reference and one reference per failure mode (stale entries read, the newest key
missed, a position off by one, the window's boundary, the GQA mapping, the sink), for each split count; exit 0
when every run sits on `ok`. `--model` takes the dims from a preset or a checkpoint directory's config.json.
"""

from __future__ import annotations

import argparse
import sys

from engine.printable import printable
from inspector.commands.check_output import print_result
from inspector.commands.common import seed_argument
from inspector.commands.output import add_format_arguments, output_format


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-attention",
        help="is the fused attention kernel computing the masked attention, or something else?",
        description="Compare the fused sinks attention kernel with the masked (window + block-start + "
        "padding), causal and unmasked references, beside a 1-ULP control. Sizes default to a few "
        "seconds under the Triton interpreter on a CPU, and to the head_dim-512 incident's class on CUDA.",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="keys = queries (default 96 cpu / 2048 cuda)")
    parser.add_argument("--head-dim", type=int, default=None, help="64, 128, 256 or 512 (default 64 cpu / 512 cuda)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 2 cpu / 8 cuda)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key-value heads (default: --heads)")
    parser.add_argument("--window", type=int, default=None,
                        help="sliding window W (default 16 cpu / 256 cuda; --decode: none, or the model's; 0: none)")
    parser.add_argument("--block", type=int, default=None, help="block-start period B (default 8 cpu / 64 cuda)")
    parser.add_argument("--pad", type=int, default=None, help="leading padded keys (default 5 cpu / 64 cuda)")
    parser.add_argument("--mode", choices=("honor", "drop"), default="honor",
                        help="honor: the kernel gets the mask; drop: plain causal, the incident (default honor)")
    # --device and --seed also exist before the command; SUPPRESS keeps either spelling working.
    parser.add_argument("--device", default=argparse.SUPPRESS, help="auto, cpu or cuda (default auto)")
    parser.add_argument("--seed", type=seed_argument, default=argparse.SUPPRESS, help="input seed (default 0)")
    parser.add_argument("--dtype", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                        help="working dtype (default bf16 on cuda, fp32 on cpu)")
    add_format_arguments(parser, ("text", "json"), "text")
    mla = parser.add_argument_group("latent attention (--mla)")
    mla.add_argument("--mla", action="store_true",
                     help="check the absorbed MLA kernel over the latent cache against the decompressed reference")
    mla.add_argument("--kv-lora-rank", type=int, default=None, help="latent rank R (default 64 cpu / 512 cuda)")
    mla.add_argument("--rope-dim", type=int, default=None, help="RoPE key dims r (default 16 cpu / 64 cuda)")
    mla.add_argument("--nope-dim", type=int, default=None, help="per-head no-RoPE q/k dims (default 32 cpu / 128 cuda)")
    mla.add_argument("--v-dim", type=int, default=None, help="per-head value dims (default 32 cpu / 128 cuda)")
    decode = parser.add_argument_group("decode attention (--decode)")
    decode.add_argument("--decode", action="store_true",
                        help="check the split-KV decode kernel over a KV cache (causal or sliding-window layers)")
    decode.add_argument("--batch", type=int, default=None, help="sequences in one launch (default 4 cpu / 8 cuda)")
    decode.add_argument("--sinks", action=argparse.BooleanOptionalAction, default=None,
                        help="learned per-head sinks (default: off, or the model's)")
    # Every check's: given here or before the command, the same model (inspector.commands.check_decode.chosen_model).
    parser.add_argument("--model", dest="decode_model", default=None, metavar="MODEL",
                        help="take the dims from a preset or a checkpoint directory's config.json: the sinks check its "
                             "heads, kv heads, head_dim and first masked layer's window and block; --decode its "
                             "heads, kv heads, head_dim, window and sinks; --mla its heads and latent dims")
    parser.set_defaults(reads_globals=frozenset({"model"}), run=run)


MLA_ONLY = ("kv_lora_rank", "rope_dim", "nope_dim", "v_dim")
SINKS_ONLY = ("head_dim", "kv_heads", "window", "block", "pad")
DECODE_ONLY = ("batch", "sinks")


def run(args: argparse.Namespace) -> int:
    from engine.compare import DEFAULTS, CheckConfig, check_attention, resolve_device  # torch only when run
    from engine.errors import UserError

    fmt = output_format(args)
    device = resolve_device(getattr(args, "device", "auto"))
    # --model is every check's (before or after the command alike); --batch and --sinks only the decode check's
    if args.decode or any(getattr(args, name) is not None for name in DECODE_ONLY):
        from inspector.commands.check_decode import run_decode

        return run_decode(args, device, fmt)
    given = [name for name in (SINKS_ONLY if args.mla else MLA_ONLY) if getattr(args, name) is not None]
    if given:
        option = "--" + given[0].replace("_", "-")
        raise UserError(f"{option} is an option of the {'sinks' if args.mla else 'latent (--mla)'} check: "
                        + ("drop it, or drop --mla" if args.mla else "add --mla, or drop it"))
    if args.mla:
        return _run_mla(args, device, fmt)
    from inspector.commands.check_decode import chosen_model

    model_name = chosen_model(args)  # the global --model where given: the model's dims, as F3 takes them
    model_shape = _sinks_defaults(model_name, device) if model_name is not None else {}
    defaults = {**DEFAULTS[device], **{name: model_shape[name] for name in model_shape if name in DEFAULTS[device]}}
    options = {
        name: getattr(args, name) if getattr(args, name) is not None else default
        for name, default in defaults.items()
    }
    dtype = None if args.dtype == "auto" else args.dtype
    kv_heads = options["heads"] if options["kv_heads"] is None else options["kv_heads"]  # 0 is refused, not "unset"
    CheckConfig(**{**options, "kv_heads": kv_heads}, mode=args.mode, device=device,
                dtype=dtype or ("bf16" if device == "cuda" else "fp32"), seed=getattr(args, "seed", 0))  # bad options: now
    from engine.limits import check_attention_request  # before any allocation of its size

    check_attention_request(options["seq_len"], options["heads"], kv_heads,
                            options["head_dim"], device, "check-attention")
    # One call of tens of seconds under the interpreter: say what runs, on stderr (stdout stays the result).
    print(f"check-attention: the fused kernel and its references at seq {options['seq_len']}, head_dim "
          f"{options['head_dim']}, {options['heads']} heads on {device}"
          + (" (the Triton interpreter: tens of seconds)" if device == "cpu" else "") + " …",
          file=sys.stderr, flush=True)
    cut = _cut_mask(model_name, model_shape, options)
    if cut:
        print(f"check-attention: {cut}", file=sys.stderr, flush=True)
    result = check_attention(
        **options,
        mode=args.mode,
        device=device,
        dtype=dtype,
        seed=getattr(args, "seed", 0),
    )
    if model_shape:  # what the model runs, beside what was checked
        result["model_mask"] = {"window": model_shape["model_window"], "block": model_shape["model_block"],
                                "checked_at_the_models_sizes": not cut}
    return print_result(result, fmt, format_result)


def _cut_mask(model_name, model_shape: dict, options: dict) -> str:
    """A note when the check runs at a smaller window or block than the model's (the interpreter's sizes on a CPU),
    else ""."""
    if not model_shape or (options["window"], options["block"]) == (model_shape["model_window"],
                                                                    model_shape["model_block"]):
        return ""
    return (f"{printable(model_name)}'s mask is W={model_shape['model_window']}, B={model_shape['model_block']}; "
            f"checked at W={options['window']}, B={options['block']} (give --window, --block and --seq-len for the "
            f"model's sizes)")


def _run_mla(args: argparse.Namespace, device: str, fmt: str) -> int:
    from engine.compare_mla import DEFAULTS, check_mla, check_request
    from inspector.commands.check_decode import chosen_model

    defaults = dict(DEFAULTS[device])
    model_name = chosen_model(args)  # either --model, as the decode check takes it
    if model_name is not None:  # the model's heads and latent dims, as F3 takes them
        defaults.update(_latent_defaults(model_name))
    options = {name: getattr(args, name) if getattr(args, name) is not None else default
               for name, default in defaults.items()}
    from engine.compare import resolve_device
    from engine.compare_mla import MlaCheckConfig

    dtype = None if args.dtype == "auto" else args.dtype
    MlaCheckConfig(**options, mode=args.mode, device=resolve_device(device),
                   dtype=dtype or ("bf16" if resolve_device(device) == "cuda" else "fp32"), seed=0)  # bad options first
    check_request(options["seq_len"], options["heads"], options["kv_lora_rank"], options["rope_dim"], device,
                  "check-attention --mla", options["nope_dim"], options["v_dim"])
    result = check_mla(**options, mode=args.mode, device=device, dtype=None if args.dtype == "auto" else args.dtype,
                       seed=getattr(args, "seed", 0))
    return print_result(result, fmt, format_mla_result)


def _sinks_defaults(model_name: str, device: str) -> dict[str, int]:
    """The sinks check's dims and sizes from a preset or a checkpoint directory's config.json, as F3 takes them
    (inspector.attention_kind); UserError naming the check that applies where the sinks check does not."""
    from engine.errors import UserError
    from engine.model_source import model_config
    from inspector import attention_kind

    config = model_config(model_name)
    kind = attention_kind.check_kind(config)
    if kind is None:
        raise UserError(f"check-attention --model {model_name}: {attention_kind.why_not(config)}")
    if kind != attention_kind.SINKS:
        raise UserError(f"check-attention --model {model_name}: its layers have "
                        f"{attention_kind.model_attention(config)}; the sinks check (sinks with a composite mask) does "
                        f"not apply: run check-attention --{kind}")
    shape = attention_kind.attention_shape(config, device == "cuda")
    return {name: shape[name] for name in ("seq_len", "head_dim", "heads", "kv_heads", "window", "block", "pad",
                                           "model_window", "model_block")}


def _latent_defaults(model_name: str) -> dict[str, int]:
    """check_mla's heads and four latent dims from a preset or a checkpoint directory's config.json (UserError for a
    model without latent attention)."""
    from engine.compare_mla import latent_dims
    from engine.errors import UserError
    from engine.model_source import model_config

    model = model_config(model_name)
    if model.latent_attention is None:
        raise UserError(f"check-attention --mla --model {model_name}: {model.name} has no latent attention (the "
                        f"latent check is for DeepSeek-style layers; --decode checks causal and window attention)")
    return {"heads": model.n_heads, **latent_dims(model.latent_attention)}


def format_mla_result(result: dict) -> str:
    config, control, discrimination = result["config"], result["control"], result["discrimination"]
    cache = result["cache_bytes_per_token"]
    lines = [
        f"check-attention --mla  seq {config['seq_len']}  heads {config['heads']}  latent {config['kv_lora_rank']} + "
        f"rope {config['rope_dim']}  nope {config['nope_dim']}  v {config['v_dim']}  {config['dtype']}  "
        f"{config['device']}  mode {config['mode']}  seed {config['seed']}",
        f"kernel: {config['kernel']}; cache per token per layer: {cache['latent']} B latent against "
        f"{cache['decompressed']} B decompressed",
        "",
        f"control: 1 {config['dtype']} ULP of the causal reference output = {control:.3g} (relative)",
        f"discrimination: |causal - unmasked| / |causal| = {discrimination['causal_vs_unmasked']:.3g} = "
        f"{discrimination['ratio']:.3g}x control (needs > {discrimination['threshold']:g}x): "
        + ("fires" if discrimination["fires"] else "DOES NOT FIRE"),
        "",
        f"{'fused vs reference':<24}{'relative error':>16}{'x control':>12}",
    ]
    for name, error in result["errors"].items():
        marker = "  <- sits here" if name == result["verdict"] else ""
        lines.append(f"  {name:<22}{error:>16.3g}{error / control if control > 0 else 0.0:>11.3g}x{marker}")
    worst = result["worst"]
    lines += ["", f"worst row: query {worst['query']} head {worst['head']} (row error {worst['row_error']:.3g} of the "
                  f"RMS row norm)",
              "launches: " + (", ".join(f"{name} x{count}" for name, count in result["launches"].items()) or "none"),
              "", f"verdict: {result['verdict']}", result["sentence"]]
    return "\n".join(lines)


def format_result(result: dict) -> str:
    config = result["config"]
    control = result["control"]
    discrimination = result["discrimination"]

    def times(error: float) -> str:
        return f"{error / control:10.3g}x" if control > 0 else "         -"

    lines = [
        f"check-attention  {config['mask']}  pad {config['pad']}  seq {config['seq_len']}  hd {config['head_dim']}  "
        f"heads {config['heads']}/{config['kv_heads']}  {config['dtype']}  {config['device']}  "
        f"mode {config['mode']}  seed {config['seed']}",
        f"kernel: {config['kernel']}",
        "",
        f"control: 1 {config['dtype']} ULP of the masked reference output = {control:.3g} (relative)",
        f"discrimination: |masked - causal| / |masked| = {discrimination['masked_vs_causal']:.3g} = "
        f"{discrimination['ratio']:.3g}x control (needs > {discrimination['threshold']:g}x): "
        + ("fires" if discrimination["fires"] else "DOES NOT FIRE"),
        "",
        f"{'fused vs reference':<24}{'relative error':>16}{'x control':>12}",
    ]
    for name, error in result["errors"].items():
        marker = "  <- sits here" if name == result["verdict"] else ""
        lines.append(f"  {name:<22}{error:>16.3g}{times(error):>12}{marker}")
    lines += ["", f"{'ablation (masked ref, one part off)':<38}{'effect':>10}{'fused dist':>12}"]
    for name in ("window_off", "summaries_off", "padding_off"):
        row = result["ablation"][name]
        lines.append(f"  {name.replace('_', ' '):<36}{row['effect']:>10.3g}{row['fused']:>12.3g}")
    lines += ["", f"{'sink sweep  sigma':<20}{'error':>12}{'x control':>12}{'finite':>8}{'ok':>6}"]
    for row in result["sink_sweep"]:
        ratio = row["error"] / row["control"] if row["control"] > 0 else 0.0
        lines.append(f"  {str(row['sink']):<18}{row['error']:>12.3g}{ratio:>11.3g}x{str(row['finite']):>8}"
                     f"{'yes' if row['ok'] else 'NO':>6}")
    worst = result["worst"]
    line = (f"worst row: query {worst['query']} head {worst['head']} (row error {worst['row_error']:.3g} of the "
            f"RMS row norm)")
    if worst["key"] is not None:
        other = worst["compared_with"]
        line += (f"; key {worst['key']}: visible in {other} (weight {worst['weight_in_' + other]:.3g}), "
                 f"not in masked: {worst['why_masked_differs']}")
    lines += ["", line]
    lines.append("launches: " + (", ".join(f"{name} x{count}" for name, count in result["launches"].items()) or "none"))
    lines += ["", f"verdict: {result['verdict']}", result["sentence"]]
    return "\n".join(lines)
