"""Run a session's steps headless, write its results file, and diff a re-run against it.

Results file (JSON lines, `x.toml` -> `x.results.jsonl`): a header line

    {"kind": "header", "schema": 1, "package_version", "commit", "commit_dirty", "python", "torch",
     "triton", "cpu_threads", "device", "device_spec", "model", "seed", "flags": {name: {value, source}},
     "configs": {name: overrides}, "session", "session_file", "started_at"}

then one line per step, in order:

    {"kind": "step", "step": 1, "action", "definition": {the step as written}, "status": "ok" or
     "check failed", "runs": [per configuration: config, flags, prompt_tokens, tokens, text,
     decisions (per generated step per layer: phase, n_tokens, moe decided/executed/variant and, for
     a layer with shared experts, shared_path/shared_reason, attention decided/executed/mask/applied_mask),
     counters, reasons (each distinct decision reason once), notes (why an executed arm differs from the decided
     one), timings],
     "numbers": {...},
     "check": {"expect", "held", "detail"} or null, "wall_s"}

A bench step's numbers are engine.bench's JSON report (rows, targets, footer); replay compares
its rows' token counts, state and launch counters, never its rates.

Before anything runs, `preflight` checks what can be known without running (model, device,
prompt lengths, GPU-only steps) so a bad session fails in a second with exit 2 rather than
half-way. Each kind of step's preflight, run and results line is its action's, in
inspector.session_steps (the TUI records the same lines). Timings are recorded, never diffed.

Knows nothing of argument parsing or report layout.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine import flags as flag_registry
from engine.bounded_read import read_regular
from engine.config import PRESETS, ModelConfig
from engine.errors import UserError
from engine.json_input import parse_json
from engine.printable import path_error, printable
from inspector import results_schema
from engine.provenance import commit_and_dirty
from inspector.session import CheckQuantStep, CompareStep, Session, Step, atomic_write_text, step_to_plain
from inspector.session_steps import (CHECK_FAILED, OK, RunContext, action_for, base_flags, make_context,  # noqa: F401
                                     plan_b_model, preflight_b_model, preflight_check_quant, session_directory,
                                     token_at)

RESULTS_SCHEMA = 1
MAX_RESULTS_BYTES = 256 * 1024 * 1024
REPOSITORY = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# Paths and the environment header
# --------------------------------------------------------------------------------------------

def results_path_for(session_path: str | os.PathLike, explicit: str | os.PathLike | None = None) -> Path:
    """`x.toml` -> `x.results.jsonl` beside it, unless a path is given."""
    if explicit:
        return Path(explicit)
    path = Path(session_path)
    stem = path.name[:-len(".toml")] if path.name.endswith(".toml") else path.name
    return path.with_name(f"{stem}.results.jsonl")


def package_version() -> str:
    try:
        return importlib.metadata.version("moe-inspector")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a source checkout that was never installed
        from inspector.session import tomllib
        return tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


def git_commit() -> tuple[str | None, bool]:
    """(HEAD of the checkout this package runs from, whether tracked files differ from it)."""
    return commit_and_dirty()


def triton_version() -> str | None:
    try:  # the metadata, not `import triton`, which is slow and absent on some CPU machines
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_header(session: Session, where: str, device_label: str, device_spec: str,
                       base_flags: flag_registry.ResolvedFlags, weights: str | None = None,
                       checkpoint: dict | None = None, expert_parallel: dict | None = None) -> dict:
    import torch

    commit, dirty = git_commit()
    return {
        "kind": "header", "schema": RESULTS_SCHEMA, "session": session.name, "session_file": where,
        "package_version": package_version(), "commit": commit, "commit_dirty": dirty,
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version(),
        "cpu_threads": torch.get_num_threads(),
        "device": device_label, "device_spec": device_spec, "model": session.engine.model,
        "seed": session.engine.seed, "weights": weights, "flags": base_flags.to_json(),
        **({"checkpoint": checkpoint} if checkpoint else {}),
        **({"ep": expert_parallel["ep"], "expert_parallel": expert_parallel} if expert_parallel else {}),
        "configs": {config.name: dict(config.flags) for config in session.configs},
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def same_weights(recorded: dict, now: dict) -> bool:
    """Whether two results headers ran the same weights. A checkpoint directory's are its provenance (family,
    config.json's hash, the weight files or the random seed), wherever it lies and however its path was spelled
    (the TUI names it as started, a session file from its own directory); else the weights' descriptions."""
    return weights_difference(recorded, now) is None


