"""Record what the user does in the TUI into a session file, saved atomically after every action.

    recorder = SessionRecorder(path, {"model": "demo", "device": "auto", "seed": 0}, resolved_flags)
    recorder.append({"action": "prompt", "prompt": "hi", "max_tokens": 8, "flags": {...},
                     "compare": {"name": "B", "flags": {...}}})   # -> a [[step]], saved
    recorder.append({"action": "flag", "name": "fused_mask", "value": "drop"})
    recorder.save_as("sessions/mine.toml")
    recorder = SessionRecorder.load("sessions/mine.toml")

How actions become the format (see `inspector.session`):
- `prompt`: a prompt step. Its `flags` (the flags the run used; missing ones are the recorder's
  current flags) become `config = ...` when they differ from [flags]; `compare` (a dict with
  `name` and `flags`, missing flags taken from side A, or a string naming a defined config)
  becomes `compare = ...`. A config is created per distinct set of differences from [flags],
  reused when the same differences recur, and named by the TUI's name unless that is a pane
  label (A, B), else after its differences (`fused_mask=drop`).
- `compare`: a compare step; `a` and `b` are dicts like prompt's `compare`.
- `flag` (`name` or `flag`, `value`, optionally `flags`: the whole state after the change): not
  a step. Before the first step it edits [flags] (the starting state, saved); afterwards it
  changes the recorder's current flags, which the next step records as its config.
- `config` (configuration B edited): not a step; the next prompt's `compare` carries B.
- `curve`, `sweep`, `check-attention`: the step of the same name from the payload's format keys;
  curve's tile_m and check-attention's mode default to the current flags.
Payload keys outside these are ignored, so the TUI may pass its results along. Every appended
step is validated by the session parser before it is saved: a saved file always loads.

The user's file is kept: a session opened from a file is saved by appending the new [[config]]
and [[step]] tables to its text as it is (TOML lets an array of tables continue anywhere), and a
change of [flags] before the first step edits that table through tomlkit, so comments, blank
lines and key order survive. Every text written is parsed back and must equal the session in
memory, or nothing is written (an inline `step = [...]` array cannot be extended that way: the
save is refused and the file left as it was). A refused or failed save changes nothing: not the
file, not the session in memory, not the path later saves go to.

Thread-safe (one lock), no textual import: the TUI calls it from its `record_action` hook.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
from pathlib import Path
from typing import Any, Mapping

from engine import flags as flag_registry
from engine.errors import UserError
from engine.atomic_file import atomic_write_text
from engine.printable import printable
from inspector.session import (BASE, BenchStep, CheckAttentionStep, CompareStep, Config, CurveStep, EngineSpec, PromptStep,
                               Session, Step, SweepStep, config_to_plain, dumps_session, load_session, loads_session,
                               parse_session, render_table, session_to_plain, step_keys, step_to_plain)

PANE_LABELS = {"a", "b"}  # TUI pane names, which say nothing once saved


def default_session_path(directory: str | os.PathLike | None = None) -> Path:
    """Where the TUI autosaves when no --session was given: $MOEI_SESSION_DIR, else
    ~/.local/share/moe-inspector/sessions, with a timestamped name."""
    base = Path(directory or os.environ.get("MOEI_SESSION_DIR")
                or Path.home() / ".local" / "share" / "moe-inspector" / "sessions")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return base / f"session-{stamp}.toml"


def _flag_values(flags: Any, where: str) -> dict[str, Any]:
    values = flags.values if isinstance(flags, flag_registry.ResolvedFlags) else (flags or {})
    if not isinstance(values, Mapping):
        raise UserError(f"{where}: flags must be a mapping of flag name to value, got {type(values).__name__}")
    return {name: flag_registry.parse_value(name, value, where) for name, value in values.items()}


class SessionRecorder:
    """A session being recorded; every change is saved atomically to `path`."""

    def __init__(self, path: str | os.PathLike, engine_info: Mapping[str, Any],
                 flags: flag_registry.ResolvedFlags | Mapping[str, Any] | None = None, *,
                 name: str | None = None, description: str | None = None) -> None:
        self.path = Path(path)
        unknown = set(engine_info) - {"model", "device", "seed", "weights"}
        if unknown or "model" not in engine_info:
            raise UserError(f"engine_info needs model (and optionally device, seed), got {sorted(engine_info)}")
        engine = EngineSpec(model=str(engine_info["model"]), device=str(engine_info.get("device", "auto")),
                            seed=int(engine_info.get("seed", 0)), weights=str(engine_info.get("weights", "auto")))
        starting = _flag_values(flags, "the recorder's starting flags")
        # A file name may hold characters a session name may not (the parser refuses control characters).
        self._session = Session(name=name or printable(self.path.stem, limit=80), description=description,
                                engine=engine, flags=starting)
        self.current_flags: dict[str, Any] = dict(starting)  # the TUI's flag state now
        self._lock = threading.Lock()
        self._text: str | None = None  # the file's text as last read or written; None: not written yet

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SessionRecorder":
        """Continue recording into an existing session; current flags are those of its last step."""
        session = load_session(path)
        recorder = cls.__new__(cls)
        recorder.path = Path(path)
        recorder._session = session
        recorder._lock = threading.Lock()
        recorder._text = Path(path).read_text(encoding="utf-8")  # what load_session just parsed
        last_config = None  # the configuration of the last generation (side A)
        for step in reversed(session.steps):
            if isinstance(step, (PromptStep, CompareStep)):
                last_config = step.config if isinstance(step, PromptStep) else step.a
                break
        recorder.current_flags = session.config_flags(last_config)
        return recorder

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, engine_info: Mapping[str, Any],
                       flags: flag_registry.ResolvedFlags | Mapping[str, Any] | None = None) -> "SessionRecorder":
        """`--session FILE`: continue it if it exists, else start it (nothing is written until an action)."""
        return cls.load(path) if Path(path).exists() else cls(path, engine_info, flags)

    @property
    def session(self) -> Session:
        return self._session

    @property
    def steps(self) -> tuple[Step, ...]:
        return self._session.steps

    # ----------------------------------------------------------------------------------------
    # Saving
    # ----------------------------------------------------------------------------------------

    def save(self) -> Path:
        with self._lock:
            self._write(self._session, self.path)
            return self.path

    def save_as(self, path: str | os.PathLike) -> Path:
        """Save to `path` and keep autosaving there (ctrl+s); when the write fails, autosaves keep
        going where they went before."""
        with self._lock:
            path = Path(path)
            self._write(self._session, path)
            self.path = path
            return path

    def _text_for(self, session: Session) -> str:
        """The file's text holding `session`: the text as it was plus what changed, or, for a session
        never written, the writer's own layout."""
        if self._text is None:
            return dumps_session(session)
        old, text = self._session, self._text
        if session.flags != old.flags:
            text = _with_flags(text, session.flags)
        chunks = [render_table("[[config]]", config_to_plain(config)) for config in session.configs[len(old.configs):]]
        chunks += [render_table("[[step]]", step_to_plain(step)) for step in session.steps[len(old.steps):]]
        if chunks:
            text = text + ("" if text.endswith("\n") or not text else "\n") + "".join("\n" + chunk for chunk in chunks)
        return text

    def _write(self, session: Session, path: Path) -> None:
        """Write `session` to `path`, keeping the file's text; nothing is written unless the text reads
        back as exactly `session`."""
        text = self._text_for(session)
        if loads_session(text, str(path)) != session:
            raise UserError(f"{path}: the session cannot be saved without rewriting the file's own layout (an "
                            f"inline array of steps or configs?); the file is left as it was: save the session under "
                            f"a new name (ctrl+s) to continue recording")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        self._text = text

    # ----------------------------------------------------------------------------------------
    # Recording
    # ----------------------------------------------------------------------------------------

    def append(self, action: Mapping[str, Any]) -> Step | None:
        """Record one TUI action and autosave; returns the step added (None for a flag change)."""
        with self._lock:
            kind = action.get("action")
            where = f"recorded action {kind!r}"
            if kind == "flag":
                return self._flag(action, where)
            if kind == "config":  # configuration B edited: the next prompt's compare carries it
                return None
            builders = {"prompt": self._prompt, "compare": self._compare, "curve": self._curve,
                        "sweep": self._sweep, "check-attention": self._check_attention, "bench": self._bench}
            if kind not in builders:
                raise UserError(f"recorded action {kind!r} is not one of flag, {', '.join(builders)}")
            configs = list(self._session.configs)
            step_table = builders[kind](action, where, configs)
            candidate = dataclasses.replace(self._session, configs=tuple(configs))
            plain = session_to_plain(candidate)
            plain.setdefault("step", []).append(step_table)
            # Through the parser, so what is saved is exactly what `run` will read back.
            session = parse_session(plain, f"{self.path}: {where}")
            self._write(session, self.path)
            self._session = session
            return session.steps[-1]

    def _flag(self, action: Mapping[str, Any], where: str) -> None:
        name = action.get("name", action.get("flag"))
        if name is None or "value" not in action:
            raise UserError(f"{where}: needs the flag's name (name or flag) and value")
        value = flag_registry.parse_value(name, action["value"], where)
        if action.get("flags") is not None:  # the TUI's whole flag state after the change
            self.current_flags.update(_flag_values(action["flags"], where))
        self.current_flags[name] = value
        if not self._session.steps:  # still the starting state: it belongs in [flags]
            session = dataclasses.replace(self._session, flags={**self._session.flags, name: value})
            self._write(session, self.path)
            self._session = session
        return None

    def _effective(self, flags: Any, over: Mapping[str, Any], where: str) -> dict[str, Any]:
        return {**over, **_flag_values(flags, where)}

    def _base_value(self, name: str) -> Any:
        """A flag's value in the session's base configuration: its [flags] entry, else the flag's default (an opened
        session lists only the flags it sets; comparing with those alone made every default an override)."""
        return self._session.flags.get(name, flag_registry.SPECS[name].default)

    def _config_name(self, effective: Mapping[str, Any], preferred: str | None, configs: list[Config]) -> str:
        """The config holding `effective`'s differences from [flags] (BASE when none), created if new."""
        overrides = {name: effective[name] for name in flag_registry.SPECS
                     if name in effective and self._base_value(name) != effective[name]}
        if not overrides:
            return BASE
        for config in configs:
            if dict(config.flags) == overrides:
                return config.name
        described = ",".join(f"{name}={flag_registry.format_value(name, value)}" for name, value in overrides.items())
        name = (preferred if preferred and preferred.lower() not in PANE_LABELS and preferred != BASE
                else described if len(described) <= 48 else f"config-{len(configs) + 1}")
        taken = {config.name for config in configs} | {BASE}
        unique, suffix = name, 2
        while unique in taken:
            unique, suffix = f"{name}-{suffix}", suffix + 1
        configs.append(Config(unique, overrides))
        return unique

    def _side(self, side: Any, over: Mapping[str, Any], where: str, configs: list[Config]) -> tuple[str, dict]:
        """A side given as a config name, or as {"name", "flags"}: its config name and effective flags."""
        if isinstance(side, str):
            if side not in [BASE] + [config.name for config in configs]:
                raise UserError(f"{where}: config {side!r} is not defined in this session")
            overrides = next((dict(config.flags) for config in configs if config.name == side), {})
            return side, {**self._session.flags, **overrides}
        if not isinstance(side, Mapping):
            raise UserError(f"{where}: a side is a config name or {{'name': ..., 'flags': {{...}}}}")
        effective = self._effective(side.get("flags"), over, where)
        return self._config_name(effective, side.get("name"), configs), effective

    @staticmethod
    def _pick(action: Mapping[str, Any], cls: type, drop: tuple[str, ...] = ()) -> dict[str, Any]:
        return {key: list(action[key]) if isinstance(action[key], tuple) else action[key]
                for key in step_keys(cls) if key in action and key not in drop and action[key] is not None}

    def _prompt(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        table = {"action": "prompt", **self._pick(action, PromptStep, drop=("config", "compare"))}
        effective_a = self._effective(action.get("flags"), self.current_flags, where)
        name_a = self._config_name(effective_a, action.get("name"), configs)
        if name_a != BASE:
            table["config"] = name_a
        if action.get("compare") is not None:
            table["compare"], _ = self._side(action["compare"], effective_a, where, configs)
        elif "expect_match" in table:
            del table["expect_match"]  # nothing to check without a second configuration
        self.current_flags = effective_a
        return _ordered(table, PromptStep)

    def _compare(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        if "a" not in action or "b" not in action:
            raise UserError(f"{where}: needs a and b (config names or {{'name', 'flags'}})")
        table = {"action": "compare", **self._pick(action, CompareStep, drop=("a", "b"))}
        table["a"], effective_a = self._side(action["a"], self.current_flags, where, configs)
        table["b"], _ = self._side(action["b"], effective_a, where, configs)
        self.current_flags = effective_a  # A is the TUI's flags, as a prompt step's
        return _ordered(table, CompareStep)

    def _curve(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        table = {"action": "curve", **self._pick(action, CurveStep, drop=("config",))}
        if "tile_m" not in table and "tile_m" in self.current_flags \
                and self._base_value("tile_m") != self.current_flags["tile_m"]:
            table["tile_m"] = self.current_flags["tile_m"]
        return _ordered(table, CurveStep)

    def _sweep(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        table = {"action": "sweep", **self._pick(action, SweepStep, drop=("config",))}
        name = self._config_name(self.current_flags, None, configs)
        if name != BASE:
            table["config"] = name
        return _ordered(table, SweepStep)

    def _check_attention(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        table = {"action": "check-attention", **self._pick(action, CheckAttentionStep)}
        if isinstance(table.get("dtype"), str):  # the TUI passes str(torch.float32)
            table["dtype"] = table["dtype"].removeprefix("torch.")
        table.setdefault("mode", self.current_flags.get("fused_mask", flag_registry.SPECS["fused_mask"].default))
        return _ordered(table, CheckAttentionStep)


    def _bench(self, action: Mapping[str, Any], where: str, configs: list[Config]) -> dict:
        table = {"action": "bench", **self._pick(action, BenchStep, drop=("config",))}
        effective = self._effective(action.get("flags"), self.current_flags, where)
        name = self._config_name(effective, action.get("name"), configs)
        if name != BASE:
            table["config"] = name
        self.current_flags = effective
        return _ordered(table, BenchStep)


def _with_flags(text: str, flags: Mapping[str, Any]) -> str:
    """`text` with its [flags] table holding `flags`: values changed in place, new keys after the
    table's last key, so comments stay where they were (tomlkit keeps the rest of the text as is)."""
    import tomlkit

    document = tomlkit.parse(text)
    if "flags" not in document:
        document["flags"] = tomlkit.table()
    table = document["flags"]
    for name in list(table.keys()):
        if name not in flags:
            del table[name]
    for name, value in flags.items():
        if name in table:
            if table[name] != value:
                table[name] = value
            continue
        keys = list(table.keys())
        try:  # after the last key, not after a comment that trails the table (tomlkit's add does that)
            table.value._insert_after(keys[-1], name, tomlkit.item(value)) if keys else table.add(name, value)
        except (AttributeError, TypeError, KeyError):  # a tomlkit without the private method
            table[name] = value
    return tomlkit.dumps(document)


def _ordered(table: dict, cls: type) -> dict:
    """Keys in format order (the parser does not care; people reading the file do)."""
    return {"action": table["action"], **{key: table[key] for key in step_keys(cls) if key in table}}
