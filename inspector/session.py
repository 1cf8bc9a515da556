"""Session files: the format (version 1), a strict parser and an atomic writer.

A session is a script the TUI records and `moe-inspector run` executes headless:

    [session]
    version = 1                      # the format version; a newer one is refused, never guessed
    name = "flash512-mask"
    description = "optional words"

    [engine]
    model = "demo"                   # tiny, demo, v4-shape
    device = "auto"                  # auto, cpu, cuda, cuda:N  (`run --device` overrides it)
    seed = 0
    ep = 1                           # optional: experts over N ranks (`moe-inspector run` spawns them)

    [flags]                          # the starting flag state, validated like --set
    fused_mask = "honor"

    [[config]]                       # a named set of overrides of [flags], for side by side
    name = "drop"
    fused_mask = "drop"

    [[step]]
    action = "prompt"                # prompt, compare, curve, sweep, check-attention, check-quant, bench
    prompt = "..."
    max_tokens = 8
    config = "drop"                  # optional: run under this config instead of [flags]
    compare = "honor"                # optional: also run under this config, side by side
    expect_match = false             # optional check: true = identical tokens, false = diverge

    [[step]]
    action = "compare"               # one prompt under configs a and b, side by side
    prompt = "..."
    a = "base"
    b = "base"
    b_model = "source"               # optional: B on another model with A's tokenizer (a preset, a checkpoint
                                     # directory from the session file's, or source: a trellis checkpoint's)

    [[step]]
    action = "bench"                 # llama-bench rows: pp16, pp64, tg16 at batch 1 and 4
    pp = [16, 64]                    # prompt lengths (optional; pp and/or tg)
    tg = [16]                        # generated tokens (optional)
    batch = [1, 4]                   # sequences per row (default [1])
    reps = 2                         # timed repetitions after one warm-up (default 2)

Steps are numbered from 1 in errors, reports and results. The config name `base` is reserved:
it means [flags] with no overrides (`compare = "base"`).

Flag changes are not steps. [flags] holds the state when the session started; a step that ran
under other flags names a [[config]] holding the differences (the recorder creates one per
distinct set of differences, named after them, e.g. `fused_mask=drop`).

Strict: an unknown table or key, a wrong type, an unknown action, a missing required key, a
flag value `--set` would refuse, a config name that is not defined, or a version other than 1
is a `UserError` naming the file, the step and the key, with the fix.

Reading needs only tomllib (tomli before Python 3.11); writing imports tomli-w lazily, so the
GPU machines, which have no tomli-w, can still run sessions. Knows nothing of engines or
screens: the parser is plain functions over plain values.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from engine import flags as flag_registry
# The atomic writer lives in the engine (the calibration file uses it too); re-exported here.
from engine.atomic_file import TEMP_SUFFIX, atomic_write_bytes, atomic_write_text  # noqa: F401
from engine.errors import UserError
from engine.limits import MAX_SEED
from engine.printable import printable, unprintable_characters

FORMAT_VERSION = 1
# A session is a script of a few steps; a prompt of a 128k-token context is ~0.5 MB. Past this a
# file is refused before it is read (tomllib would take seconds and memory on a huge one).
MAX_SESSION_BYTES = 16 * 1024 * 1024
MAX_STEPS = 10_000
# No count, size or seed in a session is larger: beyond it a number is refused by the parser
# (the steps' own, tighter limits come from the model and the machine in the runner's preflight).
MAX_INTEGER = 2**53
BASE = "base"  # the reserved config name for [flags] alone
VERDICTS = ("masked", "causal", "unmasked", "no_rope", "none")  # no_rope: the latent check's (mla = true)
# The decode check's (decode = true): engine.compare_decode.VERDICTS, which a test keeps equal (no torch here).
DECODE_VERDICTS = ("ok", "reads_stale", "misses_newest", "off_by_one_behind", "off_by_one_ahead", "window_ignored",
                   "window_wide", "window_narrow", "kv_heads_interleaved", "sink_ignored", "none")
QUANT_VERDICTS = ("dequantized", "original", "none")  # engine.quant_check's
SWEEP_ARMS = ("gemv", "grouped", "torch_grouped_mm", "reference")
DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------------------------
# Field kinds: how a step key is validated and described in errors
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    describe: str  # for people: "an integer >= 1"
    check: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


TEXT = Kind("a non-empty string", lambda v: isinstance(v, str) and v != "")
NAME = Kind("a config name (a string)", lambda v: isinstance(v, str) and v != "")
# Names and descriptions are shown on terminals and in reports: no control or format characters
# (a description may hold newlines and tabs). Prompts are data for the model and may hold anything.
NAME_ALLOWED_CONTROLS, DESCRIPTION_ALLOWED_CONTROLS = "", "\n\t"
POSITIVE = Kind("an integer >= 1", lambda v: _is_int(v) and v >= 1)
NON_NEGATIVE = Kind("an integer >= 0", lambda v: _is_int(v) and v >= 0)
BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
TOKENS = Kind("a non-empty list of integers >= 1, e.g. [1, 16, 128]",
              lambda v: isinstance(v, list) and bool(v) and all(_is_int(x) and x >= 1 for x in v))
ARMS = Kind(f"a non-empty list of arms from {', '.join(SWEEP_ARMS)}",
            lambda v: isinstance(v, list) and bool(v) and all(x in SWEEP_ARMS for x in v))
MODE = Kind(f"one of {', '.join(flag_registry.FUSED_MASK_MODES)}", lambda v: v in flag_registry.FUSED_MASK_MODES)
VERDICT = Kind(f"one of {', '.join(dict.fromkeys(VERDICTS + DECODE_VERDICTS))}",
               lambda v: v in VERDICTS or v in DECODE_VERDICTS)
QUANT_VERDICT = Kind(f"one of {', '.join(QUANT_VERDICTS)}", lambda v: v in QUANT_VERDICTS)
DTYPE = Kind(f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES)


def _field(kind: Kind, default: Any = None, required: bool = False):
    if required:
        return field(metadata={"kind": kind, "required": True})
    return field(default=default, metadata={"kind": kind, "required": False})


# --------------------------------------------------------------------------------------------
# The format as dataclasses. Field order is the order keys are written in.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class PromptStep:
    """Generate at temperature 0 under `config` (default [flags]); with `compare`, also under it."""

    action = "prompt"
    prompt: str = _field(TEXT, required=True)
    max_tokens: int = _field(POSITIVE, 32)
    config: str | None = _field(NAME)
    compare: str | None = _field(NAME)
    expect_match: bool | None = _field(BOOLEAN)


@dataclass(frozen=True, kw_only=True)
class CompareStep:
    """The same prompt under configs `a` and `b`; with `b_model`, B runs on another model that shares the
    tokenizer (a preset, a checkpoint directory, or "source": what a trellis checkpoint was quantized from)."""

    action = "compare"
    prompt: str = _field(TEXT, required=True)
    max_tokens: int = _field(POSITIVE, 32)
    a: str = _field(NAME, required=True)
    b: str = _field(NAME, required=True)
    b_model: str | None = _field(TEXT)
    expect_match: bool | None = _field(BOOLEAN)


@dataclass(frozen=True, kw_only=True)
class CurveStep:
    """The uniform-routing tile-fill curve; k and experts default to the model's, tile_m to the flags'."""

    action = "curve"
    tokens: list[int] | None = _field(TOKENS)
    k: int | None = _field(POSITIVE)
    experts: int | None = _field(POSITIVE)
    tile_m: int | None = _field(POSITIVE)
    config: str | None = _field(NAME)


@dataclass(frozen=True, kw_only=True)
class SweepStep:
    """Time the MoE arms across widths on this GPU (writes the calibration `measured` reads)."""

    action = "sweep"
    tokens: list[int] = _field(TOKENS, required=True)
    arms: list[str] | None = _field(ARMS)
    config: str | None = _field(NAME)
    # a routing file (generate/bench --record-routing) whose recorded ids every arm is timed on too, per MoE
    # layer; a relative path is taken from the session file's directory (inspector.session_routing)
    routing: str | None = _field(TEXT)


@dataclass(frozen=True, kw_only=True)
class CheckAttentionStep:
    """Fused attention against the masked, causal and unmasked references; shapes default to the model's. With
    `mla = true` the latent check (`check-attention --mla`: the absorbed MLA kernel against the decompressed
    causal, last-position and no-RoPE references), its dims defaulting to the model's latent attention. With
    `decode = true` the decode check (`check-attention --decode`: the split-KV decode kernel over a cache of
    seq_len slots holding `batch` sequences, window and sinks defaulting to the model's; `window = 0` checks plain
    causal layers, e.g. gpt-oss's, whose model default is its sliding window)."""

    action = "check-attention"
    seq_len: int = _field(POSITIVE, required=True)
    # Every check launches its kernel by it (the latent check too: drop puts every query at the last position, so
    # it must say `unmasked`); honor by default, as `check-attention --mode` is.
    mode: str = _field(MODE, "honor")
    head_dim: int | None = _field(POSITIVE)
    heads: int | None = _field(POSITIVE)
    kv_heads: int | None = _field(POSITIVE)
    window: int | None = _field(NON_NEGATIVE)  # 0: plain causal (the decode check only)
    block: int | None = _field(POSITIVE)
    pad: int = _field(NON_NEGATIVE, 0)
    dtype: str | None = _field(DTYPE)
    expect: str | None = _field(VERDICT)
    mla: bool = _field(BOOLEAN, False)
    kv_lora_rank: int | None = _field(POSITIVE)
    rope_dim: int | None = _field(POSITIVE)
    nope_dim: int | None = _field(POSITIVE)
    v_dim: int | None = _field(POSITIVE)
    decode: bool = _field(BOOLEAN, False)
    batch: int | None = _field(POSITIVE)
    sinks: bool | None = _field(BOOLEAN)


@dataclass(frozen=True, kw_only=True)
class CheckQuantStep:
    """A trellis arm against the dequantized and the original experts of one layer (the session's model must
    be a trellis checkpoint); `expect` the verdict, e.g. dequantized. `layer` left out: the first MoE layer."""

    action = "check-quant"
    layer: int | None = _field(NON_NEGATIVE)
    tokens: list[int] | None = _field(TOKENS)
    arm: str | None = _field(TEXT)
    original: str | None = _field(TEXT)  # the unquantized model (default: the one config.json records)
    expect: str | None = _field(QUANT_VERDICT)


@dataclass(frozen=True, kw_only=True)
class BenchStep:
    """llama-bench rows (engine.bench) under `config`: a ppN row per prompt length and a tgN row per
    generated count, each at every batch size; `reps` timed repetitions after one warm-up. Token
    counts and launch counters are compared on replay; timings are shown, never compared."""

    action = "bench"
    pp: list[int] | None = _field(TOKENS)
    tg: list[int] | None = _field(TOKENS)
    batch: list[int] | None = _field(TOKENS)  # default [1]
    reps: int = _field(POSITIVE, 2)
    config: str | None = _field(NAME)


BENCH_TG_PROMPT = 32  # prompt tokens of each tg sequence, as `moe-inspector bench --tg-prompt`'s default
BENCH_DEFAULT_BATCH = (1,)

Step = PromptStep | CompareStep | CurveStep | SweepStep | CheckAttentionStep | CheckQuantStep | BenchStep
STEP_TYPES: dict[str, type] = {cls.action: cls for cls in
                               (PromptStep, CompareStep, CurveStep, SweepStep, CheckAttentionStep, CheckQuantStep,
                                BenchStep)}
ACTIONS = tuple(STEP_TYPES)


@dataclass(frozen=True)
class EngineSpec:
    model: str = "demo"  # a preset, or a checkpoint directory (a relative path is from the session file's directory)
    device: str = "auto"
    seed: int = 0
    weights: str = "auto"  # auto: shipped or the directory's files; random: random weights of the model's shape
    ep: int = 1  # ranks the experts are sharded over (engine.expert_parallel); `run` spawns them, 1 = one device


@dataclass(frozen=True)
class Config:
    name: str
    flags: Mapping[str, Any]  # validated overrides of [flags]


@dataclass(frozen=True)
class Session:
    name: str
    description: str | None = None
    engine: EngineSpec = EngineSpec()
    flags: Mapping[str, Any] = field(default_factory=dict)  # validated
    configs: tuple[Config, ...] = ()
    steps: tuple[Step, ...] = ()
    version: int = FORMAT_VERSION

    def config_names(self) -> list[str]:
        return [BASE] + [config.name for config in self.configs]

    def config_flags(self, name: str | None) -> dict[str, Any]:
        """[flags] overlaid with the named config's overrides (None or `base`: [flags] alone)."""
        merged = dict(self.flags)
        if name not in (None, BASE):
            merged.update(next(config.flags for config in self.configs if config.name == name))
        return merged


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

TABLES = ("session", "engine", "flags", "config", "step")
SESSION_KEYS = ("version", "name", "description")
ENGINE_KEYS = ("model", "device", "seed", "weights", "ep")


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _shown(value: Any) -> str:
    """A value from the file for a message: its repr, escaped and cut (a file may hold a megabyte)."""
    return printable(repr(value), limit=80)


def _wrong_type(where: str, key: str, expected: str, value: Any) -> UserError:
    return UserError(f"{where}: key {key!r} must be {expected}, got {_type_name(value)} ({_shown(value)})")


def _check_named(where: str, key: str, value: str, fix: str) -> None:
    """A key that names something (a model, a device): printable, and not blank (a blank path is a directory)."""
    _check_printable(where, key, value)
    if not value.strip():
        raise UserError(f"{where}: {key} is blank; {fix}")


def _check_printable(where: str, key: str, value: str, allowed: str = NAME_ALLOWED_CONTROLS) -> None:
    bad = unprintable_characters(value, allowed)
    if bad:
        shown = ", ".join(printable(character) for character in bad[:4])
        raise UserError(f"{where}: key {key!r} holds control or format characters ({shown}), which would reach "
                        f"terminals and reports raw; remove them")


def _too_large(where: str, key: str, value: Any, limit: int = MAX_INTEGER) -> None:
    """Integers (also inside lists) beyond `limit` in absolute value are refused."""
    values = value if isinstance(value, list) else [value]
    for item in values:
        if _is_int(item) and abs(item) > limit:
            raise UserError(f"{where}: key {key!r} is {_shown(item)}, beyond any size this reads (at most "
                            f"{limit}); give a realistic value")


def _did_you_mean(value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value)[:100], allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_keys(where: str, table: Mapping, allowed: tuple[str, ...]) -> None:
    for key in table:
        if key not in allowed:
            raise UserError(f"{where}: unknown key {_shown(key)}{_did_you_mean(key, allowed)}; allowed: "
                            f"{', '.join(allowed)}")


def _table(data: Mapping, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise UserError(f"{where}: {key!r} must be a table ([{key}]), got {_type_name(value)}")
    return value


def _parse_header(data: Mapping, where: str) -> tuple[int, str, str | None]:
    if "session" not in data:
        raise UserError(f"{where}: missing the [session] table; start the file with "
                        f"[session], version = {FORMAT_VERSION} and name = \"...\"")
    table = _table(data, "session", where)
    here = f"{where}: [session]"
    # The version first: a newer file may have keys this version does not know.
    if "version" not in table:
        raise UserError(f"{here}: missing key 'version'; add version = {FORMAT_VERSION}")
    version = table["version"]
    if not _is_int(version):
        raise _wrong_type(here, "version", "an integer", version)
    _too_large(here, "version", version)
    if version > FORMAT_VERSION:
        raise UserError(f"{here}: version {version} is newer than this moe-inspector reads (version "
                        f"{FORMAT_VERSION}); upgrade moe-inspector, or save the session again with this one")
    if version != FORMAT_VERSION:
        raise UserError(f"{here}: version {version} is not a session format version; use version = {FORMAT_VERSION}")
    _unknown_keys(here, table, SESSION_KEYS)
    if "name" not in table:
        raise UserError(f"{here}: missing key 'name'; add name = \"...\"")
    if not TEXT.check(table["name"]):
        raise _wrong_type(here, "name", TEXT.describe, table["name"])
    _check_printable(here, "name", table["name"])
    description = table.get("description")
    if description is not None and not isinstance(description, str):
        raise _wrong_type(here, "description", "a string", description)
    if description is not None:
        _check_printable(here, "description", description, DESCRIPTION_ALLOWED_CONTROLS)
    return version, table["name"], description


def _parse_engine(data: Mapping, where: str) -> EngineSpec:
    table = _table(data, "engine", where)
    here = f"{where}: [engine]"
    _unknown_keys(here, table, ENGINE_KEYS)
    for key in ("model", "device"):
        if key in table and not TEXT.check(table[key]):
            raise _wrong_type(here, key, TEXT.describe, table[key])
        if key in table:
            _check_named(here, key, table[key], "name a preset or a checkpoint directory (\"./\" for the session "
                         "file's own)" if key == "model" else "e.g. \"auto\"")
    if "seed" in table and not (_is_int(table["seed"]) and 0 <= table["seed"] <= MAX_SEED):
        raise _wrong_type(here, "seed", f"an integer from 0 to {MAX_SEED}", table["seed"])
    if "weights" in table and table["weights"] not in ("auto", "random"):
        raise UserError(f"{here}: weights {_shown(table['weights'])} is not allowed; allowed: auto, random")
    if "ep" in table:
        from engine.expert_parallel import parse_ep

        if not _is_int(table["ep"]):  # TOML gives an integer; "2" in quotes is a string, refused as one
            raise _wrong_type(here, "ep", "an integer from 1 to 64", table["ep"])
        table = {**table, "ep": parse_ep(table["ep"], f"{here}: ep")}
    return EngineSpec(**table)


def _parse_flags(data: Mapping, where: str) -> dict[str, Any]:
    table = _table(data, "flags", where)
    return {name: flag_registry.parse_value(name, value, f"{where} [flags]") for name, value in table.items()}


def _parse_configs(data: Mapping, where: str) -> tuple[Config, ...]:
    entries = data.get("config", [])
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise UserError(f"{where}: 'config' must be an array of tables ([[config]] with a name and flag "
                        f"overrides), got {_type_name(entries)}")
    configs: list[Config] = []
    for index, entry in enumerate(entries, start=1):
        here = f"{where}: config {index}"
        if "name" not in entry:
            raise UserError(f"{here}: missing key 'name'; add name = \"...\" so steps can refer to it")
        name = entry["name"]
        if not NAME.check(name):
            raise _wrong_type(here, "name", NAME.describe, name)
        _check_printable(here, "name", name)
        here = f"{where}: config {index} ({name!r})"
        if name == BASE:
            raise UserError(f"{here}: the name {BASE!r} is reserved for [flags] alone; rename the config")
        if any(config.name == name for config in configs):
            raise UserError(f"{here}: a config named {name!r} is already defined; config names must be unique")
        overrides = {}
        for key, value in entry.items():
            if key == "name":
                continue
            if key not in flag_registry.SPECS:
                allowed = ("name", *flag_registry.SPECS)
                raise UserError(f"{here}: unknown key {key!r}{_did_you_mean(key, allowed)}; allowed: "
                                f"{', '.join(allowed)}")
            overrides[key] = flag_registry.parse_value(key, value, here)
        configs.append(Config(name, overrides))
    return tuple(configs)


def step_keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _parse_step(entry: Mapping, index: int, where: str, config_names: list[str]) -> Step:
    here = f"{where}: step {index}"
    if "action" not in entry:
        raise UserError(f"{here}: missing key 'action'; one of {', '.join(ACTIONS)}")
    action = entry["action"]
    if not isinstance(action, str) or action not in STEP_TYPES:
        raise UserError(f"{here}: unknown action {_shown(action)}{_did_you_mean(action, ACTIONS)}; allowed: "
                        f"{', '.join(ACTIONS)}")
    cls = STEP_TYPES[action]
    here = f"{where}: step {index} ({action})"
    allowed = step_keys(cls)
    _unknown_keys(here, {key: value for key, value in entry.items() if key != "action"}, allowed)
    missing = [f"{spec.name!r} ({spec.metadata['kind'].describe})" for spec in dataclasses.fields(cls)
               if spec.metadata["required"] and spec.name not in entry]
    if missing:  # all of them at once, not one a run
        raise UserError(f"{here}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    values = {}
    for spec in dataclasses.fields(cls):
        kind = spec.metadata["kind"]
        if spec.name not in entry:
            continue
        value = entry[spec.name]
        _too_large(here, spec.name, value)
        if not kind.check(value):
            raise _wrong_type(here, spec.name, kind.describe, value)
        if kind is NAME and value not in config_names:
            raise UserError(f"{here}: key {spec.name!r} names config {_shown(value)}, which is not defined; "
                            f"defined: {', '.join(config_names)} (add a [[config]] with name = {_shown(value)})")
        values[spec.name] = list(value) if isinstance(value, list) else value
    step = cls(**values)
    if isinstance(step, BenchStep) and step.pp is None and step.tg is None:
        raise UserError(f"{here}: nothing to measure; add pp = [...] (prompt lengths) and/or tg = [...] "
                        f"(generated tokens), e.g. pp = [16, 64] and tg = [16]")
    if isinstance(step, CheckQuantStep) and step.original is not None:
        _check_named(here, "original", step.original, "name the unquantized model (a preset or a checkpoint "
                     "directory), or remove the key to use the one the checkpoint records")
    if isinstance(step, CompareStep) and step.b_model is not None:
        _check_named(here, "b_model", step.b_model, "name B's model (a preset, a checkpoint directory, or "
                     "\"source\"), or remove the key")
    if isinstance(step, PromptStep) and step.expect_match is not None and step.compare is None:
        raise UserError(f"{here}: expect_match checks two configurations against each other; add "
                        f"compare = \"<config name>\" or remove expect_match")
    return step


def parse_session(data: Mapping, where: str) -> Session:
    """A session from parsed TOML (plain dicts and lists); `where` names the source in errors."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: a session is a TOML document of tables, got {_type_name(data)}")
    version, name, description = _parse_header(data, where)
    for key in data:
        if key not in TABLES:
            what = "table" if isinstance(data[key], Mapping) or isinstance(data[key], list) else "top-level key"
            raise UserError(f"{where}: unknown {what} {printable(repr(key), 60)}; a session holds the tables "
                            f"{', '.join(TABLES)}")
    engine = _parse_engine(data, where)
    session_flags = _parse_flags(data, where)
    configs = _parse_configs(data, where)
    config_names = [BASE] + [config.name for config in configs]
    entries = data.get("step", [])
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise UserError(f"{where}: 'step' must be an array of tables ([[step]] with an action), "
                        f"got {_type_name(entries)}")
    if len(entries) > MAX_STEPS:
        raise UserError(f"{where}: {len(entries)} steps, more than the {MAX_STEPS} a session may hold; split it")
    steps = tuple(_parse_step(entry, index, where, config_names) for index, entry in enumerate(entries, start=1))
    return Session(name=name, description=description, engine=engine, flags=session_flags, configs=configs,
                   steps=steps, version=version)


def loads_session(text: str, where: str = "<session>") -> Session:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise UserError(f"{where}: not valid TOML: {error}; fix the syntax there") from None
    except RecursionError:  # arrays or inline tables nested hundreds deep
        raise UserError(f"{where}: not valid TOML here: arrays or inline tables nest deeper than this reader "
                        f"follows (Python's recursion limit); no session nests more than two levels") from None
    except ValueError as error:  # tomllib's int() of a number of thousands of digits
        raise UserError(f"{where}: not valid TOML here: {printable(str(error), 120)}; no number in a session is "
                        f"that long") from None
    return parse_session(data, where)


def load_session(path: str | os.PathLike) -> Session:
    path = Path(path)
    where = printable(str(path), limit=None)
    try:
        if path.exists() and not path.is_dir() and not path.is_file():  # a FIFO would block the read
            raise UserError(f"{where}: not a regular file (a device, a socket or a pipe); name a .toml file")
        with path.open("rb") as handle:  # at most one byte past the limit is read
            raw = handle.read(MAX_SESSION_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{where}: no such session file; check the path (examples live in sessions/)") from None
    except IsADirectoryError:
        raise UserError(f"{where}: is a directory, not a session file; name a .toml file") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        raise UserError(f"{where}: cannot read the session file ({getattr(error, 'strerror', None) or error})") from None
    if len(raw) > MAX_SESSION_BYTES:
        raise UserError(f"{where}: more than {MAX_SESSION_BYTES} bytes, more than a session file may hold; "
                        f"it is not read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where}: not valid TOML: not UTF-8 text (byte {error.start}); save it as UTF-8") from None
    if text.startswith("\ufeff"):  # TOML allows no byte-order mark; tomllib's message would point at column 1
        raise UserError(f"{where}: not valid TOML: the file starts with a byte-order mark (U+FEFF); save it as UTF-8 "
                        f"without one")
    return loads_session(text, where)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def step_to_plain(step: Step) -> dict[str, Any]:
    """A step as a TOML table: `action` first, then its keys in format order, unset keys left out."""
    plain: dict[str, Any] = {"action": step.action}
    for spec in dataclasses.fields(step):
        value = getattr(step, spec.name)
        if value is not None:
            plain[spec.name] = list(value) if isinstance(value, (list, tuple)) else value
    return plain


def _ordered_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    return {name: values[name] for name in flag_registry.SPECS if name in values}


def session_to_plain(session: Session) -> dict[str, Any]:
    header: dict[str, Any] = {"version": session.version, "name": session.name}
    if session.description:
        header["description"] = session.description
    engine = {"model": session.engine.model, "device": session.engine.device, "seed": session.engine.seed}
    if session.engine.weights != "auto":
        engine["weights"] = session.engine.weights
    if session.engine.ep != 1:
        engine["ep"] = session.engine.ep
    plain: dict[str, Any] = {"session": header, "engine": engine, "flags": _ordered_flags(session.flags)}
    if session.configs:
        plain["config"] = [config_to_plain(config) for config in session.configs]
    if session.steps:
        plain["step"] = [step_to_plain(step) for step in session.steps]
    return plain


def _literal(value: Any) -> str:
    try:
        import tomli_w
    except ModuleNotFoundError:
        raise UserError("writing a session needs tomli-w (pip install tomli-w); reading and running do not") from None
    if isinstance(value, list):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = "):-1]


def render_table(heading: str, values: Mapping[str, Any]) -> str:
    """`[heading]` or `[[heading]]` and one `key = literal` line per value (literals by tomli-w)."""
    lines = [heading] + [f"{key} = {_literal(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def config_to_plain(config: Config) -> dict[str, Any]:
    return {"name": config.name, **_ordered_flags(config.flags)}


def dumps_session(session: Session) -> str:
    """The session as TOML text, tables in format order ([session], [engine], [flags], every
    [[config]], every [[step]]) with short arrays on one line. Every literal is rendered by
    tomli-w; only the layout is ours (tomli-w would inline short [[config]] tables and put them
    first, and spread `tokens = [...]` over one line per number)."""
    table = render_table
    plain = session_to_plain(session)
    chunks = ["# A moe-inspector session: `moe-inspector run FILE` runs it, `moe-inspector replay FILE`\n"
              "# re-runs it and diffs against the recorded results.\n"]
    chunks += [table(f"[{name}]", plain[name]) for name in ("session", "engine", "flags")]
    chunks += [table(f"[[{name}]]", entry) for name in ("config", "step") for entry in plain.get(name, [])]
    return "\n".join(chunks)


def save_session(session: Session, path: str | os.PathLike) -> Path:
    path = Path(path)
    text = dumps_session(session)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    return path