def _weights_words(source) -> str:
    if not isinstance(source, dict):
        return f"weights {printable(repr(source), 60)}"
    if source.get("source") == "random":
        return printable(f"random weights, seed {source.get('seed')}, drawn on the {source.get('drawn_on')}", 120)
    files = _files_by_name(source)
    return printable("weight files " + (", ".join(f"{name} ({entry.get('bytes')} bytes)"
                                                  for name, entry in files.items()) or "(none)"), 200)


def _files_by_name(source) -> dict:
    from engine.model_source import files_by_name  # torch: not at import, where `flags` and `--help` start

    return files_by_name(source.get("files") if isinstance(source, dict) else None)


def _same_weight_source(old, new) -> bool:
    """Two checkpoints' weight sources (engine.model_source.describe_checkpoint's `weights`) are the same: random
    with the same seed, or the same files by name and size, and by `sample_sha256` where both recorded one (a
    recording made before it was kept compares by name and size alone)."""
    if not (isinstance(old, dict) and isinstance(new, dict)) or old.get("source") != new.get("source"):
        return old == new
    if old.get("source") != "files":
        return old == new
    then, now = _files_by_name(old), _files_by_name(new)
    if set(then) != set(now):
        return False
    for name, entry in then.items():
        sampled = "sample_sha256" in entry and "sample_sha256" in now[name]
        if entry.get("bytes") != now[name].get("bytes") or (
                sampled and entry["sample_sha256"] != now[name]["sample_sha256"]):
            return False
    return True


def _changed_in_place(old, new) -> str | None:
    """The first file whose name and size are the same but whose sampled bytes differ, else None."""
    then, now = _files_by_name(old), _files_by_name(new)
    for name in sorted(set(then) & set(now)):
        recorded, current = then[name].get("sample_sha256"), now[name].get("sample_sha256")
        if then[name].get("bytes") == now[name].get("bytes") and None not in (recorded, current) \
                and recorded != current:
            return name
    return None


def weights_difference(recorded: dict, now: dict) -> str | None:
    """What differs between the weights two results headers (or `Engine.provenance_before_load`'s pair, as
    {"weights", "checkpoint"}) ran, in a few words naming the first field that differs; None when they are the same
    weights (by `same_weights`' rule: a checkpoint's path may differ)."""
    old, new = recorded.get("checkpoint"), now.get("checkpoint")
    if isinstance(old, dict) and isinstance(new, dict):
        for key, label in (("family", "family"), ("config_sha256", "config.json sha256")):
            if old.get(key) != new.get(key):
                return f"{label} {old.get(key)}, the checkpoint now has {new.get(key)}"
        if not _same_weight_source(old.get("weights"), new.get("weights")):
            changed = _changed_in_place(old.get("weights"), new.get("weights"))
            if changed:
                return f"other bytes in {changed} (the same name and size: a checkpoint changed in place)"
            return (f"{_weights_words(old.get('weights') or {})}, the checkpoint now has "
                    f"{_weights_words(new.get('weights') or {})}")
        if {k: v for k, v in old.items() if k not in ("path", "weights")} != {
                k: v for k, v in new.items() if k not in ("path", "weights")}:
            return f"checkpoint {old}, now {new}"
        return None
    if now.get("weights") is None:  # a directory's words, unknown before loading: the re-run's header tells
        return None
    if recorded.get("weights") != now.get("weights"):
        return f"weights {recorded.get('weights')!r}, the model now loads {now.get('weights')!r}"
    return None


# --------------------------------------------------------------------------------------------
# Preflight: everything knowable before running
# --------------------------------------------------------------------------------------------

def preflight_step(where: str, index: int, step: Step, model: ModelConfig, device) -> None:
    """What can be known about one step before running it (its action's preflight); raises UserError. A step's
    routing file (a sweep's input, inspector.session_routing) first: a bad one is wrong on any machine."""
    from inspector import session_routing

    here = f"{where}: step {index} ({step.action})"
    session_routing.preflight(here, step, where, model)
    action_for(step).preflight(here, step, model, device)


