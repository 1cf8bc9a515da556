"""Session steps as a registry: each action owns its preflight, its run and its result line.

    action = ACTIONS[type(step)]
    action.preflight(here, step, model, device)      what can be known before running; raises UserError
    outcome = action.run(context, step)              runs it on the context's engine
    line = action.result(context, index, step, outcome)   the results line, or None (nothing to record)

An outcome is what running the step produced, in the form the TUI computes it too: for prompt and
compare {"generations": [a, b or None], "walls": [seconds, ...], "comparison": engine.sidebyside.compare's
dict or None}; for check-attention and sweep {"result": the engine's dict}; for bench {"report": engine.bench's
JSON report}; for curve nothing (its numbers are arithmetic). A "wall_s" in the outcome is the step's wall
time. The headless runner (inspector.session_runner.run_step) and the TUI (inspector.tui_session) build
every results line here, so a step the user ran in the TUI records the same line, words included, that
`moe-inspector run` would write.

Knows nothing of argument parsing, widgets or report layout.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine import flags as flag_registry
from engine import limits
from engine.config import PRESETS, ModelConfig
from engine.errors import UserError
from engine.printable import printable
from engine.tokenizer import ByteTokenizer
from inspector import session_decode
from inspector.session import (BASE, BENCH_DEFAULT_BATCH, BENCH_TG_PROMPT, BenchStep, CheckAttentionStep, CheckQuantStep,
                               CompareStep, CurveStep, PromptStep, Session, Step, SweepStep, step_to_plain)

OK, CHECK_FAILED = "ok", "check failed"


# --------------------------------------------------------------------------------------------
# What every action needs
# --------------------------------------------------------------------------------------------

def base_flags(session: Session) -> flag_registry.ResolvedFlags:
    """Defaults < environment < the session's [flags] (already validated)."""
    return flag_registry.from_environment().with_overrides(session.flags, flag_registry.SESSION)


def config_flags(session: Session, base: flag_registry.ResolvedFlags, name: str | None) -> flag_registry.ResolvedFlags:
    if name in (None, BASE):
        return base
    overrides = next(config.flags for config in session.configs if config.name == name)
    return base.with_overrides(overrides, flag_registry.SESSION)


def session_directory(where: str | Path) -> Path:
    """The directory a session's relative paths are taken from: the session file's."""
    return Path(where).resolve().parent


def session_model(model: str, where: str | Path) -> str:
    """A model a session names, as it loads: a preset by name, a path taken from the session file's directory."""
    from engine.model_source import resolve_model_path

    return model if model in PRESETS else str(resolve_model_path(model, session_directory(where)))


def step_here(session: Session, where: str, step: Step) -> str:
    """How errors name `step`: the file, its number and its action."""
    index = next((number for number, other in enumerate(session.steps, start=1) if other is step), None)
    if index is None:
        index = next((number for number, other in enumerate(session.steps, start=1) if other == step), "?")
    return f"{where}: step {index} ({step.action})"


def b_model_names(here: str):
    """How a compare step's b_model refusals name what the session file says (inspector.b_model.Names)."""
    from inspector import b_model

    return b_model.Names(b=f"{here}: b_model", a="[engine] model", random='[engine] weights = "random"',
                         give="b_model =")


def plan_b_model(session: Session, where: str, here: str, step: CompareStep):
    """A compare step's B model (inspector.b_model.BModel), checked from the configs alone; UserError naming the
    step. Paths are taken from the session file's directory, A's and B's alike."""
    from inspector import b_model

    b = step.b_model if step.b_model == b_model.SOURCE else session_model(step.b_model, where)
    return b_model.plan_for(session_model(session.engine.model, where), b, session.engine.weights,
                            session.engine.seed, b_model_names(here))


def _prompt_tokens(model: str, prompt: str) -> list[int] | None:
    """The prompt as `model`'s tokenizer.json reads it (ms: no weight loads), or None where the model has none
    (a preset, byte tokens) or it cannot be read here."""
    path = Path(model) / "tokenizer.json"
    if model in PRESETS or not path.is_file():
        return None
    try:
        from engine.hf_tokenizer import HFTokenizer

        return list(HFTokenizer(path).encode(prompt))
    except (UserError, ImportError):
        return None


