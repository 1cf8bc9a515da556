"""The shape a results line must have before replay, the TUI or a report reads it.

A results file is JSON lines that anyone may have edited, truncated or forged. `check_header` and
`check_step` compare each line with the structure `moe-inspector run` writes (the keys the readers
index: diff_step, check_replayable, render_replay, the TUI's replay screen), so a line with a
missing key or a wrong type is one UserError naming the file, the line and the key, never a
KeyError half-way through a diff. Strings the reports print (the header's session name, device,
commit) must hold no control characters. Keys beyond these are allowed (newer writers add some).

Plain functions over decoded JSON; knows nothing of how the results were made.
"""

from __future__ import annotations

from typing import Any

from engine.errors import UserError
from engine.printable import printable, unprintable_characters

# A spec is a type name, a dict of {key: spec} (a key ending in "?" may be missing or null, in "~"
# missing but not null: readers test `key in line` and then index it, in "*" null but not missing:
# readers index it and then test for None), a one-element list [spec]
# (every item), or ("map", spec) (an object whose every value matches spec).
INT, NUMBER, TEXT, BOOL, ANY = "int", "number", "text", "bool", "any"
MAP_OF_INTS = ("map", INT)  # {name: int}

COUNTERS = {"arms?": MAP_OF_INTS, "kernels?": MAP_OF_INTS}
DECISION = {
    "step": INT, "layer": INT, "phase": TEXT, "n_tokens": INT,
    "moe~": {"decided": TEXT, "executed": TEXT, "variant?": INT, "shared_path?": TEXT, "shared_reason?": TEXT},
    "attention~": {"decided": TEXT, "executed": TEXT, "mask": TEXT, "applied_mask": TEXT},
}
RUN = {
    "config": TEXT, "flags": ("map", ANY), "prompt_tokens": INT, "tokens": [INT], "text": TEXT,
    "decisions": [DECISION], "counters": COUNTERS, "reasons?": [TEXT], "notes?": [TEXT],
    "timings": {"wall_s": NUMBER},
}
MEAN_STD = {"mean": NUMBER, "std": NUMBER}
BENCH_ROW = {"test": TEXT, "tps_wall?": MEAN_STD, "tps_device?": MEAN_STD, "ttft_ms": MEAN_STD, "state?": ANY,
             "counters?": {"arms?": MAP_OF_INTS, "kernels?": MAP_OF_INTS}}
CURVE_ROW = {"n": NUMBER, "woken": NUMBER, "pairs_per_woken": NUMBER, "fill": NUMBER, "amortizes": BOOL}
# The numbers of each action, as far as the reports and the diff read them.
NUMBERS = {
    "curve": {"k": NUMBER, "experts": NUMBER, "tile_m": NUMBER, "min_tokens": NUMBER, "rows": [CURVE_ROW]},
    "bench": {"rows?": [BENCH_ROW]},
    "sweep": {"rows?": [("map", ANY)]},
    "check-attention": {"verdict?": ANY, "sentence?": ANY, "dtype?": ANY},
}
DEFINITIONS = {"check-attention": {"mode": ANY, "seq_len": ANY}}
STEP = {
    "kind": TEXT, "step": INT, "action": TEXT, "definition": ("map", ANY), "status": TEXT,
    "runs": [RUN], "numbers": ("map", ANY), "check*": {"expect": ANY, "held": BOOL, "detail": TEXT},
    "wall_s": NUMBER,
}
HEADER = {
    "kind": TEXT, "schema": INT, "session?": TEXT, "session_file?": TEXT, "device?": TEXT, "device_spec?": TEXT,
    "model?": TEXT, "seed?": INT, "weights?": TEXT, "commit?": TEXT, "package_version?": TEXT, "torch?": TEXT,
    "triton?": TEXT, "python?": TEXT, "started_at?": TEXT, "ep?": INT,
    "flags?": ("map", {"value": ANY, "source": TEXT}), "configs?": ("map", ("map", ANY)),
}
PRINTED_HEADER_KEYS = ("session", "session_file", "device", "device_spec", "model", "weights", "commit",
                       "package_version", "torch", "triton", "python", "started_at")


_WORDS = {INT: "an integer", NUMBER: "a number", TEXT: "a string", BOOL: "true or false"}


def _type_ok(value: Any, spec: str) -> bool:
    if spec == ANY:
        return True
    if spec == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec == TEXT:
        return isinstance(value, str)
    if spec == BOOL:
        return isinstance(value, bool)
    raise AssertionError(spec)


def _problem(value: Any, spec, path: str) -> str | None:
    """Where `value` departs from `spec`, in words, or None."""
    if isinstance(spec, str):
        return None if _type_ok(value, spec) else f"{path} must be {_WORDS[spec]}"
    if isinstance(spec, tuple) and spec[0] == "map":
        if not isinstance(value, dict):
            return f"{path} must be an object"
        for key, item in value.items():
            problem = _problem(item, spec[1], f"{path}.{key}")
            if problem:
                return problem
        return None
    if isinstance(spec, list):
        if not isinstance(value, list):
            return f"{path} must be an array"
        for index, item in enumerate(value):
            problem = _problem(item, spec[0], f"{path}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{path} must be an object"
        for key, item_spec in spec.items():
            nullable, optional = key.endswith(("?", "*")), key.endswith(("?", "~"))
            name = key.rstrip("?~*")
            if name not in value:
                if optional:
                    continue
                return f"{path}.{name} is missing"
            if nullable and value[name] is None:
                continue
            problem = _problem(value[name], item_spec, f"{path}.{name}")
            if problem:
                return problem
        return None
    raise AssertionError(spec)


def _refuse(where: str, problem: str) -> UserError:
    return UserError(f"{where}: {printable(problem, 160)}: the results file is corrupt or was edited; run the "
                     f"session again to re-record")


def check_header(header: dict, where: str) -> None:
    problem = _problem(header, HEADER, "the header")
    if problem:
        raise _refuse(where, problem)
    for key in PRINTED_HEADER_KEYS:
        value = header.get(key)
        if isinstance(value, str) and unprintable_characters(value):
            raise _refuse(where, f"the header's {key} holds control characters")


def check_step(line: dict, where: str) -> None:
    problem = _problem(line, STEP, "the step")
    if problem:
        raise _refuse(where, problem)
    for spec, value, name in ((NUMBERS.get(line["action"]), line["numbers"], "the step.numbers"),
                              (DEFINITIONS.get(line["action"]), line["definition"], "the step.definition")):
        problem = None if spec is None else _problem(value, spec, name)
        if problem:
            raise _refuse(where, problem)