def preflight(session: Session, where: str, device_name: str) -> tuple[ModelConfig, Any]:
    """The model and torch device, after checking every step can run here; raises UserError."""
    from engine.model_source import not_a_directory
    from engine.runtime import PRESETS, model_config, resolve_device, resolve_model_path

    name = session.engine.model
    path = None if name in PRESETS else resolve_model_path(name, session_directory(where))
    try:
        is_dir = path is None or path.is_dir()
    except OSError as error:  # a name the system refuses (too long, a loop)
        raise UserError(f"{where}: [engine] model: {path_error(error)}") from None
    if not is_dir:
        if "/" in name or os.sep in name or name.startswith("."):  # written as a path
            raise UserError(f"{where}: [engine] model: {path} {not_a_directory(path)} (a relative path is taken from "
                            f"the session file's directory): was the checkpoint moved? Fix the path in [engine] model")
        raise UserError(f"{where}: [engine] model: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                        f"directory beside the session file ({path}): was the checkpoint moved? Fix the path in "
                        f"[engine] model")
    try:
        model = model_config(name, session_directory(where))
    except UserError as error:
        raise UserError(f"{where}: [engine] model: {error}") from None
    try:
        device = resolve_device(device_name)
    except UserError as error:
        source = f"{where}: [engine] device" if device_name == session.engine.device else "--device"
        raise UserError(f"{source}: {error}") from None
    from engine.model_source import check_fits
    from engine.runtime import Engine

    check_fits(model, device, Engine.dtype_for(device), f"{where}: [engine] model {printable(name)}",
               "use a smaller model, or a device with more memory (--device), or free memory")
    for index, step in enumerate(session.steps, start=1):
        here = f"{where}: step {index} ({step.action})"
        try:
            preflight_step(where, index, step, model, device)
            if isinstance(step, CompareStep) and step.b_model is not None:
                preflight_b_model(session, where, here, step)
            if isinstance(step, CheckQuantStep):
                preflight_check_quant(session, where, here, step)
        except OSError as error:  # a path key the system refuses (too long, a loop): the step that named it
            if error.filename is None:
                raise
            raise UserError(f"{here}: {path_error(error)}") from None
    return model, device


# --------------------------------------------------------------------------------------------
# Running steps
# --------------------------------------------------------------------------------------------

def run_step(context: RunContext, index: int, step: Step) -> dict:
    """One step's result line: its action's run, then its result line (inspector.session_steps), with the
    step's wall time."""
    action = action_for(step)
    started = time.perf_counter()
    outcome = action.run(context, step)
    outcome["wall_s"] = time.perf_counter() - started
    return action.result(context, index, step, outcome)


@dataclass
class RunOutcome:
    header: dict
    steps: list[dict] = field(default_factory=list)
    cancelled: bool = False  # stopped (Ctrl-C) before every chosen step ran: `steps` holds the finished ones

    @property
    def failed_checks(self) -> list[dict]:
        return [step for step in self.steps if step["status"] == CHECK_FAILED]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed_checks else 0


def run_session(session: Session, where: str, device: str | None = None,
                progress: Callable[[int, int, Step, dict | None], None] | None = None,
                only_steps: list[int] | None = None, trace=None,
                cancel: threading.Event | None = None, group=None) -> RunOutcome:
    """Run every step (or the 1-based `only_steps`) on `device` (default: the session's); `trace` (an
    engine.trace.Trace) receives the steps of every generation and bench row; once `cancel` is set, no
    further step starts (the outcome says `cancelled`). `group`: this rank's engine.expert_parallel.ExpertGroup
    when the session's [engine] ep > 1 (inspector.commands.run spawns the ranks); every rank runs every step."""
    from engine.runtime import Engine

    model, torch_device = preflight(session, where, device or session.engine.device)
    base = base_flags(session)
    # The same weights the TUI and `generate` use: a preset's shipped checkpoint where it has one.
    if group is not None:
        from engine import ep_launch

        torch_device = ep_launch.rank_device(str(torch_device), group.rank)
    elif session.engine.ep > 1:
        raise UserError(f"{where}: [engine] ep = {session.engine.ep}: only `moe-inspector run {shlex.quote(where)}` spawns the "
                        f"ranks (replay and the TUI run one device)")
    engine = Engine.load(session.engine.model, str(torch_device), session.engine.seed, session.engine.weights,
                         base=session_directory(where))
    if group is not None:
        from engine import expert_parallel

        expert_parallel.shard(engine, group)
    outcome = RunOutcome(environment_header(session, where, engine.device_label, str(engine.device), base,
                                            engine.weights_source, engine.checkpoint,
                                            engine.expert_parallel_summary() if group is not None else None))
    context = RunContext(session, where, engine, base, trace=trace)
    if trace is not None:
        from engine.trace import enable_nvtx

        enable_nvtx(engine.device)
    chosen = [(index, step) for index, step in enumerate(session.steps, start=1)
              if only_steps is None or index in only_steps]
    for index, step in chosen:
        if cancel is not None and cancel.is_set():
            outcome.cancelled = True
            break
        if progress is not None:
            progress(index, len(session.steps), step, None)
        result = run_step(context, index, step)
        outcome.steps.append(result)
        if progress is not None:
            progress(index, len(session.steps), step, result)
    return outcome