def preflight_b_model(session: Session, where: str, here: str, step: CompareStep) -> None:
    """What a compare step's `b_model` can be checked for before anything loads: the model, its vocabulary, its
    context against the prompt."""
    from engine.model_source import model_config

    planned = plan_b_model(session, where, here, step)
    model = model_config(planned.model)
    tokens = [_prompt_tokens(name, step.prompt) for name in (session_model(session.engine.model, where),
                                                               planned.model)]
    if None not in tokens and tokens[0] != tokens[1]:  # else the load's own check, when the step runs
        raise UserError(f"{here}: b_model {planned.label}: it reads the prompt as other tokens than [engine] model "
                        f"does: compare needs two models with one tokenizer")
    length = len(ByteTokenizer().encode(step.prompt))
    if length + step.max_tokens > model.max_seq_len:
        raise UserError(f"{here}: the prompt ({length} tokens) plus max_tokens {step.max_tokens} exceeds b_model's "
                        f"context of {model.max_seq_len}; shorten the prompt or lower max_tokens")


@dataclass
class RunContext:
    session: Session
    where: str
    engine: Any  # engine.runtime.Engine
    base: flag_registry.ResolvedFlags
    bench_progress: Any = None  # an object with advance(note=...), passed to engine.bench.run_bench
    trace: Any = None  # an engine.trace.Trace that receives every generation's and bench row's steps (--trace)
    b_engines: dict = field(default_factory=dict)  # compare steps' B models, loaded once: (model, weights, seed)

    def flags(self, config: str | None) -> flag_registry.ResolvedFlags:
        return config_flags(self.session, self.base, config)

    def b_engine(self, step: CompareStep) -> Any:
        """The engine a compare step's B runs on: A's, or its `b_model` (loaded on A's device the first time, its
        prompt tokens checked against A's)."""
        if step.b_model is None:
            return self.engine
        from inspector import b_model

        here = step_here(self.session, self.where, step)
        planned = plan_b_model(self.session, self.where, here, step)
        key = (planned.model, planned.weights, planned.seed)
        engine = self.b_engines.get(key)
        if engine is None:  # loaded without a prompt to check: each step's is checked below
            engine = b_model.load_for(planned, str(self.engine.device), self.engine, None, progress=False,
                                      model_a=self.session.engine.model, names=b_model_names(here))
            self.b_engines[key] = engine
        b_model.check_prompt(planned, engine, self.engine, step.prompt, self.session.engine.model,
                             b_model_names(here))
        return engine


def make_context(session: Session, where: str, engine) -> RunContext:
    """A context to run one step at a time on `engine` (the TUI's replay screen and recorder)."""
    return RunContext(session, where, engine, base_flags(session))


def json_safe(value: Any) -> Any:
    """Plain JSON values from what an engine function returns (tensors, numpy scalars, dtypes)."""
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "tolist"):  # torch tensors and numpy values
        return json_safe(value.tolist())
    return str(value)


def result_line(index: int, step: Step, runs: list[dict], numbers: dict, check: dict | None, wall_s: float) -> dict:
    """The results line of a step (the format inspector.session_runner's docstring draws)."""
    return {"kind": "step", "step": index, "action": step.action, "definition": step_to_plain(step),
            "status": CHECK_FAILED if check is not None and not check["held"] else OK,
            "runs": runs, "numbers": numbers, "check": check, "wall_s": round(wall_s, 4)}


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
                if record.get("shared_path"):  # only layers with shared experts (DeepSeek, Qwen2-MoE)
                    entry["moe"].update(shared_path=record["shared_path"], shared_reason=record.get("shared_reason"))
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
                  f"({token_at(tokens_a, divergence)} vs {token_at(tokens_b, divergence)})")
    else:
        held = divergence is not None
        detail = (f"diverged at generated token {divergence}, as expected" if held else
                  f"expected the configurations to diverge; tokens identical "
                  f"(max logit rel err {max_error:.2e})" if max_error is not None else
                  "expected the configurations to diverge; tokens identical")
    return {"expect": "match" if expect_match else "diverge", "held": held, "detail": detail}


