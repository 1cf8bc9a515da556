"""Run a session's steps headless, write its results file, and diff a re-run against it.

Results file (JSON lines, `x.toml` -> `x.results.jsonl`): a header line

    {"kind": "header", "schema": 1, "package_version", "commit", "commit_dirty", "python", "torch",
     "triton", "cpu_threads", "device", "device_spec", "model", "seed", "flags": {name: {value, source}},
     "configs": {name: overrides}, "session", "session_file", "started_at"}

then one line per step, in order:

    {"kind": "step", "step": 1, "action", "definition": {the step as written}, "status": "ok" or
     "check failed", "runs": [per configuration: config, flags, prompt_tokens, tokens, text,
     decisions (per generated step per layer: phase, n_tokens, moe decided/executed/variant,
     attention decided/executed/mask/applied_mask), counters, reasons (each distinct decision
     reason once), notes (why an executed arm differs from the decided one), timings],
     "numbers": {...},
     "check": {"expect", "held", "detail"} or null, "wall_s"}

A bench step's numbers are engine.bench's JSON report (rows, targets, footer); replay compares
its rows' token counts, state and launch counters, never its rates.

Before anything runs, `preflight` checks what can be known without running (model, device,
prompt lengths, GPU-only steps, steps whose engine code is not in this build) so a bad session
fails in a second with exit 2 rather than half-way. Timings are recorded, never diffed.

Knows nothing of argument parsing or report layout.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine import flags as flag_registry
from engine.config import ModelConfig
from engine.errors import UserError
from engine.provenance import commit_and_dirty
from engine.tokenizer import ByteTokenizer
from inspector.session import (BASE, BENCH_DEFAULT_BATCH, BENCH_TG_PROMPT, BenchStep, CheckAttentionStep, CheckQuantStep,
                               CompareStep, CurveStep, PromptStep, Session, Step, SweepStep, atomic_write_text,
                               step_to_plain)

RESULTS_SCHEMA = 1
OK, CHECK_FAILED = "ok", "check failed"
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


def session_directory(where: str | os.PathLike) -> Path:
    """The directory a session's relative paths are taken from: the session file's."""
    return Path(where).resolve().parent


def environment_header(session: Session, where: str, device_label: str, device_spec: str,
                       base_flags: flag_registry.ResolvedFlags, weights: str | None = None,
                       checkpoint: dict | None = None) -> dict:
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
        "configs": {config.name: dict(config.flags) for config in session.configs},
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------------------------
# Flags per configuration
# --------------------------------------------------------------------------------------------

def base_flags(session: Session) -> flag_registry.ResolvedFlags:
    """Defaults < environment < the session's [flags] (already validated)."""
    return flag_registry.from_environment().with_overrides(session.flags, flag_registry.SESSION)


def config_flags(session: Session, base: flag_registry.ResolvedFlags, name: str | None) -> flag_registry.ResolvedFlags:
    if name in (None, BASE):
        return base
    overrides = next(config.flags for config in session.configs if config.name == name)
    return base.with_overrides(overrides, flag_registry.SESSION)


# --------------------------------------------------------------------------------------------
# Preflight: everything knowable before running
# --------------------------------------------------------------------------------------------

def check_attention_function() -> Callable[..., dict] | None:
    """`engine.compare.check_attention` when this build has it (it lands from another branch)."""
    if importlib.util.find_spec("engine.compare") is None:
        return None
    module = importlib.import_module("engine.compare")
    return getattr(module, "check_attention", None)


def sweep_function() -> Callable[..., dict] | None:
    """`engine.sweep.sweep` when this build has it (the measurement issue)."""
    if importlib.util.find_spec("engine.sweep") is None:
        return None
    return getattr(importlib.import_module("engine.sweep"), "sweep", None)


def _composite_mask(model: ModelConfig):
    return next((mask for mask in model.layer_masks if mask.kind == "composite"), None)


def attention_shape(step: CheckAttentionStep, model: ModelConfig) -> dict[str, Any]:
    """The step's shape with the model's values filled in where the step leaves them out."""
    mask = _composite_mask(model)
    return {
        "seq_len": step.seq_len, "head_dim": step.head_dim or model.head_dim, "heads": step.heads or model.n_heads,
        "kv_heads": step.kv_heads or model.n_kv_heads,
        "window": step.window or (mask.window if mask else None), "block": step.block or (mask.block if mask else None),
        "pad": step.pad, "mode": step.mode,
    }