# --------------------------------------------------------------------------------------------
# The results file
# --------------------------------------------------------------------------------------------

def dumps_results(header: dict, steps: list[dict]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in [header, *steps])


def write_results(path: str | os.PathLike, header: dict, steps: list[dict]) -> Path:
    path = Path(path)
    atomic_write_text(path, dumps_results(header, steps))
    return path


def recorded_session(path: str | os.PathLike) -> str | None:
    """The session name a results file records, "" for a header without one; None where `path` is no results file
    (missing, not a regular file, unreadable, or a first line that is not a results header). Reads one line, at
    most 64 KB: a check before a write, not a validation."""
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None
            first = handle.readline(65536)
        header = json.loads(first.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict) or header.get("kind") != "header" or "schema" not in header:
        return None
    name = header.get("session")
    return name if isinstance(name, str) else ""


def read_results(path: str | os.PathLike, session_path: str) -> tuple[dict, list[dict]]:
    path = Path(path)
    try:
        text = read_regular(path, MAX_RESULTS_BYTES, str(path), "give the .results.jsonl "
                            "that `moe-inspector run` wrote, or run the session again to re-record").decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no recorded results for {session_path}; record them first with "
                        f"`moe-inspector run {shlex.quote(str(session_path))}`") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read the results file ({error}); run the session again") from None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        value = parse_json(line, f"{path}:{number}", "the line", "run the session again to re-record")
        if not isinstance(value, dict):
            raise UserError(f"{path}:{number}: expected a JSON object; run the session again to re-record")
        lines.append(value)
    if not lines or lines[0].get("kind") != "header":
        raise UserError(f"{path}: the first line is not a results header; run the session again to re-record")
    header = lines[0]
    if header.get("schema") != RESULTS_SCHEMA:
        raise UserError(f"{path}: results schema {printable(repr(header.get('schema')), 40)}, this moe-inspector "
                        f"reads schema {RESULTS_SCHEMA}; run the session again to re-record")
    results_schema.check_header(header, f"{path}:1")
    for number, line in enumerate(lines[1:], start=2):
        results_schema.check_step(line, f"{path}:{number}")
    return header, lines[1:]


# --------------------------------------------------------------------------------------------
# Replay: the diff of a re-run against the recording
# --------------------------------------------------------------------------------------------

