"""A session step's routing file: `[[step]] action = "sweep" routing = "FILE"`, a recording (engine.routing_file)
whose path is taken from the session file's directory, so a calibration or a kernel comparison on real routing
replays exactly. Checked before any step runs (`preflight`: the file reads and matches the session's model) and
handed to the sweep (inspector.session_steps.SweepAction); the results line carries the file's sha256 (engine.sweep's
"routing").

Knows nothing of how steps are registered or reported.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import UserError


def routing_path(step, where: str) -> Path | None:
    """The step's routing file (None without one), a relative path taken from the session file's directory."""
    text = getattr(step, "routing", None)
    if not text:
        return None
    path = Path(text).expanduser()
    return path if path.is_absolute() else Path(where).resolve().parent / path


def preflight(here: str, step, where: str, model) -> None:
    """The routing file reads and was recorded on `model`'s routing shape; a UserError naming the step if not."""
    path = routing_path(step, where)
    if path is None:
        return
    from engine import routing_file

    try:
        routing_file.check_model(routing_file.load(path), model, path, model.name)
    except UserError as error:
        raise UserError(f"{here}: routing = {step.routing!r}: {error}") from None
