"""Every switch of a run: specs, validation, and the precedence rule.

Precedence: command line > session > environment (`MOEI_<FLAG>`) > default. A bad value on the
command line or in a session is a `UserError` naming the flag and its allowed values; a bad
environment value warns and keeps the default. Every run records the resolved value and where
it came from (results headers, bench footers, reports). Knows nothing of argparse or TOML:
callers pass strings or plain values.

Two kinds of flag: those that decide what a run computes (the MoE gate, the attention arm and
mask, the grouped variant and tile), and those that only change how fast it runs (run-ahead, PDL
and its preload, the carried norm, streamed weights, graphs of several steps): the second kind
gives the same tokens. The kernels take the launch switches through `launch_settings`
(kernels/ never imports engine/). `ENVIRONMENT_ONLY` lists the variables read outside this
registry and why each is not a flag.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from engine.errors import UserError
from engine.printable import printable
from kernels.settings import PRELOADERS, LaunchSettings

DEFAULT, ENVIRONMENT, SESSION, COMMAND_LINE = "default", "environment", "session", "command line"
SOURCES = (DEFAULT, ENVIRONMENT, SESSION, COMMAND_LINE)

# Keep in step with kernels/moe_grouped.py's TILE_M_CHOICES; a test asserts they are equal
# (the flags must import without triton, so the tuple cannot be imported from there).
TILE_M_CHOICES = (16, 32, 64)
GATE_NAMES = ("floor", "tile-fill", "measured", "gemv", "grouped", "reference", "dequant")
FUSED_MASK_MODES = ("honor", "decline", "drop")
LAYER_TIMINGS = ("profile", "events", "off")
L2_PREFETCH = ("off", "attention", "routing", "attention+routing")  # engine.l2_prefetch's windows


@dataclass(frozen=True)
class FlagSpec:
    name: str
    default: Any
    allowed: str  # for people: what values are accepted
    parse: Callable[[Any], Any]  # raises ValueError on a bad value
    kind: str  # "select", "int" or "bool": the widget that fits
    choices: tuple = ()
    help: str = ""


# A graph of that many decode steps is captured beside the one-step graph (engine.batch_runner): capture time
# and the graph's size grow with it, and the host's per-launch work stops mattering well before.
MAX_STEPS_PER_GRAPH = 64
# A routing record lives in host memory until the run ends (engine.routing_record): 64 GiB is more than any host
# here should give it (a 4096-token prefill of 60 MoE layers at top-8 takes 11.3 MiB: 6 bytes a pick, 6 a token).
MAX_ROUTING_CAP_MB = 65536


# A token count a flag holds (decode_floor, moe_max_tokens, prefill_chunk, threshold:N): int32, as the kernels' counts
# are; a larger one is a typo, and a session keeps integers within 2**53.
MAX_TOKENS = 2**31 - 1


# A count as a user types one: ASCII digits (\d and int() also take "٣", and int() takes "1_6")
_ASCII_COUNT = re.compile(r"\s*[+]?[0-9]+\s*")


def _parse_int(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            if not _ASCII_COUNT.fullmatch(value):
                raise ValueError
            value = int(value)
        if not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value
    return parse


def _parse_choice(choices: tuple, cast: Callable[[Any], Any] = str) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError
        if cast is int and isinstance(value, float):  # 16.7 is not 16: a wrong type, not a rounding
            raise ValueError
        if cast is int and isinstance(value, str) and not _ASCII_COUNT.fullmatch(value):
            raise ValueError
        try:
            value = cast(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError from None
        if value not in choices:
            raise ValueError
        return value
    return parse


def _parse_switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("on", "true", "1", "yes"):
            return True
        if lowered in ("off", "false", "0", "no"):
            return False
    raise ValueError


def _parse_preload(value: Any) -> str:
    """on / off, or the kernels that preload joined by + (or commas, as the environment may give them):
    kept in PRELOADERS order, all of them as on."""
    try:
        return "on" if _parse_switch(value) else "off"
    except ValueError:
        pass
    if not isinstance(value, str):
        raise ValueError
    names = {part.strip() for part in re.split(r"[+,]", value)}
    if not names or not names <= set(PRELOADERS):
        raise ValueError
    chosen = [name for name in PRELOADERS if name in names]
    return "on" if len(chosen) == len(PRELOADERS) else "+".join(chosen)


def _preload_choices() -> tuple[str, ...]:
    """on, off, then every proper non-empty subset of PRELOADERS, as `_parse_preload` writes them."""
    subsets = [[name for bit, name in enumerate(PRELOADERS) if mask >> bit & 1]
               for mask in range(1, 2 ** len(PRELOADERS) - 1)]
    return ("on", "off", *("+".join(subset) for subset in sorted(subsets, key=len)))


def _parse_gate(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    value = value.strip()
    if value in GATE_NAMES:
        return value
    match = re.fullmatch(r"threshold:([0-9]+)", value)  # ASCII digits: \d takes "٣" too
    if match and 1 <= int(match.group(1)) <= MAX_TOKENS:
        return f"threshold:{int(match.group(1))}"
    raise ValueError


SPECS: dict[str, FlagSpec] = {spec.name: spec for spec in (
    FlagSpec("moe_gate", "measured",
             "floor, tile-fill, threshold:N (N >= 1), measured, gemv, grouped, reference, dequant",
             _parse_gate, "select", GATE_NAMES + ("threshold:16",),
             "MoE arm policy; measured falls back to threshold:16 without a calibration"),
    FlagSpec("decode_floor", 8, "an integer >= 0 (at most 2**31-1)", _parse_int(0, MAX_TOKENS), "int",
             help="steps with n <= floor take the GEMV arm (adaptive policies)"),
    FlagSpec("moe_max_tokens", 0, "an integer >= 0 (0 = off; at most 2**31-1)", _parse_int(0, MAX_TOKENS), "int",
             help="pin GEMV for n <= value"),
    FlagSpec("grouped_variant", 2, "0, 1 or 2", _parse_choice((0, 1, 2), int), "select", (0, 1, 2),
             "grouped-GEMM variant; outputs are bit-identical"),
    FlagSpec("tile_m", 16, "16, 32 or 64", _parse_choice(TILE_M_CHOICES, int), "select", TILE_M_CHOICES,
             "grouped-GEMM m-tile rows"),
    FlagSpec("flash_512", True, "on or off", _parse_switch, "bool", (True, False),
             "fused sinks attention for head_dim-512 layers; off = unfused reference"),
    FlagSpec("fused_mask", "honor", "honor, decline or drop", _parse_choice(FUSED_MASK_MODES), "select",
             FUSED_MASK_MODES, "fused arm applies the mask / declines when one is present / ignores it"),
    FlagSpec("shared_fold", True, "on or off", _parse_switch, "bool", (True, False),
             "shared experts (DeepSeek) computed inside the routed GEMV arm's two launches at a one-row decode step "
             "(weight 1, the output rounded once: tokens may differ at a near tie); off = their own launches and an "
             "add after the arm"),
    FlagSpec("qkv_norm_fold", True, "on or off", _parse_switch, "bool", (True, False),
             "at a one-row decode step, each layer's attention RMSNorm (with its residual add) computed inside the "
             "q/k/v (or latent) GEMV instead of its own launch (the fp32 sums in another order: tokens may differ "
             "at a near tie); off = rms_norm, then the GEMV"),
    FlagSpec("prefill_chunk", 512, "an integer >= 16 (at most 2**31-1)", _parse_int(16, MAX_TOKENS), "int",
             help="prompt tokens per sequence per prefill step (chunked prefill in batched runs)"),
    FlagSpec("nonfinite_weights", "refuse", "refuse or allow", _parse_choice(("refuse", "allow")), "select",
             ("refuse", "allow"), "weights holding NaN or inf: refused at load (naming the tensor), or allowed for an "
             "experiment; read when weights load, so set it as MOEI_NONFINITE_WEIGHTS"),
    FlagSpec("steps_per_graph", 8, f"an integer from 1 to {MAX_STEPS_PER_GRAPH}", _parse_int(1, MAX_STEPS_PER_GRAPH),
             "int", help="decode steps one CUDA-graph launch runs when the scheduler can reserve them (batched runs)"),
    FlagSpec("mixed_steps", True, "on or off", _parse_switch, "bool", (True, False),
             "a step that prefills also carries the decoding sequences' tokens (phase mixed); off = decoders wait"),
    FlagSpec("layer_timing", "profile", "profile, events or off", _parse_choice(LAYER_TIMINGS), "select",
             LAYER_TIMINGS, "how a record's per-layer us are measured: profile = graphs on, replayed steps' kernels "
             "read from a CUPTI profile; events = graphs off, CUDA events around each call; off = none "
             "(the CPU's wall clock for profile and events)"),
    FlagSpec("run_ahead", True, "on or off", _parse_switch, "bool", (True, False),
             "launch a steady cohort's next graph replay before this step's sync (batched runs; timing only)"),
    FlagSpec("carry_norm", True, "on or off", _parse_switch, "bool", (True, False),
             "inside a graph of several steps, the LM head's pick norms the next step's first rows (timing only)"),
    FlagSpec("pdl", True, "on or off", _parse_switch, "bool", (True, False),
             "programmatic dependent launch of the decode kernels on Hopper GPUs (timing only)"),
    FlagSpec("pdl_preload", "on", f"on, off, or some of {', '.join(PRELOADERS)} joined by +", _parse_preload,
             "select", _preload_choices(),
             "with PDL, these kernels load their first weight tile before the wait (timing only)"),
    FlagSpec("stream_weights", True, "on or off", _parse_switch, "bool", (True, False),
             "streamed weights load with L2 evict_first, so the step's small data stays in L2 (timing only)"),
    FlagSpec("l2_prefetch", "off", "off, attention, routing or attention+routing", _parse_choice(L2_PREFETCH),
             "select", L2_PREFETCH,
             "at a one-row decode step, weights asked into L2 on a side stream while latency-bound kernels run: "
             "attention = the o projection's and the router's during attention, routing = the next layer's q/k/v "
             "during the router's fold (timing only; not latent-attention layers)"),
    FlagSpec("record_routing", False, "on or off", _parse_switch, "bool", (True, False),
             "keep every step's top-k expert ids and weights per MoE layer (copied to the host once per step, "
             "with the step's outputs); --record-routing FILE writes them (engine.routing_record)"),
    FlagSpec("routing_cap_mb", 256, f"an integer from 1 to {MAX_ROUTING_CAP_MB}", _parse_int(1, MAX_ROUTING_CAP_MB),
             "int", help="host memory (MiB) a run's routing record may hold: at the cap later steps are not "
                         "recorded, and the file says from which step"),
)}

# Variables read outside the registry, and why each is not a flag: each names a place (a file, a
# directory, a commit) or belongs to another tool; none is a choice of how a run computes.
ENVIRONMENT_ONLY = {
    "MOEI_CALIBRATION": "the calibration file moe_gate=measured reads and sweep writes: a path, not a "
                        "setting (every measured decision's reason names the crossover it read)",
    "MOEI_COMMIT": "the commit a results header names when the tree has no git (a copied checkout)",
    "MOEI_SESSION_DIR": "where the TUI autosaves sessions",
    "TRITON_INTERPRET": "Triton's own: run kernels in its CPU interpreter (the tests set it)",
    "WORLD_SIZE": "torchrun's own: how many ranks it started (engine.ep_launch checks it against --ep)",
    "RANK": "torchrun's own: which rank this process is (engine.ep_launch)",
    "LOCAL_RANK": "torchrun's own: which GPU of the host this rank takes (engine.ep_launch)",
}


# The flags `launch_settings` hands to the kernels (what a sweep, which times arms outside a run, records).
LAUNCH_FLAGS = ("pdl", "pdl_preload", "stream_weights")


def launch_settings(flags: "ResolvedFlags") -> LaunchSettings:
    """The kernels' launch switches these flags decide (kernels.settings)."""
    preload = flags["pdl_preload"]
    chosen = PRELOADERS if preload == "on" else () if preload == "off" else tuple(preload.split("+"))
    return LaunchSettings(pdl=flags["pdl"], pdl_preload=frozenset(chosen), stream_weights=flags["stream_weights"])