def bench_specs(step: BenchStep) -> list:
    """The step's llama-bench rows (engine.bench.RowSpec), in the order `moe-inspector bench` runs them."""
    from engine.bench import row_specs

    return row_specs(step.pp or [], step.tg or [], step.batch or list(BENCH_DEFAULT_BATCH), BENCH_TG_PROMPT)


def preflight_step(where: str, index: int, step: Step, model: ModelConfig, device: Any) -> None:
    """What can be known about one step before running it (model, device, lengths, this build); raises UserError."""
    tokenizer = ByteTokenizer()
    here = f"{where}: step {index} ({step.action})"
    if isinstance(step, (PromptStep, CompareStep)):
        length, context = len(tokenizer.encode(step.prompt)), model.max_seq_len
        if length + step.max_tokens > context:
            raise UserError(f"{here}: the prompt ({length} tokens) plus max_tokens {step.max_tokens} exceeds "
                            f"the {model.name} context of {context}; shorten the prompt or lower max_tokens")
    elif isinstance(step, CurveStep):
        k, experts = step.k or model.top_k, step.experts or model.n_experts
        if k > experts:
            raise UserError(f"{here}: k {k} is more than experts {experts}; need 1 <= k <= experts")
    elif isinstance(step, SweepStep):
        if device.type != "cuda":
            raise UserError(f"{here}: sweep times kernels and needs a CUDA GPU, and this run is on "
                            f"{device.type}; run the session on a GPU machine, or remove the step")
        if sweep_function() is None:
            raise UserError(f"{here}: sweep is not available in this build (engine.sweep is missing); "
                            f"update moe-inspector, or remove the step")
    elif isinstance(step, CheckAttentionStep):
        if check_attention_function() is None:
            raise UserError(f"{here}: check-attention is not available in this build (engine.compare."
                            f"check_attention is missing); update moe-inspector, or remove the step")
        shape = attention_shape(step, model)
        if shape["window"] is None or shape["block"] is None:
            raise UserError(f"{here}: model {model.name} has no composite mask to take window and block "
                            f"from; set window = ... and block = ... in the step")
        if shape["heads"] % shape["kv_heads"]:
            raise UserError(f"{here}: heads {shape['heads']} is not a multiple of kv_heads {shape['kv_heads']}")
        if shape["pad"] >= shape["seq_len"]:
            raise UserError(f"{here}: pad {shape['pad']} leaves no unpadded key of seq_len {shape['seq_len']}; "
                            f"use pad < seq_len")
    elif isinstance(step, BenchStep):
        for spec in bench_specs(step):
            needed = spec.prompt_len + spec.max_tokens
            if needed > model.max_seq_len:
                raise UserError(f"{here}: row {spec.name} needs {needed} positions, more than the {model.name} "
                                f"context of {model.max_seq_len}; choose shorter pp/tg")


def preflight(session: Session, where: str, device_name: str) -> tuple[ModelConfig, Any]:
    """The model and torch device, after checking every step can run here; raises UserError."""
    from engine.runtime import PRESETS, model_config, resolve_device, resolve_model_path

    name = session.engine.model
    if name not in PRESETS and ("/" in name or os.sep in name or name.startswith(".")):
        path = resolve_model_path(name, session_directory(where))
        if not path.is_dir():
            raise UserError(f"{where}: [engine] model: {path} is not a directory (a relative path is taken from the "
                            f"session file's directory): was the checkpoint moved? Fix the path in [engine] model")
    try:
        model = model_config(name, session_directory(where))
    except UserError as error:
        raise UserError(f"{where}: [engine] model: {error}") from None
    try:
        device = resolve_device(device_name)
    except UserError as error:
        raise UserError(f"{where}: [engine] device: {error}") from None
    for index, step in enumerate(session.steps, start=1):
        preflight_step(where, index, step, model, device)
    return model, device


# --------------------------------------------------------------------------------------------
# Running steps
# --------------------------------------------------------------------------------------------

def _json_safe(value: Any) -> Any:
    """Plain JSON values from what an engine function returns (tensors, numpy scalars, dtypes)."""
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "tolist"):  # torch tensors and numpy values
        return _json_safe(value.tolist())
    return str(value)