def check_replayable(session: Session, header: dict, recorded: list[dict], results_path: str,
                     current_flags: flag_registry.ResolvedFlags, where: str) -> None:
    """The recording must be of this session, on these flags: otherwise a diff would mislead (exit 2). `where`: the
    session file as the user named it now (the recorded session_file may have moved since)."""
    rerun = f"run `moe-inspector run {printable(shlex.quote(where), 120)}` to re-record"
    if header.get("session") != session.name:  # another session's recording: its model or steps are not "changes"
        raise UserError(f"{results_path}: records session {printable(repr(header.get('session')), 60)}, not "
                        f"{printable(repr(session.name), 60)}; give this session's results with --results, or {rerun}")
    for key, now in (("model", session.engine.model), ("seed", session.engine.seed)):
        # a checkpoint recorded and named now by another path (moved, and the path fixed): its content decides,
        # compared before anything runs (replay_session: weights_difference on the recorded provenance)
        moved = key == "model" and isinstance(header.get("checkpoint"), dict) and now not in PRESETS
        if header.get(key) != now and not moved:
            raise UserError(f"{results_path}: recorded with {key} {printable(repr(header.get(key)), 120)}, the "
                            f"session now says {printable(repr(now), 120)}; {rerun}")
    recorded_flags = {name: entry.get("value") for name, entry in (header.get("flags") or {}).items()}
    for name in flag_registry.SPECS:
        if name in recorded_flags and recorded_flags[name] != current_flags[name]:
            source = current_flags.sources[name]
            raise UserError(f"{results_path}: recorded with {name}={recorded_flags[name]!r}, now "
                            f"{current_flags[name]!r} (from the {source}); unset MOEI_{name.upper()} or set it in "
                            f"[flags], or {rerun}")
    definitions = [step_to_plain(step) for step in session.steps]
    if len(definitions) != len(recorded):
        raise UserError(f"{results_path}: {len(recorded)} recorded steps, the session has {len(definitions)}; "
                        f"the session changed since it was recorded: {rerun}")
    for index, (definition, line) in enumerate(zip(definitions, recorded), start=1):
        if _as_spelled(line.get("definition")) != _as_spelled(definition):
            raise UserError(f"{results_path}: step {index} was recorded as {line.get('definition')}, the session "
                            f"now says {definition}; {rerun}")
        if line.get("action") != definition.get("action"):  # a line at odds with itself: edited, not recorded
            raise UserError(f"{results_path}: step {index}'s line says action "
                            f"{printable(repr(line.get('action')), 40)}, its own definition "
                            f"{definition.get('action')!r}: the recording was edited; {rerun}")


# Keys that name a model by path: a moved model with its path fixed is the same step; its content is what replay
# compares (check_b_models for b_model, the recorded source's fingerprint for original)
PATH_KEYS = ("b_model", "original")


def _as_spelled(definition):
    if not isinstance(definition, dict):
        return definition
    return {key: ("a model" if key in PATH_KEYS and value is not None else value) for key, value in definition.items()}


def _label(step: dict) -> str:
    return f"step {step['step']} ({step['action']})"


SHARED = ("shared_path", "shared_reason")


def _without_shared(entry: dict) -> dict:
    return {**entry, "moe": {key: value for key, value in entry["moe"].items() if key not in SHARED}}


def decisions_match(recorded: list[dict], now: list[dict]) -> bool:
    """A run's decisions as recorded and as re-run are the same. A recorded MoE entry whose shared_path is absent or
    null (a results file written before the shared experts' path was recorded) compares without it."""
    if len(recorded) != len(now):
        return False
    return all(old == new or ("moe" in old and "moe" in new and not old["moe"].get("shared_path")
                              and _without_shared(old) == _without_shared(new))
               for old, new in zip(recorded, now))


def _describe_decision(entry: dict) -> str:
    parts = []
    if "moe" in entry:
        moe = entry["moe"]
        variant = f" v{moe['variant']}" if moe.get("variant") is not None else ""
        shared = (f", shared experts {moe['shared_path']}" + (f" ({moe['shared_reason']})" if moe.get("shared_reason")
                                                            else "") if moe.get("shared_path") else "")
        parts.append(f"moe decided {moe['decided']}{variant}, executed {moe['executed']}{shared}")
    if "attention" in entry:
        attention = entry["attention"]
        parts.append(f"attention decided {attention['decided']}, executed {attention['executed']} "
                     f"({attention['applied_mask']} mask)")
    return "; ".join(parts)


def quant_verdicts(step: dict) -> list:
    """A check-quant step's verdict per token count: what a replay compares of it."""
    return [row.get("verdict") for row in ((step.get("numbers") or {}).get("rows") or [])]