def format_value(name: str, value: Any) -> str:
    if SPECS[name].kind == "bool":
        return "on" if value else "off"
    return str(value)


def parse_value(name: str, value: Any, where: str) -> Any:
    """Validate one value; `where` names its origin for the error ("--set", "session.toml [flags]")."""
    if name not in SPECS:
        raise UserError(f"unknown flag {printable(repr(name), limit=80)} in {where}: flags are {', '.join(SPECS)}")
    spec = SPECS[name]
    try:
        return spec.parse(value)
    except ValueError:
        shown = printable(repr(value), limit=80)
        raise UserError(f"flag {name} in {where}: {shown} is not allowed; allowed: {spec.allowed}") from None


def parse_assignments(assignments: list[str], where: str = "--set") -> dict[str, Any]:
    """`["FLAG=VALUE", ...]` to validated values (a comma list goes through engine.comma_list.parse_flag_list,
    which refuses its empty items); one flag with two values is refused."""
    if isinstance(assignments, str):
        raise TypeError("parse_assignments takes a list of FLAG=VALUE; split a comma list with engine.comma_list")
    values: dict[str, Any] = {}
    for assignment in assignments:
        name, separator, value = assignment.partition("=")
        name = name.strip()
        if not separator or not name:
            raise UserError(f"{where}: {assignment!r} is not FLAG=VALUE (flags: {', '.join(SPECS)})")
        parsed = parse_value(name, value, where)
        if name in values and values[name] != parsed:  # the last silently winning would run another A/B
            raise UserError(f"{where}: {name} given twice ({values[name]!r} and {parsed!r}): give one")
        values[name] = parsed
    return values