def summarize_generation(generation, config_name: str, wall_s: float) -> dict:
    """One configuration's run: tokens, per step per layer what was decided and what executed."""
    decisions = []
    for step in generation.steps:
        moe = {record["layer"]: record for record in step["moe"]}
        attention = {record["layer"]: record for record in step["attention"]}
        for layer in sorted(set(moe) | set(attention)):
            entry: dict[str, Any] = {"step": step["step"], "layer": layer, "phase": step["phase"],
                                     "n_tokens": step["n_tokens"]}
            if layer in moe:
                record = moe[layer]
                entry["moe"] = {"decided": record["decided_arm"], "executed": record["executed_arm"],
                                "variant": record["variant"]}
            if layer in attention:
                record = attention[layer]
                entry["attention"] = {"decided": record["decided_arm"], "executed": record["executed_arm"],
                                      "mask": record["mask"], "applied_mask": record["applied_mask"]}
            decisions.append(entry)
    records = [record for step in generation.steps for record in step["moe"] + step["attention"]]
    notes = sorted({record["execution_note"] for record in records if record.get("execution_note")})
    reasons = list(dict.fromkeys(record["reason"] for record in records))  # first-seen order, once each

    def microseconds(family: str) -> float | None:
        values = [record["us"] for step in generation.steps for record in step[family] if record["us"] is not None]
        return round(sum(values), 1) if values else None

    return {
        "config": config_name, "flags": dict(generation.flags.values), "prompt_tokens": len(generation.prompt_tokens),
        "tokens": list(generation.tokens), "text": generation.text, "decisions": decisions,
        "counters": generation.counters, "reasons": reasons, "notes": notes,
        "timings": {"wall_s": round(wall_s, 4), "moe_us": microseconds("moe"),
                    "attention_us": microseconds("attention")},
    }


def match_check(expect_match: bool | None, tokens_a: list[int], tokens_b: list[int],
                divergence: int | None, max_error: float | None) -> dict | None:
    if expect_match is None:
        return None
    if expect_match:
        held = divergence is None
        detail = ("identical tokens, as expected" if held else
                  f"expected identical tokens; diverged at generated token {divergence} "
                  f"({_token_at(tokens_a, divergence)} vs {_token_at(tokens_b, divergence)})")
    else:
        held = divergence is not None
        detail = (f"diverged at generated token {divergence}, as expected" if held else
                  f"expected the configurations to diverge; tokens identical "
                  f"(max logit rel err {max_error:.2e})" if max_error is not None else
                  "expected the configurations to diverge; tokens identical")
    return {"expect": "match" if expect_match else "diverge", "held": held, "detail": detail}


def _token_at(tokens: list[int], index: int) -> str:
    return str(tokens[index]) if index < len(tokens) else "end"


@dataclass
class RunContext:
    session: Session
    where: str
    engine: Any  # engine.runtime.Engine
    base: flag_registry.ResolvedFlags
    bench_progress: Any = None  # an object with advance(note=...), passed to engine.bench.run_bench
    trace: Any = None  # an engine.trace.Trace that receives every generation's and bench row's steps (--trace)


def bench_numbers(report: dict) -> dict:
    """A bench step's numbers: engine.bench's JSON report (rows with counters and timings, targets, footer)."""
    return _json_safe(report)


def make_context(session: Session, where: str, engine) -> RunContext:
    """For the TUI's replay screen: run one step at a time on its own engine with
    `run_step(context, index, step)` and diff it with `diff_step(recorded, result)`."""
    return RunContext(session, where, engine, base_flags(session))


def _generate(context: RunContext, prompt: str, max_tokens: int, config_name: str | None):
    flags = config_flags(context.session, context.base, config_name)
    started = time.perf_counter()
    clock = None
    if context.trace is not None:
        from engine.trace import StepClock

        clock = StepClock()
    generation = context.engine.generate(prompt, max_tokens, flags, on_step=clock)
    if clock is not None:
        context.trace.add_run(config_name or BASE, f"{len(generation.tokens)} tokens: {prompt[:40]!r}",
                              clock.stamped(generation.steps))
    return generation, summarize_generation(generation, config_name or BASE, time.perf_counter() - started)