def token_at(tokens: list[int], index: int) -> str:
    return str(tokens[index]) if index < len(tokens) else "end"


def _composite_mask(model: ModelConfig):
    return next((mask for mask in model.layer_masks if mask.kind == "composite"), None)


SINKS_ONLY = ("head_dim", "kv_heads", "window", "block")
MLA_ONLY = ("kv_lora_rank", "rope_dim", "nope_dim", "v_dim")


def mla_shape(step: CheckAttentionStep, model: ModelConfig, here: str) -> dict[str, Any]:
    """engine.compare_mla.check_mla's shape: the step's dims, else the model's latent attention's (UserError
    naming the step where neither gives one)."""
    from engine.compare_mla import latent_dims

    from_model = {} if model.latent_attention is None else latent_dims(model.latent_attention)
    shape = {name: getattr(step, name) or from_model.get(name) for name in MLA_ONLY}
    missing = [name for name, value in shape.items() if value is None]
    if missing:
        raise UserError(f"{here}: model {model.name} has no latent attention to take {', '.join(missing)} from; "
                        f"set {' = ..., '.join(missing)} = ... in the step, or drop mla = true")
    return {"seq_len": step.seq_len, "heads": step.heads or model.n_heads, **shape}


def as_step_keys(message: str) -> str:
    """A check's message with its command-line options (`--head-dim`) spelled as a session step's keys
    (`head_dim`), and the device as the session's [engine] key."""
    import re

    message = message.replace("--device", "[engine] device")
    return re.sub(r"--([a-z][a-z-]*)", lambda match: match.group(1).replace("-", "_"), message)


def _dtype_name(dtype: str | None, device) -> str:
    """A step's dtype (float32, float16, bfloat16; None: the engine's) as engine.compare names it."""
    names = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
    if dtype:
        return names.get(dtype, dtype)
    return "bf16" if str(device).startswith("cuda") else "fp32"


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


def bench_numbers(report: dict) -> dict:
    """A bench step's numbers: engine.bench's JSON report (rows with counters and timings, targets, footer)."""
    return json_safe(report)


# --------------------------------------------------------------------------------------------
# The actions
# --------------------------------------------------------------------------------------------

class Action:
    """One kind of step. Subclasses set `step_type` and override what differs."""

    step_type: type = object

    def preflight(self, here: str, step: Step, model: ModelConfig, device: Any) -> None:
        """What can be known about the step before running it; raises UserError naming `here`."""

    def run(self, context: RunContext, step: Step) -> dict:
        """Run the step; its outcome (the module docstring)."""
        return {}

    def result(self, context: RunContext, index: int, step: Step, outcome: Mapping[str, Any]) -> dict | None:
        """The step's results line from its outcome; None when the outcome holds nothing to record."""
        raise NotImplementedError