@dataclass(frozen=True)
class ResolvedFlags:
    """Every flag's value and where it came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def with_overrides(self, overrides: Mapping[str, Any], source: str) -> "ResolvedFlags":
        """A copy with already-validated values set from `source`."""
        values, sources = dict(self.values), dict(self.sources)
        for name, value in overrides.items():
            values[name] = value
            sources[name] = source
        return ResolvedFlags(values, sources)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": self.values[name], "source": self.sources[name]} for name in SPECS}

    def entry(self, name: str) -> str:
        """`name=value`, followed by its source where it is not the default: `moe_gate=grouped (command line)`."""
        shown = f"{name}={format_value(name, self.values[name])}"
        return shown if self.sources[name] == DEFAULT else f"{shown} ({self.sources[name]})"

    def describe(self) -> str:
        """Every flag's `entry`: a footer says what was set and where, as the headers' JSON does."""
        return ", ".join(self.entry(name) for name in SPECS)


def environment_name(name: str) -> str:
    """The environment variable that sets flag `name`."""
    return f"MOEI_{name.upper()}"


def _read_environment(environ: Mapping[str, str]) -> tuple[dict, dict, list[str]]:
    """(values, sources, problems): defaults overlaid with the valid `MOEI_<FLAG>` values, and one
    line per value that is not allowed (that flag keeps its default)."""
    values = {name: spec.default for name, spec in SPECS.items()}
    sources = {name: DEFAULT for name in SPECS}
    problems = []
    for name, spec in SPECS.items():
        variable = environment_name(name)
        if variable not in environ:
            continue
        try:
            values[name] = spec.parse(environ[variable])
            sources[name] = ENVIRONMENT
        except ValueError:
            problems.append(f"{variable}={environ[variable]!r} is not allowed ({spec.allowed}); "
                            f"keeping the default {format_value(name, spec.default)}")
    return values, sources, problems


def environment_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per `MOEI_<FLAG>` value that is not allowed: what the TUI shows as notes."""
    return _read_environment(os.environ if environ is None else environ)[2]


_WARNED: set[str] = set()  # each bad environment value is reported once per process, however often it is read


def _warn_once(message: str) -> None:
    """One line on stderr, not Python's warnings (their two-line form names this file and line)."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"moe-inspector: warning: {message}", file=sys.stderr, flush=True)


def from_environment(environ: Mapping[str, str] | None = None) -> ResolvedFlags:
    """Defaults overlaid with valid `MOEI_<FLAG>` values; a bad one warns (one line on stderr, once per
    process) and keeps the default."""
    values, sources, problems = _read_environment(os.environ if environ is None else environ)
    for problem in problems:
        _warn_once(problem)
    return ResolvedFlags(values, sources)


def resolve(command_line: list[str] | None = None, session: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None, session_where: str = "session [flags]") -> ResolvedFlags:
    """Default < environment < session < command line."""
    resolved = from_environment(environ)
    if session:
        resolved = resolved.with_overrides(
            {name: parse_value(name, value, session_where) for name, value in session.items()}, SESSION)
    if command_line:
        resolved = resolved.with_overrides(parse_assignments(command_line), COMMAND_LINE)
    return resolved
