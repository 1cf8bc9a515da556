"""Dispatch flags: specs, validation, and the precedence rule.

Precedence: command line > session > environment (`MOEI_<FLAG>`) > default. A bad value on the
command line or in a session is a `UserError` naming the flag and its allowed values; a bad
environment value warns and keeps the default. Every run records the resolved value and where
it came from. Knows nothing of argparse or TOML: callers pass strings or plain values.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from engine.errors import UserError

DEFAULT, ENVIRONMENT, SESSION, COMMAND_LINE = "default", "environment", "session", "command line"
SOURCES = (DEFAULT, ENVIRONMENT, SESSION, COMMAND_LINE)

# Keep in step with kernels/moe_grouped.py's TILE_M_CHOICES; a test asserts they are equal
# (the flags must import without triton, so the tuple cannot be imported from there).
TILE_M_CHOICES = (16, 32, 64)
GATE_NAMES = ("floor", "tile-fill", "measured", "gemv", "grouped", "reference", "dequant")
FUSED_MASK_MODES = ("honor", "decline", "drop")
LAYER_TIMINGS = ("profile", "events", "off")


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


def _parse_int(minimum: int, maximum: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str):
            if not re.fullmatch(r"\s*[+]?\d+\s*", value):
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
        try:
            value = cast(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
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


def _parse_gate(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    value = value.strip()
    if value in GATE_NAMES:
        return value
    match = re.fullmatch(r"threshold:(\d+)", value)
    if match and int(match.group(1)) >= 1:
        return f"threshold:{int(match.group(1))}"
    raise ValueError


SPECS: dict[str, FlagSpec] = {spec.name: spec for spec in (
    FlagSpec("moe_gate", "measured",
             "floor, tile-fill, threshold:N (N >= 1), measured, gemv, grouped, reference, dequant",
             _parse_gate, "select", GATE_NAMES + ("threshold:16",),
             "MoE arm policy; measured falls back to threshold:16 without a calibration"),
    FlagSpec("decode_floor", 8, "an integer >= 0", _parse_int(0), "int",
             help="steps with n <= floor take the GEMV arm (adaptive policies)"),
    FlagSpec("moe_max_tokens", 0, "an integer >= 0 (0 = off)", _parse_int(0), "int",
             help="pin GEMV for n <= value"),
    FlagSpec("grouped_variant", 2, "0, 1 or 2", _parse_choice((0, 1, 2), int), "select", (0, 1, 2),
             "grouped-GEMM variant; outputs are bit-identical"),
    FlagSpec("tile_m", 16, "16, 32 or 64", _parse_choice(TILE_M_CHOICES, int), "select", TILE_M_CHOICES,
             "grouped-GEMM m-tile rows"),
    FlagSpec("flash_512", True, "on or off", _parse_switch, "bool", (True, False),
             "fused sinks attention for head_dim-512 layers; off = unfused reference"),
    FlagSpec("fused_mask", "honor", "honor, decline or drop", _parse_choice(FUSED_MASK_MODES), "select",
             FUSED_MASK_MODES, "fused arm applies the mask / declines when one is present / ignores it"),
    FlagSpec("prefill_chunk", 512, "an integer >= 16", _parse_int(16), "int",
             help="prompt tokens per sequence per prefill step (chunked prefill in batched runs)"),
    FlagSpec("steps_per_graph", 8, f"an integer from 1 to {MAX_STEPS_PER_GRAPH}", _parse_int(1, MAX_STEPS_PER_GRAPH),
             "int", help="decode steps one CUDA-graph launch runs when the scheduler can reserve them (batched runs)"),
    FlagSpec("mixed_steps", True, "on or off", _parse_switch, "bool", (True, False),
             "a step that prefills also carries the decoding sequences' tokens (phase mixed); off = decoders wait"),
    FlagSpec("layer_timing", "profile", "profile, events or off", _parse_choice(LAYER_TIMINGS), "select",
             LAYER_TIMINGS, "how a record's per-layer us are measured: profile = graphs on, replayed steps' kernels "
             "read from a CUPTI profile; events = graphs off, CUDA events around each call; off = none "
             "(the CPU's wall clock for profile and events)"),
)}


def format_value(name: str, value: Any) -> str:
    if SPECS[name].kind == "bool":
        return "on" if value else "off"
    return str(value)


def parse_value(name: str, value: Any, where: str) -> Any:
    """Validate one value; `where` names its origin for the error ("--set", "session.toml [flags]")."""
    if name not in SPECS:
        raise UserError(f"unknown flag {name!r} in {where}: flags are {', '.join(SPECS)}")
    spec = SPECS[name]
    try:
        return spec.parse(value)
    except ValueError:
        raise UserError(f"flag {name} in {where}: {value!r} is not allowed; allowed: {spec.allowed}") from None


def parse_assignments(assignments: list[str] | str, where: str = "--set") -> dict[str, Any]:
    """`["FLAG=VALUE", ...]` or `"FLAG=VALUE,FLAG=VALUE"` to validated values."""
    if isinstance(assignments, str):
        assignments = [part for part in assignments.split(",") if part.strip()]
    values: dict[str, Any] = {}
    for assignment in assignments:
        name, separator, value = assignment.partition("=")
        name = name.strip()
        if not separator or not name:
            raise UserError(f"{where}: {assignment!r} is not FLAG=VALUE (flags: {', '.join(SPECS)})")
        values[name] = parse_value(name, value, where)
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

    def describe(self) -> str:
        return ", ".join(f"{name}={format_value(name, self.values[name])}" for name in SPECS)


def from_environment(environ: Mapping[str, str] | None = None) -> ResolvedFlags:
    """Defaults overlaid with valid `MOEI_<FLAG>` values; a bad one warns and keeps the default."""
    environ = os.environ if environ is None else environ
    values = {name: spec.default for name, spec in SPECS.items()}
    sources = {name: DEFAULT for name in SPECS}
    for name, spec in SPECS.items():
        variable = f"MOEI_{name.upper()}"
        if variable not in environ:
            continue
        try:
            values[name] = spec.parse(environ[variable])
            sources[name] = ENVIRONMENT
        except ValueError:
            warnings.warn(f"{variable}={environ[variable]!r} is not allowed ({spec.allowed}); "
                          f"keeping the default {format_value(name, spec.default)}", stacklevel=2)
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
