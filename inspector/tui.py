"""`moe-inspector` with no subcommand: resolve the flags, load the engine, run the TUI.

A bad `--set` value or an unknown model/device is reported before the screen is taken over
(exit 2), never as a traceback inside the app.
"""

from __future__ import annotations

import sys
import warnings

from engine import flags as flag_registry
from engine.config import from_name
from engine.errors import UserError
from engine.runtime import Engine


def launch(args) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flags = flag_registry.resolve(args.set_flags)
        from_name(args.model)  # an unknown model is refused before anything is loaded
        print(f"moe-inspector: loading model {args.model} (device {args.device}) …", file=sys.stderr, flush=True)
        engine = Engine.load(args.model, args.device, args.seed)
    except UserError as error:
        print(f"moe-inspector: error: {error}", file=sys.stderr)
        return error.exit_code
    notes = [str(warning.message) for warning in caught]
    if getattr(args, "session", None):
        notes.append(f"--session {args.session}: the TUI does not record into sessions in this build; "
                     f"run the file headless with `moe-inspector run {args.session}`")

    from inspector.app import InspectorApp  # textual is imported only once the engine is ready

    # `--sweep FILE` (optional) preloads the tile-fill screen's µs-per-arm plot.
    app = InspectorApp(engine, flags, startup_notes=notes, sweep_path=getattr(args, "sweep", None))
    app.run()
    return app.return_code or 0