class _Generation(Action):
    """prompt and compare: the same prompt under one or two configurations."""

    def configs(self, step) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def preflight(self, here, step, model, device) -> None:
        length, context = len(ByteTokenizer().encode(step.prompt)), model.max_seq_len
        if length + step.max_tokens > context:
            raise UserError(f"{here}: the prompt ({length} tokens) plus max_tokens {step.max_tokens} exceeds "
                            f"the {model.name} context of {context}; shorten the prompt or lower max_tokens")

    def run(self, context, step) -> dict:
        from engine.sidebyside import compare

        first, second = self.configs(step)
        engines = [context.engine, context.b_engine(step) if isinstance(step, CompareStep) else context.engine]
        generations, walls = [], []
        for config, engine in zip((first, second) if second is not None else (first,), engines):
            # first None: the base [flags]
            started = time.perf_counter()
            clock = None
            if context.trace is not None:
                from engine.trace import StepClock

                clock = StepClock()
            generation = engine.generate(step.prompt, step.max_tokens, context.flags(config), on_step=clock)
            walls.append(time.perf_counter() - started)
            if clock is not None:
                context.trace.add_run(config or BASE, f"{len(generation.tokens)} tokens: {step.prompt[:40]!r}",
                                      clock.stamped(generation.steps))
            generations.append(generation)
        comparison = compare(generations[0], generations[1]) if len(generations) == 2 else None
        outcome = {"generations": generations, "walls": walls, "comparison": comparison}
        if getattr(step, "b_model", None) is not None:
            outcome["b_model"] = b_model_about(engines[1])
        return outcome

    def result(self, context, index, step, outcome) -> dict | None:
        generations, walls = outcome.get("generations"), list(outcome.get("walls") or ())
        if not generations:
            return None
        walls += [0.0] * (len(generations) - len(walls))
        first, second = self.configs(step)
        names = [first or BASE] + ([second] if second is not None else [])
        runs = [summarize_generation(generation, name, wall or 0.0)
                for generation, name, wall in zip(generations, names, walls) if generation is not None]
        if outcome.get("b_model") is not None and len(runs) == 2:
            runs[1]["model"] = outcome["b_model"]
        numbers: dict = {}
        check = None
        comparison = outcome.get("comparison")
        if comparison is not None and len(runs) == 2:
            errors = list(comparison["logit_rel_err"])
            numbers = {"first_divergence": comparison["first_divergence"],
                       "max_logit_rel_err": max(errors) if errors else None, "logit_rel_err": errors}
            check = match_check(step.expect_match, runs[0]["tokens"], runs[1]["tokens"],
                                numbers["first_divergence"], numbers["max_logit_rel_err"])
        wall_s = outcome.get("wall_s")
        return result_line(index, step, runs, numbers, check,
                           float(wall_s) if wall_s is not None else sum(wall or 0.0 for wall in walls))


def b_model_about(engine) -> dict:
    """What a compare step's B ran on, for its results line: the model as loaded, its weights in words and a
    checkpoint's provenance (engine.model_source.describe_checkpoint), which replay checks before it re-runs."""
    return {"model": engine.model_spec, "weights": engine.weights_source, "checkpoint": engine.checkpoint}


class PromptAction(_Generation):
    step_type = PromptStep

    def configs(self, step) -> tuple[str | None, str | None]:
        return step.config, step.compare


class CompareAction(_Generation):
    step_type = CompareStep

    def configs(self, step) -> tuple[str | None, str | None]:
        return step.a, step.b


class CurveAction(Action):
    """The uniform-routing curve: arithmetic, so its line is computed from the step alone."""

    step_type = CurveStep

    def preflight(self, here, step, model, device) -> None:
        k, experts = step.k or model.top_k, step.experts or model.n_experts
        if k > experts:
            raise UserError(f"{here}: k {k} is more than experts {experts}; need 1 <= k <= experts")
        if step.tile_m is not None and step.tile_m not in flag_registry.TILE_M_CHOICES:
            raise UserError(f"{here}: tile_m {step.tile_m}: the grouped GEMM's m-tiles are "
                            f"{', '.join(map(str, flag_registry.TILE_M_CHOICES))}")
        limits.check_curve_request(k, experts, step.tile_m or 1, step.tokens or [], here)

    def result(self, context, index, step, outcome) -> dict:
        from engine.curve import CURVE_TOKENS, curve

        started = time.perf_counter()
        model = context.engine.config
        tile_m = step.tile_m or context.flags(step.config)["tile_m"]
        numbers = curve(step.k or model.top_k, step.experts or model.n_experts, tile_m, step.tokens or CURVE_TOKENS)
        return result_line(index, step, [], numbers, None, time.perf_counter() - started)


# A session's arm names, as engine.sweep names them (`grouped`: the step's configuration's grouped_variant;
# `reference`: every arm is checked against it already, so it is not timed on its own).
def sweep_arms(step: SweepStep, flags: flag_registry.ResolvedFlags) -> tuple[str, ...]:
    arms = []
    for arm in step.arms or ("gemv", "grouped"):
        name = f"grouped_v{flags['grouped_variant']}" if arm == "grouped" else arm
        if name != "reference" and name not in arms:
            arms.append(name)
    return tuple(arms)