def _run_generation_step(context: RunContext, prompt: str, max_tokens: int, config_a: str | None,
                         config_b: str | None, expect_match: bool | None) -> tuple[list[dict], dict, dict | None]:
    from engine.sidebyside import compare

    generation_a, run_a = _generate(context, prompt, max_tokens, config_a)
    if config_b is None:
        return [run_a], {}, None
    generation_b, run_b = _generate(context, prompt, max_tokens, config_b)
    summary = compare(generation_a, generation_b)
    errors = summary["logit_rel_err"]
    numbers = {"first_divergence": summary["first_divergence"], "max_logit_rel_err": max(errors) if errors else None,
               "logit_rel_err": errors}
    check = match_check(expect_match, run_a["tokens"], run_b["tokens"], numbers["first_divergence"],
                        numbers["max_logit_rel_err"])
    return [run_a, run_b], numbers, check


def run_step(context: RunContext, index: int, step: Step) -> dict:
    """One step's result line."""
    started = time.perf_counter()
    runs: list[dict] = []
    numbers: dict = {}
    check: dict | None = None
    model = context.engine.config
    if isinstance(step, PromptStep):
        runs, numbers, check = _run_generation_step(context, step.prompt, step.max_tokens, step.config, step.compare,
                                                    step.expect_match)
    elif isinstance(step, CompareStep):
        runs, numbers, check = _run_generation_step(context, step.prompt, step.max_tokens, step.a, step.b,
                                                    step.expect_match)
    elif isinstance(step, CurveStep):
        from inspector.commands.curve import DEFAULT_TOKENS, curve

        tokens = step.tokens or [int(n) for n in DEFAULT_TOKENS.split(",")]
        tile_m = step.tile_m or config_flags(context.session, context.base, step.config)["tile_m"]
        numbers = curve(step.k or model.top_k, step.experts or model.n_experts, tile_m, tokens)
    elif isinstance(step, SweepStep):
        sweep = sweep_function()
        flags = config_flags(context.session, context.base, step.config)
        numbers = _json_safe(sweep(engine=context.engine, tokens=list(step.tokens),
                                   arms=list(step.arms or ("gemv", "grouped")), flags=flags))
    elif isinstance(step, CheckAttentionStep):
        import torch

        dtype = getattr(torch, step.dtype) if step.dtype else context.engine.dtype
        numbers = _json_safe(check_attention_function()(
            **attention_shape(step, model), device=context.engine.device, dtype=dtype,
            seed=context.session.engine.seed))
        numbers["dtype"] = str(dtype).replace("torch.", "")
        if step.expect is not None:
            verdict = numbers.get("verdict")
            held = verdict == step.expect
            check = {"expect": step.expect, "held": held,
                     "detail": (f"verdict {verdict}, as expected" if held else
                                f"expected verdict {step.expect}, got {verdict}: {numbers.get('sentence', '')}")}
    elif isinstance(step, CheckQuantStep):
        from engine.quant_check import check_quant_engine

        checkpoint = context.engine.checkpoint or {}
        directory = Path(checkpoint.get("path") or context.session.engine.model)
        numbers = _json_safe(check_quant_engine(context.engine, directory, layer=step.layer,
                                                tokens=tuple(step.tokens) if step.tokens else None, arm=step.arm,
                                                seed=context.session.engine.seed))
        if step.expect is not None:
            verdicts = [row["verdict"] for row in numbers["rows"]]
            held = all(verdict == step.expect for verdict in verdicts)
            check = {"expect": step.expect, "held": held,
                     "detail": (f"verdict {step.expect} at every token count, as expected" if held else
                                f"expected verdict {step.expect}, got {verdicts}: {numbers['sentence']}")}
    elif isinstance(step, BenchStep):
        from engine.bench import run_bench

        report = run_bench(context.engine, config_flags(context.session, context.base, step.config),
                           bench_specs(step), step.reps, progress=context.bench_progress, trace=context.trace)
        numbers = bench_numbers(report.to_json())
    else:  # pragma: no cover - the parser admits only the types above
        raise AssertionError(step)
    return {
        "kind": "step", "step": index, "action": step.action, "definition": step_to_plain(step),
        "status": CHECK_FAILED if check is not None and not check["held"] else OK,
        "runs": runs, "numbers": numbers, "check": check, "wall_s": round(time.perf_counter() - started, 4),
    }


