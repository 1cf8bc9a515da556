"""The session the TUI records into, and the results of each recorded step, both saved atomically.

Every action the user takes is recorded into a session (`--session FILE`, else a timestamped
autosave under ~/.cache/moe-inspector/sessions/) and saved after each one, together with what the
TUI saw: the sibling results file holds, per step, the same line `moe-inspector run` would write
(inspector.session_steps builds both), so the replay screen and `moe-inspector replay` can diff a
re-run against what the user saw. Knows nothing of widgets.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Mapping

from engine import flags as flag_registry
from engine.errors import UserError
from engine.runtime import Engine
from inspector.session import CompareStep, CurveStep, PromptStep, Session, Step, step_to_plain
from inspector.session_recorder import SessionRecorder, default_session_path
from inspector.session_runner import (environment_header, read_results, results_path_for, weights_difference,
                                      write_results)
from inspector.session_steps import action_for, base_flags, make_context

AUTOSAVE_DIRECTORY = Path.home() / ".cache" / "moe-inspector" / "sessions"


def autosave_path() -> Path:
    """A fresh timestamped file under $MOEI_SESSION_DIR or ~/.cache/moe-inspector/sessions/."""
    path = default_session_path(os.environ.get("MOEI_SESSION_DIR") or AUTOSAVE_DIRECTORY)
    candidate, suffix = path, 2
    while candidate.exists():  # two inspectors started in the same second
        candidate, suffix = path.with_name(f"{path.stem}-{suffix}.toml"), suffix + 1
    return candidate


def shown_path(path: str | os.PathLike) -> str:
    """A path as a person would type it: ~ for the home directory."""
    text, home = str(path), str(Path.home())
    return "~" + text[len(home):] if text.startswith(home + os.sep) else text


def runs_model(engine: Engine, model: str, session_path: Path) -> bool:
    """Whether `engine` is the session's [engine] model: the same name, or the same checkpoint directory however
    it is spelled (the session's relative path is from its own directory; the engine's from where it started)."""
    if model in (engine.model_spec, engine.config.name):
        return True
    if engine.checkpoint is None:
        return False
    from engine.runtime import resolve_model_path

    recorded = resolve_model_path(model, session_path.resolve().parent)
    return recorded.is_dir() and recorded.resolve() == Path(engine.checkpoint["path"])


class TuiSession:
    """The session the TUI records into and the results of each recorded step, both saved atomically.

    `record(action, outcome)` appends a step (through the recorder) and its results line, built
    from what the TUI already computed (`outcome`: the generations, the check's dict, the bench
    report), so the recording is what the user saw, not a second run.
    """

    def __init__(self, recorder: SessionRecorder, engine: Engine, lines: dict[int, dict] | None = None,
                 note: str = "") -> None:
        self.recorder, self.engine = recorder, engine
        self.lines: dict[int, dict] = dict(lines or {})  # step number -> its results line
        self.note = note  # why loaded results were set aside, if they were
        # Why the results file on disk is not written (it holds results this session cannot merge:
        # another device, other flags, steps that changed); it is left as it is, never dropped.
        self.results_kept_as_they_are: str | None = None
        self._header: dict | None = None
        self._curves = {self._curve_state(step.k, step.experts, step.tile_m, step.config)
                        for step in self.session.steps if isinstance(step, CurveStep)}

    # -- opening ------------------------------------------------------------------------------------

    @classmethod
    def start(cls, path: str | os.PathLike, engine: Engine, engine_info: Mapping[str, Any],
              flags: flag_registry.ResolvedFlags) -> "TuiSession":
        """--session FILE: continue it if it exists, else start it (nothing is written before an action)."""
        if Path(path).exists():
            return cls.open(path, engine)
        return cls(SessionRecorder(path, engine_info, flags), engine)

    @classmethod
    def open(cls, path: str | os.PathLike, engine: Engine) -> "TuiSession":
        """An existing session for this engine; UserError (the parser's message) when it is not one."""
        recorder = SessionRecorder.load(path)
        spec = recorder.session.engine
        if not runs_model(engine, spec.model, Path(path)) or spec.seed != engine.seed:
            raise UserError(f"{path}: a session for model {spec.model} seed {spec.seed}, and this inspector runs "
                            f"{engine.config.name} seed {engine.seed}; open it with `moe-inspector --session {shlex.quote(str(path))}`")
        lines, note = cls._recorded_lines(Path(path), recorder.session, engine)
        session = cls(recorder, engine, lines, note)
        if note and results_path_for(path).exists():
            session.results_kept_as_they_are = note
            session.note = (f"{note}; the results file is left as it is and the results of new steps are not written "
                            f"to it (ctrl+s saves the session and its results under a new name)")
        return session

    @staticmethod
    def _recorded_lines(path: Path, session: Session, engine: Engine) -> tuple[dict[int, dict], str]:
        """The results lines that still describe this session's steps on this device, and why others were dropped."""
        results = results_path_for(path)
        if not results.exists():
            return {}, ""
        try:
            header, lines = read_results(results, str(path))
        except UserError as error:
            return {}, f"recorded results not used: {error}"
        if header.get("device") != engine.device_label:
            return {}, (f"recorded results not used: recorded on {header.get('device')}, this inspector runs on "
                        f"{engine.device_label}; tokens are only comparable on the same device")
        if header.get("weights") is not None:  # tokens are only comparable with the same weights (replay's rule)
            now = engine.provenance()
            difference = weights_difference(header, {"weights": now["weights"], "checkpoint": now.get("checkpoint")})
            if difference is not None:
                return {}, f"recorded results not used: recorded with {difference}; replay re-runs only"
        recorded_flags = {name: entry.get("value") for name, entry in header.get("flags", {}).items()}
        current_flags = dict(base_flags(session).values)
        # Flags a newer build added are not in an older recording: compare the ones recorded.
        if any(name in current_flags and value != current_flags[name] for name, value in recorded_flags.items()):
            return {}, "recorded results not used: they were recorded under other [flags]; replay re-runs only"
        kept = {}
        for line in lines:
            index = line.get("step")
            if (isinstance(index, int) and 1 <= index <= len(session.steps)
                    and line.get("definition") == step_to_plain(session.steps[index - 1])):
                kept[index] = line
        dropped = len(lines) - len(kept)
        return kept, (f"{dropped} recorded result(s) no longer match their steps and were set aside" if dropped else "")

    # -- state ----------------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self.recorder.path

    @property
    def results_path(self) -> Path:
        return results_path_for(self.path)

    @property
    def session(self) -> Session:
        return self.recorder.session

    def starting_flags(self, command_line: list[str] | None = None) -> flag_registry.ResolvedFlags:
        """Configuration A where the session left off (its last step's flags), then --set on top."""
        flags = flag_registry.from_environment().with_overrides(self.recorder.current_flags, flag_registry.SESSION)
        if command_line:
            flags = flags.with_overrides(flag_registry.parse_assignments(command_line), flag_registry.COMMAND_LINE)
        return flags

    def b_overrides(self) -> dict[str, Any] | None:
        """Configuration B as the last side-by-side step had it (its differences from A), if there was one."""
        for step in reversed(self.session.steps):
            sides = ((step.config, step.compare) if isinstance(step, PromptStep) and step.compare else
                     (step.a, step.b) if isinstance(step, CompareStep) else None)
            if sides is not None:
                flags_a, flags_b = (self.session.config_flags(side) for side in sides)
                return {name: value for name, value in flags_b.items() if flags_a.get(name) != value}
        return None

    def describe(self) -> str:
        steps = len(self.session.steps)
        return f"{shown_path(self.path)} ({steps} step{'s' if steps != 1 else ''})"

    # -- recording ------------------------------------------------------------------------------------

    def _curve_state(self, k: int | None, experts: int | None, tile_m: int | None, config: str | None = None) -> tuple:
        """What a curve step shows: the same (k, experts, tile_m) is the same curve."""
        model = self.engine.config
        if tile_m is None:
            tile_m = self.session.config_flags(config).get("tile_m", flag_registry.SPECS["tile_m"].default)
        return (k or model.top_k, experts or model.n_experts, tile_m)

    def record(self, action: Mapping[str, Any], outcome: Mapping[str, Any] | None = None) -> Step | None:
        """Append the action (a step, or a flag/config change that is not one) and save; returns the step.

        A curve is recorded once per distinct (k, experts, tile_m), not each time its screen opens."""
        curve = None
        if action.get("action") == "curve":
            curve = self._curve_state(action.get("k"), action.get("experts"), action.get("tile_m"))
            if curve in self._curves:
                return None
        step = self.recorder.append(action)
        if step is None:
            return None
        if curve is not None:
            self._curves.add(curve)
        index = len(self.session.steps)
        line = self._result_line(index, step, outcome or {})
        if line is not None:
            self.lines[index] = line
        self.write_results()
        return step

    def _result_line(self, index: int, step: Step, outcome: Mapping[str, Any]) -> dict | None:
        """The results line `moe-inspector run` would write for this step, from what the TUI computed (its
        action's result line, inspector.session_steps); None when the TUI ran nothing for it (a sweep)."""
        return action_for(step).result(make_context(self.session, str(self.path), self.engine), index, step, outcome)

    def header(self) -> dict:
        """The results header: the environment once (git is asked once), the session's state now."""
        session = self.session
        if self._header is None:
            self._header = environment_header(session, str(self.path), self.engine.device_label,
                                              str(self.engine.device), base_flags(session),
                                              self.engine.weights_source, self.engine.checkpoint)
        self._header.update(session=session.name, session_file=str(self.path), model=session.engine.model,
                            seed=session.engine.seed, flags=base_flags(session).to_json(),
                            configs={config.name: dict(config.flags) for config in session.configs})
        return self._header

    def write_results(self) -> None:
        """The recorded lines, those read at opening included: a results file is rewritten only with
        every line it held (it is left as it is when they could not be merged, see `open`)."""
        if self.lines and self.results_kept_as_they_are is None:
            write_results(self.results_path, self.header(), [self.lines[index] for index in sorted(self.lines)])

    def save_as(self, path: str | os.PathLike) -> Path:
        """ctrl+s: the session and its results under the new name; autosaves go there from now on.
        Both paths are checked first: a refused save changes nothing (files, recorder, path)."""
        from inspector.output_paths import check_output_path

        path = Path(path)
        check_output_path(path, "the session file", protect={"the current results file": self.results_path})
        check_output_path(results_path_for(path), "its results file", protect={"the session file": path})
        saved = self.recorder.save_as(path)
        self.results_kept_as_they_are = None  # the new name's results hold this session's lines only
        self.write_results()
        return saved