def diff_step(recorded: dict, now: dict) -> list[str]:
    """What differs between a recorded step result and its re-run, in words; timings are not compared."""
    differences = []
    label = _label(recorded)
    configs_recorded = [run.get("config") for run in recorded.get("runs", [])]
    configs_now = [run.get("config") for run in now.get("runs", [])]
    if configs_recorded != configs_now:  # a run missing from the recording is a difference, not a pass
        differences.append(f"{label}: runs recorded under configs {configs_recorded}, re-run under {configs_now}")
    for run_recorded, run_now in zip(recorded.get("runs", []), now.get("runs", [])):
        where = f"{label}, config {run_recorded['config']}"
        if isinstance(run_now.get("model"), dict):  # B ran on a model of its own (a compare step's b_model)
            if not isinstance(run_recorded.get("model"), dict):
                differences.append(f"{where}: the recording holds no valid record of B's model")
            else:
                model_difference = weights_difference(run_recorded["model"], run_now["model"])
                if model_difference is not None:
                    differences.append(f"{where}: b_model recorded with {model_difference}")
        tokens_recorded, tokens_now = run_recorded["tokens"], run_now["tokens"]
        if tokens_recorded != tokens_now:
            from engine.sidebyside import first_divergence

            index = first_divergence(tokens_recorded, tokens_now)
            differences.append(f"{where}: generated token {index} differs: recorded "
                               f"{token_at(tokens_recorded, index)}, now {token_at(tokens_now, index)}")
        if run_recorded["counters"] != run_now["counters"]:
            changed = []
            for family in ("arms", "kernels"):
                # a family may be recorded as null (the schema's "arms?"): no launches of it
                old, new = run_recorded["counters"].get(family) or {}, run_now["counters"].get(family) or {}
                changed += [f"{name} recorded {old.get(name, 0)}, now {new.get(name, 0)}"
                            for name in sorted(set(old) | set(new)) if old.get(name, 0) != new.get(name, 0)]
            differences.append(f"{where}: counters differ: {'; '.join(changed) or 'layout changed'}")
        if not decisions_match(run_recorded["decisions"], run_now["decisions"]):
            pairs = list(zip(run_recorded["decisions"], run_now["decisions"]))
            first = next(((old, new) for old, new in pairs if not decisions_match([old], [new])), None)
            if first is None:
                differences.append(f"{where}: {len(run_recorded['decisions'])} decisions recorded, "
                                   f"{len(run_now['decisions'])} now")
            else:
                old, new = first
                differences.append(f"{where}: decision at generated step {old['step']}, layer {old['layer']} "
                                   f"differs: recorded {_describe_decision(old)}; now {_describe_decision(new)}")
    if recorded["action"] == "curve" and recorded.get("numbers") != now.get("numbers"):
        differences.append(f"{label}: curve numbers differ from the recording")
    if recorded["action"] == "check-attention":
        old, new = recorded.get("numbers", {}).get("verdict"), now.get("numbers", {}).get("verdict")
        if old != new:
            differences.append(f"{label}: verdict differs: recorded {old}, now {new}")
    if recorded["action"] == "check-quant":
        old, new = quant_verdicts(recorded), quant_verdicts(now)
        if old != new:
            differences.append(f"{label}: verdicts differ: recorded {old}, now {new}")
    if recorded["action"] == "bench":
        differences += diff_bench(label, recorded.get("numbers", {}), now.get("numbers", {}))
    return differences


BENCH_COMPARED = ("kind", "tokens", "batch", "prompt_tokens", "generated_tokens", "reps", "state")


def diff_bench(label: str, recorded: dict, now: dict) -> list[str]:
    """Bench rows: the same rows with the same token counts, state (admitting or not) and launch
    counters; rates and clocks are timings, shown beside the recording and never compared."""
    rows_recorded = {row["test"]: row for row in (recorded.get("rows") or [])}
    rows_now = {row["test"]: row for row in (now.get("rows") or [])}
    if list(rows_recorded) != list(rows_now):
        return [f"{label}: rows differ: recorded {', '.join(rows_recorded) or 'none'}, now {', '.join(rows_now) or 'none'}"]
    differences = []
    for test, old in rows_recorded.items():
        new = rows_now[test]
        changed = [f"{key} recorded {old.get(key)!r}, now {new.get(key)!r}" for key in BENCH_COMPARED
                   if old.get(key) != new.get(key)]
        old_counters, new_counters = old.get("counters") or {}, new.get("counters") or {}  # null: none recorded
        for family in ("arms", "kernels"):
            before, after = old_counters.get(family) or {}, new_counters.get(family) or {}
            changed += [f"{name} launches recorded {before.get(name, 0)}, now {after.get(name, 0)}"
                        for name in sorted(set(before) | set(after)) if before.get(name, 0) != after.get(name, 0)]
        for key in ("graph_replays", "graph_launches", "steps"):  # graph_launches: not in older recordings
            if (key != "graph_launches" or key in old_counters) and old_counters.get(key) != new_counters.get(key):
                changed.append(f"{key} recorded {old_counters.get(key)}, now {new_counters.get(key)}")
        if changed:
            differences.append(f"{label}, row {test}: {'; '.join(changed)}")
    return differences