class SweepAction(Action):
    """The MoE arms timed per token count on this GPU (engine.sweep); writes the calibration `measured` reads."""

    step_type = SweepStep


    def preflight(self, here, step, model, device) -> None:
        if device.type != "cuda":
            raise UserError(f"{here}: sweep times kernels and needs a CUDA GPU, and this run is on "
                            f"{device.type}; run the session on a GPU machine, or remove the step")
        if not [arm for arm in step.arms or ("gemv",) if arm != "reference"]:
            raise UserError(f"{here}: arms = [\"reference\"] leaves nothing to time (every arm is checked against "
                            f"the reference); name gemv, grouped or torch_grouped_mm")

    def run(self, context, step) -> dict:
        from engine.sweep import SweepConfig, run_sweep
        from inspector.session_routing import routing_path

        from engine.model_source import resolve_model_path

        flags, session = context.flags(step.config), context.session
        model = session.engine.model  # a preset, or a checkpoint directory relative to the session file's
        if model != context.engine.config.name:
            model = str(resolve_model_path(model, Path(context.where).resolve().parent))
        config = SweepConfig(model=model, tokens=tuple(sorted(set(step.tokens))),
                             arms=sweep_arms(step, flags), tile_m=flags["tile_m"], seed=session.engine.seed,
                             routing=routing_path(step, context.where))
        return {"result": run_sweep(config, flags=flags)}

    def result(self, context, index, step, outcome) -> dict | None:
        if outcome.get("result") is None:
            return None
        numbers = json_safe(outcome["result"])
        check = None
        if numbers.get("check_failed"):
            check = {"expect": "every arm matches the reference", "held": False,
                     "detail": "an arm's output differs from the reference beyond the sweep's tolerance"}
        return result_line(index, step, [], numbers, check, float(outcome.get("wall_s") or 0.0))