@dataclass
class RunOutcome:
    header: dict
    steps: list[dict] = field(default_factory=list)

    @property
    def failed_checks(self) -> list[dict]:
        return [step for step in self.steps if step["status"] == CHECK_FAILED]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed_checks else 0


def run_session(session: Session, where: str, device: str | None = None,
                progress: Callable[[int, int, Step, dict | None], None] | None = None,
                only_steps: list[int] | None = None, trace=None) -> RunOutcome:
    """Run every step (or the 1-based `only_steps`) on `device` (default: the session's); `trace` (an
    engine.trace.Trace) receives the steps of every generation and bench row."""
    from engine.runtime import Engine

    model, torch_device = preflight(session, where, device or session.engine.device)
    base = base_flags(session)
    # The same weights the TUI and `generate` use: a preset's shipped checkpoint where it has one.
    engine = Engine.load(session.engine.model, str(torch_device), session.engine.seed, session.engine.weights,
                         base=session_directory(where))
    outcome = RunOutcome(environment_header(session, where, engine.device_label, str(engine.device), base,
                                            engine.weights_source, engine.checkpoint))
    context = RunContext(session, where, engine, base, trace=trace)
    if trace is not None:
        from engine.trace import enable_nvtx

        enable_nvtx(engine.device)
    chosen = [(index, step) for index, step in enumerate(session.steps, start=1)
              if only_steps is None or index in only_steps]
    for index, step in chosen:
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


def read_results(path: str | os.PathLike, session_path: str) -> tuple[dict, list[dict]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no recorded results for {session_path}; record them first with "
                        f"`moe-inspector run {session_path}`") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read the results file ({error}); run the session again") from None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            raise UserError(f"{path}:{number}: not a JSON line ({error}); run the session again to re-record") from None
        if not isinstance(value, dict):
            raise UserError(f"{path}:{number}: expected a JSON object; run the session again to re-record")
        lines.append(value)
    if not lines or lines[0].get("kind") != "header":
        raise UserError(f"{path}: the first line is not a results header; run the session again to re-record")
    header = lines[0]
    if header.get("schema") != RESULTS_SCHEMA:
        raise UserError(f"{path}: results schema {header.get('schema')!r}, this moe-inspector reads schema "
                        f"{RESULTS_SCHEMA}; run the session again to re-record")
    return header, lines[1:]


# --------------------------------------------------------------------------------------------
# Replay: the diff of a re-run against the recording
# --------------------------------------------------------------------------------------------

def check_replayable(session: Session, header: dict, recorded: list[dict], results_path: str,
                     current_flags: flag_registry.ResolvedFlags) -> None:
    """The recording must be of this session, on these flags: otherwise a diff would mislead (exit 2)."""
    rerun = f"run `moe-inspector run {header.get('session_file', 'SESSION.toml')}` to re-record"
    for key, now in (("model", session.engine.model), ("seed", session.engine.seed)):
        if header.get(key) != now:
            raise UserError(f"{results_path}: recorded with {key} {header.get(key)!r}, the session now says "
                            f"{now!r}; {rerun}")
    recorded_flags = {name: entry.get("value") for name, entry in header.get("flags", {}).items()}
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
        if line.get("definition") != definition:
            raise UserError(f"{results_path}: step {index} was recorded as {line.get('definition')}, the session "
                            f"now says {definition}; {rerun}")


def _label(step: dict) -> str:
    return f"step {step['step']} ({step['action']})"


def _describe_decision(entry: dict) -> str:
    parts = []
    if "moe" in entry:
        moe = entry["moe"]
        variant = f" v{moe['variant']}" if moe.get("variant") is not None else ""
        parts.append(f"moe decided {moe['decided']}{variant}, executed {moe['executed']}")
    if "attention" in entry:
        attention = entry["attention"]
        parts.append(f"attention decided {attention['decided']}, executed {attention['executed']} "
                     f"({attention['applied_mask']} mask)")
    return "; ".join(parts)