@dataclass
class ReplayOutcome:
    recorded_header: dict
    recorded: list[dict]
    rerun: RunOutcome
    differences: list[str]

    @property
    def exit_code(self) -> int:
        return 1 if self.differences or self.rerun.failed_checks else 0


def check_b_models(session: Session, where: str, recorded: list[dict], results_path: str, device) -> None:
    """Before a replay runs: each compare step's B model must hold the weights its recording ran (as the header's
    are checked for A's), else the tokens would not be comparable."""
    from engine.runtime import Engine

    for index, (step, line) in enumerate(zip(session.steps, recorded), start=1):
        runs = line.get("runs") or []
        if not isinstance(step, CompareStep) or step.b_model is None or len(runs) < 2:
            continue
        about = runs[1].get("model") if isinstance(runs[1], dict) else None
        if not isinstance(about, dict) or not isinstance(about.get("checkpoint", {}), (dict, type(None))):
            raise UserError(f"{results_path}: step {index} runs B on b_model {printable(step.b_model, 60)}, and its "
                            f"recording holds no valid record of B's model, so a match could not be trusted; "
                            f"re-record with `moe-inspector run {shlex.quote(where)}`")
        here = f"{where}: step {index} ({step.action})"
        planned = plan_b_model(session, where, here, step)
        weights, checkpoint = Engine.provenance_before_load(planned.model, device, planned.seed, planned.weights)
        difference = weights_difference(about, {"weights": weights, "checkpoint": checkpoint})
        if difference is not None:
            raise UserError(f"{results_path}: step {index}'s b_model was recorded with {difference}; tokens are only "
                            f"comparable with the same weights, so nothing was re-run: restore that checkpoint, or "
                            f"re-record with `moe-inspector run {shlex.quote(where)}`")


def replay_session(session: Session, where: str, results_path: str | os.PathLike, device: str | None = None,
                   progress: Callable[[int, int, Step, dict | None], None] | None = None,
                   cancel: threading.Event | None = None) -> ReplayOutcome:
    """Re-run on the recording's device (unless `device` says otherwise) and diff."""
    header, recorded = read_results(results_path, where)
    check_replayable(session, header, recorded, str(results_path), base_flags(session), where)
    if device is None and header.get("device_spec"):
        device = header["device_spec"]  # replay where it was recorded
        try:
            _, torch_device = preflight(session, where, device)
        except UserError as error:
            if "CUDA" not in str(error):
                raise
            raise UserError(f"{results_path}: recorded on {header.get('device')} ({device}), and no CUDA GPU is "
                            f"visible here; replay on a machine with that GPU, or re-record here with "
                            f"`moe-inspector run {shlex.quote(where)} --device cpu`") from None
    else:
        device = device or session.engine.device
        _, torch_device = preflight(session, where, device)
    from engine.runtime import device_label

    if device_label(torch_device) != header.get("device"):
        raise UserError(f"{results_path}: recorded on {header.get('device')}, this replay would run on "
                        f"{device_label(torch_device)}; tokens are only comparable on the same device: replay "
                        f"there (--device), or re-record here with `moe-inspector run {shlex.quote(where)}`")
    if header.get("weights") is not None:  # before a step runs: the weights the re-run would load
        from engine.runtime import Engine

        weights, checkpoint = Engine.provenance_before_load(session.engine.model, torch_device, session.engine.seed,
                                                            session.engine.weights, base=session_directory(where))
        difference = weights_difference(header, {"weights": weights, "checkpoint": checkpoint})
        if difference is not None:
            raise UserError(f"{results_path}: recorded with {difference}; tokens are only comparable with the same "
                            f"weights, so nothing was re-run: restore that checkpoint, or re-record with "
                            f"`moe-inspector run {shlex.quote(where)}`")
    check_b_models(session, where, recorded, str(results_path), torch_device)
    rerun = run_session(session, where, device, progress, cancel=cancel)
    if header.get("weights") is not None and not same_weights(header, rerun.header):
        raise UserError(f"{results_path}: recorded with weights '{header['weights']}', this replay ran with "
                        f"'{rerun.header['weights']}'; tokens are only comparable with the same weights: "
                        f"re-record with `moe-inspector run {shlex.quote(where)}`")
    differences = [difference for old, new in zip(recorded, rerun.steps) for difference in diff_step(old, new)]
    return ReplayOutcome(header, recorded, rerun, differences)
