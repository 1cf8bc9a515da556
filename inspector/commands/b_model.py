"""compare's `--b-model`: B on another model that shares A's tokenizer, or `source`, the model a trellis
checkpoint was quantized from (its recorded weights and seed, checked against the recorded fingerprint).

`plan` checks everything config.json and the recorded source can tell before A loads (a typo costs no load);
`load` loads B once A has, and checks that both read the prompt as the same tokens.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from engine.config import PRESETS, ModelConfig
from engine.errors import UserError
from engine.model_source import model_config, resolve_model_path
from engine.printable import one_line, printable
from engine.runtime import Engine

SOURCE = "source"
SHAPE = ("n_layers", "hidden", "n_experts", "top_k", "intermediate", "vocab_size")


@dataclass(frozen=True)
class BModel:
    given: str  # as the user wrote it: a preset, a path, or "source"
    model: str  # what loads: `given`, or the recorded source
    weights: str
    seed: int
    shares_a: bool  # the same model, weights and seed as A: A's engine runs B too

    @property
    def label(self) -> str:
        return self.given if self.given != SOURCE else f"source ({printable(self.model)})"


def _as_b(label: str, model: str, error: UserError) -> UserError:
    """The loader's refusal names --model; here the model is B's."""
    return UserError(f"--b-model {label}: {str(error).removeprefix(f'--model {model}: ')}")


def _same_model(a: str, b: str) -> bool:
    if a in PRESETS or b in PRESETS:
        return a == b
    return resolve_model_path(a).resolve() == resolve_model_path(b).resolve()


def _recorded_source(args, config_a: ModelConfig) -> tuple[str, str, int, ModelConfig]:
    """(model, weights, seed, config) of the source the trellis checkpoint --model records, verified."""
    from engine.quant_check import verified_source
    from engine.trellis_checkpoint import is_trellis_directory

    directory = resolve_model_path(args.model)
    if args.model in PRESETS or not directory.is_dir() or not is_trellis_directory(directory):
        raise UserError(f"--b-model source: --model {printable(args.model)} is not a trellis checkpoint, so it "
                        f"records no source; name B's model (a preset or a checkpoint directory)")
    if args.weights == "random":
        raise UserError("--b-model source with --weights random: A's codes would be drawn at random, so the "
                        "difference would not be the quantization's; drop --weights random")
    try:
        model, weights, seed, note = verified_source(directory, None, option="--b-model")
    except UserError as error:
        raise UserError(f"--b-model source: {error}") from None
    if note:
        print(f"moe-inspector: note: {one_line(note)}", file=sys.stderr)
    label = f"source ({printable(model)})"
    try:
        config = model_config(model)
    except UserError as error:
        raise _as_b(label, model, error) from None
    if model not in PRESETS and is_trellis_directory(resolve_model_path(model)):
        raise UserError(f"--b-model {label}: its experts are trellis-coded too; name the unquantized model with "
                        f"--b-model MODEL")
    differ = [f"{name} {getattr(config, name)} against {getattr(config_a, name)}" for name in SHAPE
              if getattr(config, name) != getattr(config_a, name)]
    if differ:
        raise UserError(f"--b-model {label}: not the model --model {printable(args.model)} was quantized from "
                        f"({', '.join(differ)}); name B's model with --b-model MODEL")
    return model, weights, seed, config


def plan(args) -> BModel | None:
    """B's model from --b-model, checked from the configs before a weight of A or B is read; None without it."""
    if args.b_model is None:
        return None
    if not args.b_model.strip():
        raise UserError("--b-model is empty: name B's model (a preset, a checkpoint directory, or source)")
    config_a = model_config(args.model)  # A's own refusal, as its load would give it
    if args.b_model == SOURCE:
        model, weights, seed, config = _recorded_source(args, config_a)
    else:
        model, weights, seed = args.b_model, args.weights, args.seed
        try:
            config = model_config(model)
        except UserError as error:
            raise _as_b(model, model, error) from None
    b = BModel(args.b_model, model, weights, seed,
               _same_model(args.model, model) and (weights, seed) == (args.weights, args.seed))
    if config.vocab_size != config_a.vocab_size:
        raise UserError(f"--b-model {b.label}: its vocabulary has {config.vocab_size} tokens and A's "
                        f"{config_a.vocab_size}: compare needs two models with one tokenizer")
    return b


def load(b: BModel | None, args, engine_a: Engine, prompt: str) -> Engine:
    """B's engine (A's when there is no B model, or B's is A's); the prompt must be the same tokens for both."""
    if b is None or b.shares_a:
        return engine_a
    try:
        engine_b = Engine.load(b.model, args.device, b.seed, b.weights, text=True, progress=not args.no_progress)
    except UserError as error:
        raise _as_b(b.label, b.model, error) from None
    if engine_b.encode_prompt(prompt) != engine_a.encode_prompt(prompt):
        raise UserError(f"--b-model {b.label}: it reads the prompt as other tokens than --model "
                        f"{printable(args.model)} does: compare needs two models with one tokenizer")
    return engine_b