def diff_step(recorded: dict, now: dict) -> list[str]:
    """What differs between a recorded step result and its re-run, in words; timings are not compared."""
    differences = []
    label = _label(recorded)
    for run_recorded, run_now in zip(recorded.get("runs", []), now.get("runs", [])):
        where = f"{label}, config {run_recorded['config']}"
        tokens_recorded, tokens_now = run_recorded["tokens"], run_now["tokens"]
        if tokens_recorded != tokens_now:
            from engine.sidebyside import first_divergence

            index = first_divergence(tokens_recorded, tokens_now)
            differences.append(f"{where}: generated token {index} differs: recorded "
                               f"{_token_at(tokens_recorded, index)}, now {_token_at(tokens_now, index)}")
        if run_recorded["counters"] != run_now["counters"]:
            changed = []
            for family in ("arms", "kernels"):
                old, new = run_recorded["counters"].get(family, {}), run_now["counters"].get(family, {})
                changed += [f"{name} recorded {old.get(name, 0)}, now {new.get(name, 0)}"
                            for name in sorted(set(old) | set(new)) if old.get(name, 0) != new.get(name, 0)]
            differences.append(f"{where}: counters differ: {'; '.join(changed) or 'layout changed'}")
        if run_recorded["decisions"] != run_now["decisions"]:
            pairs = list(zip(run_recorded["decisions"], run_now["decisions"]))
            first = next(((old, new) for old, new in pairs if old != new), None)
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
        old, new = ([row.get("verdict") for row in side.get("numbers", {}).get("rows", [])] for side in (recorded, now))
        if old != new:
            differences.append(f"{label}: verdicts differ: recorded {old}, now {new}")
    if recorded["action"] == "bench":
        differences += diff_bench(label, recorded.get("numbers", {}), now.get("numbers", {}))
    return differences


BENCH_COMPARED = ("kind", "tokens", "batch", "prompt_tokens", "generated_tokens", "reps", "state")


def diff_bench(label: str, recorded: dict, now: dict) -> list[str]:
    """Bench rows: the same rows with the same token counts, state (admitting or not) and launch
    counters; rates and clocks are timings, shown beside the recording and never compared."""
    rows_recorded = {row["test"]: row for row in recorded.get("rows", [])}
    rows_now = {row["test"]: row for row in now.get("rows", [])}
    if list(rows_recorded) != list(rows_now):
        return [f"{label}: rows differ: recorded {', '.join(rows_recorded) or 'none'}, now {', '.join(rows_now) or 'none'}"]
    differences = []
    for test, old in rows_recorded.items():
        new = rows_now[test]
        changed = [f"{key} recorded {old.get(key)!r}, now {new.get(key)!r}" for key in BENCH_COMPARED
                   if old.get(key) != new.get(key)]
        old_counters, new_counters = old.get("counters", {}), new.get("counters", {})
        for family in ("arms", "kernels"):
            before, after = old_counters.get(family, {}), new_counters.get(family, {})
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


def replay_session(session: Session, where: str, results_path: str | os.PathLike, device: str | None = None,
                   progress: Callable[[int, int, Step, dict | None], None] | None = None) -> ReplayOutcome:
    """Re-run on the recording's device (unless `device` says otherwise) and diff."""
    header, recorded = read_results(results_path, where)
    check_replayable(session, header, recorded, str(results_path), base_flags(session))
    if device is None and header.get("device_spec"):
        device = header["device_spec"]  # replay where it was recorded
        try:
            _, torch_device = preflight(session, where, device)
        except UserError as error:
            if "CUDA" not in str(error):
                raise
            raise UserError(f"{results_path}: recorded on {header.get('device')} ({device}), and no CUDA GPU is "
                            f"visible here; replay on a machine with that GPU, or re-record here with "
                            f"`moe-inspector run {where} --device cpu`") from None
    else:
        device = device or session.engine.device
        _, torch_device = preflight(session, where, device)
    from engine.runtime import device_label

    if device_label(torch_device) != header.get("device"):
        raise UserError(f"{results_path}: recorded on {header.get('device')}, this replay would run on "
                        f"{device_label(torch_device)}; tokens are only comparable on the same device: replay "
                        f"there (--device), or re-record here with `moe-inspector run {where}`")
    rerun = run_session(session, where, device, progress)
    if header.get("weights") is not None and header["weights"] != rerun.header["weights"]:
        raise UserError(f"{results_path}: recorded with weights '{header['weights']}', this replay ran with "
                        f"'{rerun.header['weights']}'; tokens are only comparable with the same weights: "
                        f"re-record with `moe-inspector run {where}`")
    differences = [difference for old, new in zip(recorded, rerun.steps) for difference in diff_step(old, new)]
    return ReplayOutcome(header, recorded, rerun, differences)