class CheckAttentionAction(Action):
    """The fused attention against the masked, causal and unmasked references (engine.compare.check_attention); with
    mla = true the latent check (engine.compare_mla), with decode = true the decode check (inspector.session_decode)."""

    step_type = CheckAttentionStep

    def preflight(self, here, step, model, device) -> None:
        from engine.triton_support import missing_message, triton_installed

        if not triton_installed():
            raise UserError(f"{here}: {missing_message('check-attention')}")
        if step.decode:
            session_decode.preflight_decode(here, step, model, device)
            return
        session_decode.refuse_decode_options(here, step)
        if step.window == 0:
            raise UserError(f"{here}: window = 0 (plain causal layers) is the decode check's; add decode = true, or "
                            f"give the sinks check a window >= 1")
        if step.mla:
            self._preflight_mla(here, step, model, device)
            return
        given = [name for name in MLA_ONLY if getattr(step, name) is not None]
        if given or step.expect == "no_rope":
            what = ", ".join(given) if given else "expect = \"no_rope\""
            raise UserError(f"{here}: {what} belongs to the latent check; add mla = true, or drop it")
        shape = attention_shape(step, model)
        if shape["window"] is None or shape["block"] is None:
            raise UserError(f"{here}: model {model.name} has no composite mask to take window and block "
                            f"from; set window = ... and block = ... in the step")
        if shape["heads"] % shape["kv_heads"]:
            raise UserError(f"{here}: heads {shape['heads']} is not a multiple of kv_heads {shape['kv_heads']}")
        if shape["pad"] >= shape["seq_len"]:
            raise UserError(f"{here}: pad {shape['pad']} leaves no unpadded key of seq_len {shape['seq_len']}; "
                            f"use pad < seq_len")
        from engine.compare import CheckConfig, resolve_device

        try:  # the check's own validation, before anything runs, its option names spelled as the step's keys
            CheckConfig(**{key: shape[key] for key in ("seq_len", "head_dim", "heads", "kv_heads", "window", "block",
                                                       "pad", "mode")},
                        device=resolve_device(device), dtype=_dtype_name(step.dtype, device), seed=0)
        except UserError as error:
            raise UserError(f"{here}: {as_step_keys(str(error))}") from None
        limits.check_attention_request(shape["seq_len"], shape["heads"], shape["kv_heads"], shape["head_dim"],
                                       device, here)

    @staticmethod
    def _preflight_mla(here, step, model, device) -> None:
        from engine.attention_dispatch import mla_kernel_declines
        from engine.compare_mla import check_request

        given = [name for name in SINKS_ONLY if getattr(step, name) is not None] + (["pad"] if step.pad else [])
        if given or step.expect == "masked":
            what = ", ".join(given) if given else "expect = \"masked\""
            raise UserError(f"{here}: {what} belongs to the sinks check, not the latent one (mla = true); drop it")
        if step.seq_len < 2:
            raise UserError(f"{here}: seq_len {step.seq_len}: the latent check needs at least 2 positions")
        shape = mla_shape(step, model, here)
        declined = mla_kernel_declines(shape["kv_lora_rank"], shape["rope_dim"])
        if declined:
            raise UserError(f"{here}: the fused MLA kernel declines this latent shape ({declined}): nothing to check")
        check_request(shape["seq_len"], shape["heads"], shape["kv_lora_rank"], shape["rope_dim"], device, here,
                      shape["nope_dim"], shape["v_dim"])

    def dtype(self, context, step):
        import torch

        return getattr(torch, step.dtype) if step.dtype else context.engine.dtype

    def run(self, context, step) -> dict:
        from engine import compare

        if step.decode:
            from engine.compare_decode import check_decode

            return {"result": check_decode(**session_decode.decode_shape(step, context.engine.config, context.where),
                                           mode=step.mode, device=context.engine.device.type,
                                           dtype=self.dtype(context, step), seed=context.session.engine.seed)}
        if step.mla:
            from engine.compare_mla import check_mla

            return {"result": check_mla(**mla_shape(step, context.engine.config, context.where),
                                        mode=step.mode, device=context.engine.device.type,
                                        dtype=self.dtype(context, step), seed=context.session.engine.seed)}
        return {"result": compare.check_attention(**attention_shape(step, context.engine.config),
                                                  device=context.engine.device, dtype=self.dtype(context, step),
                                                  seed=context.session.engine.seed)}

    def result(self, context, index, step, outcome) -> dict | None:
        if outcome.get("result") is None:
            return None
        numbers = json_safe(outcome["result"])
        numbers["dtype"] = str(self.dtype(context, step)).replace("torch.", "")
        check = None
        if step.expect is not None:
            verdict = numbers.get("verdict")
            held = verdict == step.expect
            check = {"expect": step.expect, "held": held,
                     "detail": (f"verdict {verdict}, as expected" if held else
                                f"expected verdict {step.expect}, got {verdict}: {numbers.get('sentence', '')}")}
        return result_line(index, step, [], numbers, check, float(outcome.get("wall_s") or 0.0))


ORIGINAL_KEY = "original ="  # how check-quant's refusals name the step's key that sets the source


def quant_original(where: str, step: CheckQuantStep) -> str | None:
    """A check-quant step's `original`, a path taken from the session file's directory (a preset as named)."""
    return None if step.original is None else session_model(step.original, where)


def preflight_check_quant(session: Session, where: str, here: str, step: CheckQuantStep) -> None:
    """Before any step runs: the model a check-quant step measures against must be there and be the one the
    checkpoint was quantized from (a source moved since the recording stopped a session half-way)."""
    from engine.model_source import not_a_directory
    from engine.quant_check import verified_source
    from engine.trellis_checkpoint import is_trellis_directory

    name = session.engine.model
    directory = None if name in PRESETS else Path(session_model(name, where))
    if directory is None or not is_trellis_directory(directory):
        raise UserError(f"{here}: [engine] model {printable(name, 80)} is not a trellis checkpoint, and check-quant "
                        f"measures one; quantize it first (moe-inspector quantize MODEL --experts "
                        f"trellis:K=2,code=hyb --out DIR) and name DIR in [engine] model")
    original = quant_original(where, step)
    try:
        model, _, _, _ = verified_source(directory, original, ORIGINAL_KEY)
    except UserError as error:
        raise UserError(f"{here}: {error}") from None
    path = Path(model).expanduser()
    if model not in PRESETS and not path.is_dir():
        which = f"original {step.original}" if original else f"the source {directory} records, {model},"
        raise UserError(f"{here}: {which} {not_a_directory(path)}: was it moved? Set original = \"PATH\" in the "
                        f"step (a path from the session file's directory)")


