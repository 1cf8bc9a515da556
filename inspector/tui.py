"""`moe-inspector` with no subcommand: resolve the flags, load the engine, open the session, run the TUI.

Every action the user takes is recorded into a session (`--session FILE`, else a timestamped
autosave under ~/.cache/moe-inspector/sessions/) and saved atomically after each one, together
with what the TUI saw (`inspector.tui_session.TuiSession`): the sibling results file holds, per step, the same line
`moe-inspector run` would write (tokens, decisions, counters, numbers, timings), so the replay
screen and `moe-inspector replay` can diff a re-run against what the user saw.

A bad `--set` value, an unknown model/device or a malformed `--session` file is reported before
the screen is taken over (exit 2), never as a traceback inside the app. Knows nothing of widgets.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from engine import flags as flag_registry
from engine.config import PRESETS
from engine.errors import UserError
from engine.printable import one_line, printable
from engine.runtime import Engine
from inspector.commands.common import DEFAULT_MODEL, DEFAULT_SEED
from inspector.prompt_file import read_prompt_file
from inspector.session import load_session
from inspector.tui_session import AUTOSAVE_DIRECTORY, TuiSession, autosave_path


def _session_engine(args, spec) -> tuple[str, int, str, list[str]]:
    """Model, seed and device for an existing session: the session's, unless the command line disagrees."""
    notes = []
    model, seed = spec.model, spec.seed
    if spec.ep > 1:
        raise UserError(f"--session {args.session}: [engine] ep = {spec.ep}; the TUI runs one device: run it headless "
                        f"with `moe-inspector run {shlex.quote(str(args.session))}`, which spawns the ranks")
    given = getattr(args, "given_globals", None)  # inspector.cli: what the command line gave (`--model demo` too)
    if args.model != spec.model and (args.model != DEFAULT_MODEL if given is None else "model" in given):
        raise UserError(f"--session {args.session} records model {spec.model}, and --model says {args.model}: drop "
                        f"--model (the session decides), or start a new session file")
    if args.seed != spec.seed and (args.seed != DEFAULT_SEED if given is None else "seed" in given):
        raise UserError(f"--session {args.session} records seed {spec.seed}, and --seed says {args.seed}: drop --seed, "
                        f"or start a new session file")
    if args.model != spec.model:
        notes.append(f"model {spec.model}, as {args.session} records it")
    device = args.device if args.device != "auto" else spec.device
    return model, seed, device, notes


def session_engine_info(engine: Engine, model: str, device: str, seed: int, weights: str) -> dict:
    """The [engine] table a new session records. A checkpoint directory is recorded as its absolute path: the
    session format takes a relative one from the session file's directory (an autosave lives under
    ~/.cache), not from the directory the inspector was started in."""
    if model not in PRESETS and engine.checkpoint is not None:
        model = engine.checkpoint["path"]
    return {"model": model, "device": device, "seed": seed} | ({"weights": weights} if weights != "auto" else {})


def history_path() -> Path:
    """The prompt history, beside the autosaved sessions ($MOEI_SESSION_DIR or ~/.cache/moe-inspector/sessions/)."""
    return Path(os.environ.get("MOEI_SESSION_DIR") or AUTOSAVE_DIRECTORY) / "prompt-history.jsonl"


def _plan_b(args, model: str, weights: str, seed: int, session_path: str | None):
    """`--b-model` planned from the configs (inspector.b_model), or None; A's model as loaded (an existing
    session's relative path taken from its directory)."""
    if getattr(args, "b_model", None) is None:
        return None
    from inspector import b_model
    from inspector.session_steps import session_model

    names = b_model.OPTIONS
    if session_path is not None:  # A's model and weights are the session's: refusals name its keys, not options
        model = session_model(model, session_path)
        names = b_model.Names(a=f"[engine] model of {printable(session_path)}",
                              random=f'[engine] weights = "random" of {printable(session_path)}')
    return model, b_model.plan_for(model, args.b_model, weights, seed, names)


