"""compare's `--b-model`: B on another model that shares A's tokenizer, or `source`, the model a trellis
checkpoint was quantized from (its recorded weights and seed, checked against the recorded fingerprint).

`plan` checks everything config.json and the recorded source can tell before A loads (a typo costs no load);
`load` loads B once A has, and checks that both read the prompt as the same tokens. A session's compare step
with `b_model` runs the same two (`plan_for`, `load_for`), its refusals naming the step's keys (`Names`).
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
class Names:
    """How refusals name what the user wrote: compare's options, or a session step's keys."""

    b: str = "--b-model"
    a: str = "--model"
    random: str = "--weights random"
    give: str = "--b-model"  # as in "give the original with {give} MODEL"


OPTIONS = Names()


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


def _as_b(label: str, model: str, error: UserError, names: Names = OPTIONS) -> UserError:
    """The loader's refusal names --model; here the model is B's."""
    return UserError(f"{names.b} {label}: {str(error).removeprefix(f'--model {model}: ')}")


def _same_model(a: str, b: str) -> bool:
    if a in PRESETS or b in PRESETS:
        return a == b
    return resolve_model_path(a).resolve() == resolve_model_path(b).resolve()


_NOTED: set[str] = set()


def _recorded_source(model_a: str, weights_a: str, config_a: ModelConfig,
                     names: Names) -> tuple[str, str, int, ModelConfig]:
    """(model, weights, seed, config) of the source the trellis checkpoint `model_a` records, verified."""
    from engine.quant_check import verified_source
    from engine.trellis_checkpoint import is_trellis_directory

    directory = resolve_model_path(model_a)
    if model_a in PRESETS or not directory.is_dir() or not is_trellis_directory(directory):
        raise UserError(f"{names.b} source: {names.a} {printable(model_a)} is not a trellis checkpoint, so it "
                        f"records no source; name B's model (a preset or a checkpoint directory)")
    if weights_a == "random":
        raise UserError(f"{names.b} source with {names.random}: A's codes would be drawn at random, so the "
                        f"difference would not be the quantization's; drop {names.random}")
    try:
        model, weights, seed, note = verified_source(directory, None, option=names.give)
    except UserError as error:
        raise UserError(f"{names.b} source: {error}") from None
    if note and note not in _NOTED:  # once a process: a session's preflight and its step both plan B
        _NOTED.add(note)
        print(f"moe-inspector: note: {one_line(note)}", file=sys.stderr)
    label = f"source ({printable(model)})"
    try:
        config = model_config(model)
    except UserError as error:
        raise _as_b(label, model, error, names) from None
    if model not in PRESETS and is_trellis_directory(resolve_model_path(model)):
        raise UserError(f"{names.b} {label}: its experts are trellis-coded too; name the unquantized model with "
                        f"{names.give} MODEL")
    differ = [f"{name} {getattr(config, name)} against {getattr(config_a, name)}" for name in SHAPE
              if getattr(config, name) != getattr(config_a, name)]
    if differ:
        raise UserError(f"{names.b} {label}: not the model {names.a} {printable(model_a)} was quantized from "
                        f"({', '.join(differ)}); name B's model with {names.give} MODEL")
    return model, weights, seed, config


def plan(args) -> BModel | None:
    """B's model from --b-model, checked from the configs before a weight of A or B is read; None without it."""
    if args.b_model is None:
        return None
    return plan_for(args.model, args.b_model, args.weights, args.seed)


def plan_for(model_a: str, b_model: str, weights: str, seed: int, names: Names = OPTIONS) -> BModel:
    """B's model beside A's (`model_a`, loaded with `weights` and `seed`), from the configs alone. Paths are taken
    as given: a session resolves its relative ones first."""
    if not b_model.strip():
        raise UserError(f"{names.b} is empty: name B's model (a preset, a checkpoint directory, or source)")
    config_a = model_config(model_a)  # A's own refusal, as its load would give it
    if b_model == SOURCE:
        model, b_weights, b_seed, config = _recorded_source(model_a, weights, config_a, names)
    else:
        model, b_weights, b_seed = b_model, weights, seed
        try:
            config = model_config(model)
        except UserError as error:
            raise _as_b(model, model, error, names) from None
    b = BModel(b_model, model, b_weights, b_seed,
               _same_model(model_a, model) and (b_weights, b_seed) == (weights, seed))
    if config.vocab_size != config_a.vocab_size:
        raise UserError(f"{names.b} {b.label}: its vocabulary has {config.vocab_size} tokens and A's "
                        f"{config_a.vocab_size}: compare needs two models with one tokenizer")
    return b


def load(b: BModel | None, args, engine_a: Engine, prompt: str) -> Engine:
    """B's engine (A's when there is no B model, or B's is A's); the prompt must be the same tokens for both."""
    if b is None:
        return engine_a
    return load_for(b, args.device, engine_a, prompt, progress=not args.no_progress, model_a=args.model)


def load_for(b: BModel, device: str, engine_a: Engine, prompt: str | None, progress: bool, model_a: str,
             names: Names = OPTIONS) -> Engine:
    """`load` for a planned B: A's engine when B's is A's, else B loaded on `device` and its prompt tokens checked
    (None: no prompt yet, the TUI checks each run's)."""
    if b.shares_a:
        return engine_a
    try:
        engine_b = Engine.load(b.model, device, b.seed, b.weights, text=True, progress=progress)
    except UserError as error:
        raise _as_b(b.label, b.model, error, names) from None
    if prompt is not None:
        check_prompt(b, engine_b, engine_a, prompt, model_a, names)
    return engine_b


def check_prompt(b: BModel, engine_b: Engine, engine_a: Engine, prompt: str, model_a: str,
                 names: Names = OPTIONS) -> None:
    """UserError unless both models read `prompt` as the same tokens (one tokenizer: the comparison's premise)."""
    if engine_b is not engine_a and engine_b.encode_prompt(prompt) != engine_a.encode_prompt(prompt):
        raise UserError(f"{names.b} {b.label}: it reads the prompt as other tokens than {names.a} "
                        f"{printable(model_a)} does: compare needs two models with one tokenizer")
