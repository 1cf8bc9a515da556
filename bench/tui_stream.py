"""The TUI's own generation path, driven headless (Textual's run_test, no terminal) on a model, and the rate it
streams tokens at: what a user watching the TUI gets, against the bench's rate for the same model.

    python bench/tui_stream.py --model bench/configs/qwen3-30b-a3b --weights random --tokens 128 --out r.json

The prompt runs twice through configuration A and B (B = A with grouped_variant=1, the same arms at decode, so
neither side pays the reference arms); the first run compiles and captures, the second is measured. The rate
is side A's decode tokens over the time from its first decode step's end to its last one's, from the step
records the TUI received (the engine's own clocks, the UI's event loop running beside it), and its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import flags as flag_registry  # noqa: E402
from engine.runtime import Engine  # noqa: E402


def decode_rate(generation) -> tuple[float, int]:
    decode = [step for step in generation.steps if step["phase"] == "decode"]
    seconds = decode[-1]["ended"] - decode[0]["ended"]
    return (len(decode) - 1) / seconds, len(decode)


async def drive(engine: Engine, prompt: str, tokens: int) -> list[dict]:
    from inspector import events
    from inspector.app import InspectorApp

    app = InspectorApp(engine, flag_registry.resolve([], environ={}), b_overrides={"grouped_variant": 1})
    runs = []
    finished: dict[str, object] = {}

    def hook(message) -> None:  # every message the app posts: the sides' ends among them
        if isinstance(message, events.SideFinished):
            finished[message.side] = message

    async with app.run_test(size=(200, 50), message_hook=hook) as pilot:
        for _ in range(2):
            finished.clear()
            main = app.main_screen
            started = time.perf_counter()
            assert main.start_run(prompt, str(tokens)), "the TUI refused the prompt"
            while main.current_run is None or main.current_run.running:
                await pilot.pause(0.05)
            await pilot.pause()
            side_a = finished[events.A]
            rate, steps = decode_rate(side_a.generation)
            runs.append({"wall_s": time.perf_counter() - started, "side_a_wall_s": side_a.wall_s,
                         "side_a_decode_tokens_per_s": rate, "side_a_decode_steps": steps,
                         "graphs": side_a.generation.graphs, "decode_glue": side_a.generation.decode_glue,
                         "layer_timing": side_a.generation.layer_timing})
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = Engine.load(args.model, args.device, 0, args.weights)
    prompt = "The grouped kernel sorts the pairs by expert and walks them in tiles, while the GEMV reads each"
    runs = asyncio.run(drive(engine, prompt, args.tokens))
    measured = runs[-1]
    print(f"TUI on {engine.config.name} ({engine.device_label}): side A streamed {measured['side_a_decode_steps']} "
          f"decode steps at {measured['side_a_decode_tokens_per_s']:.1f} tokens/s "
          f"({1e3 / measured['side_a_decode_tokens_per_s']:.3f} ms/token); graphs {measured['graphs']}; "
          f"decode glue {measured['decode_glue']}; first run (compile, capture) "
          f"{runs[0]['side_a_decode_tokens_per_s']:.1f} tokens/s")
    print(f"layer timing: {measured['layer_timing']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": engine.config.name, "runs": runs,
                                              "median_rate": statistics.median(r["side_a_decode_tokens_per_s"]
                                                                               for r in runs)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