def _load_b(planned, engine: Engine, args) -> tuple[Engine | None, str | None]:
    """B's engine and the b_model a session step records for it: "source" or a preset as named, a directory as
    its absolute path (a session's paths are taken from its own directory, not from here)."""
    if planned is None:
        return None, None
    from inspector import b_model

    model_a, plan = planned
    print(f"moe-inspector: loading B's model {printable(plan.model)} …", file=sys.stderr, flush=True)
    engine_b = b_model.load_for(plan, str(engine.device), engine, None, progress=True, model_a=model_a)
    given = plan.given if plan.given == b_model.SOURCE or plan.given in PRESETS else str(Path(plan.given).resolve())
    return engine_b, given


def launch(args) -> int:
    notes: list[str] = []
    prompt = ""
    try:
        if getattr(args, "prompt_file", None):
            prompt = read_prompt_file(args.prompt_file)
        flags = flag_registry.resolve(args.set_flags)  # a bad MOEI_ value: one line on stderr, and a note below
        model, seed, device = args.model, args.seed, args.device
        session_path = getattr(args, "session", None)
        existing = bool(session_path) and Path(session_path).exists()
        if existing:  # a malformed session is refused here, before anything is loaded
            model, seed, device, notes = _session_engine(args, load_session(session_path).engine)
        sweep = getattr(args, "sweep", None)
        if sweep and not Path(sweep).expanduser().is_file():  # before the model loads; its JSON is read below
            raise UserError(f"--sweep {sweep}: no such file; give the JSON `moe-inspector sweep --json` wrote")
        if session_path is not None:  # it is saved after every action: it must take a write
            from inspector.output_paths import check_output_path
            from inspector.session_runner import results_path_for

            check_output_path(session_path, "--session")
            check_output_path(results_path_for(session_path), "--session's results file",
                              protect={"the session file": session_path})
        if not existing and model not in PRESETS and not Path(model).is_dir():
            Engine.load(model, device, seed)  # refuses it in generate's words, before anything is loaded
        weights = getattr(args, "weights", "auto")
        if existing:
            weights = load_session(session_path).engine.weights
        base = Path(session_path).resolve().parent if existing else None
        planned = _plan_b(args, model, weights, seed, session_path if existing else None)  # before A loads
        print(f"moe-inspector: loading model {model} (device {device}) …", file=sys.stderr, flush=True)
        engine = Engine.load(model, device, seed, weights, base=base)
        engine_b, b_model = _load_b(planned, engine, args)
        path = Path(session_path) if session_path else autosave_path()
        session = TuiSession.start(path, engine, session_engine_info(engine, model, device, seed, weights), flags)
        if existing:
            flags = session.starting_flags(args.set_flags)
    except UserError as error:
        print(f"moe-inspector: error: {one_line(str(error))}", file=sys.stderr)
        return error.exit_code
    notes += flag_registry.environment_problems()
    if session.note:  # recorded results set aside: the replay screen will say "no recording" for those steps
        notes.append(session.note)

    from inspector.app import InspectorApp  # textual is imported only once the engine is ready
    from inspector.terminal_input import tolerate_invalid_utf8

    tolerate_invalid_utf8()  # a pasted byte that is not UTF-8 must not end the app (and the session)
    if getattr(args, "sweep", None):
        from inspector.screens.tile_fill import load_sweep

        try:
            load_sweep(args.sweep)  # a file that is not a sweep: refused here, not on the tile-fill screen
        except UserError as error:
            print(f"moe-inspector: error: {one_line(str(error))}", file=sys.stderr)
            return error.exit_code

    # `--sweep FILE` (optional) preloads the tile-fill screen's µs-per-arm plot.
    app = InspectorApp(engine, flags, startup_notes=notes, sweep_path=getattr(args, "sweep", None), session=session,
                       b_overrides=session.b_overrides(), history_path=str(history_path()), prompt=prompt,
                       engine_b=engine_b, b_model=b_model)
    app.run()
    return app.return_code or 0