class CheckQuantAction(Action):
    """A trellis arm against the dequantized and the original experts (engine.quant_check.check_quant_engine)."""

    step_type = CheckQuantStep

    def preflight(self, here, step, model, device) -> None:
        from engine.quant_check import moe_layer, trellis_arm

        if step.tokens:
            limits.check_quant_request(model, step.tokens, device, f"{here}: tokens")
        try:  # known from the config and the device: refused before step 1 runs, naming the step's keys
            moe_layer(model, step.layer, "layer")
            trellis_arm(step.arm, getattr(device, "type", str(device)), "arm")
        except UserError as error:
            raise UserError(f"{here}: {error}") from None

    def run(self, context, step) -> dict:
        from engine.quant_check import check_quant_engine

        checkpoint = context.engine.checkpoint or {}
        directory = Path(checkpoint.get("path") or context.session.engine.model)
        return {"result": check_quant_engine(context.engine, directory, layer=step.layer,
                                             tokens=tuple(step.tokens) if step.tokens else None, arm=step.arm,
                                             seed=context.session.engine.seed,
                                             original=quant_original(context.where, step), option=ORIGINAL_KEY)}

    def result(self, context, index, step, outcome) -> dict | None:
        if outcome.get("result") is None:
            return None
        numbers = json_safe(outcome["result"])
        check = None
        if step.expect is not None:
            verdicts = [row["verdict"] for row in numbers["rows"]]
            held = all(verdict == step.expect for verdict in verdicts)
            check = {"expect": step.expect, "held": held,
                     "detail": (f"verdict {step.expect} at every token count, as expected" if held else
                                f"expected verdict {step.expect}, got {verdicts}: {numbers['sentence']}")}
        return result_line(index, step, [], numbers, check, float(outcome.get("wall_s") or 0.0))


class BenchAction(Action):
    """llama-bench rows (engine.bench.run_bench) under the step's configuration."""

    step_type = BenchStep

    def preflight(self, here, step, model, device) -> None:
        for values, key in ((step.pp or [], "pp"), (step.tg or [], "tg"), (step.batch or [], "batch")):
            limits.check_list(values, f"{here}: {key}")
        for spec in bench_specs(step):
            needed = spec.prompt_len + spec.max_tokens
            if needed > model.max_seq_len:
                raise UserError(f"{here}: row {spec.name} needs {needed} positions, more than the {model.name} "
                                f"context of {model.max_seq_len}; choose shorter pp/tg")
        from engine.runtime import Engine

        # The weights are counted: preflight runs before the session's engine is loaded.
        limits.check_bench_request(model, device, Engine.dtype_for(device), bench_specs(step), step.reps, here,
                                   weights_loaded=False)

    def run(self, context, step) -> dict:
        from engine.bench import run_bench

        report = run_bench(context.engine, context.flags(step.config), bench_specs(step), step.reps,
                           progress=context.bench_progress, trace=context.trace)
        return {"report": report.to_json()}

    def result(self, context, index, step, outcome) -> dict | None:
        if outcome.get("report") is None:
            return None
        return result_line(index, step, [], bench_numbers(outcome["report"]), None,
                           float(outcome.get("wall_s") or 0.0))


ACTIONS: dict[type, Action] = {action.step_type: action for action in (
    PromptAction(), CompareAction(), CurveAction(), SweepAction(), CheckAttentionAction(), CheckQuantAction(),
    BenchAction())}


def action_for(step: Step) -> Action:
    return ACTIONS[type(step)]
