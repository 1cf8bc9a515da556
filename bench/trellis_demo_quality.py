"""The trained demo with trellis-coded experts beside its bf16 self: validation loss and greedy text.

    python -m inspector quantize demo --experts trellis:K=2,code=hyb --out /tmp/demo-hyb2   # once
    python bench/trellis_demo_quality.py /tmp/demo-hyb2 [--windows 16] [--device cpu]

Validation loss is train/train_demo.py's: cross-entropy in nats per byte of next-byte prediction over
windows of 512 bytes drawn from the last 2 % of its corpus (the documentation in pydoc_data plus standard-
library sources; the corpus depends on the Python that runs this, its sha256 is printed beside the one the
checkpoint was trained on). Here the windows come from a fixed generator and both models see the same ones,
in float32 on the device, through train_demo's own forward (`forward_batch`); the trellis model's experts
are dequantized (kernels.trellis_reference.dequantize), which is what its reference arm computes. Greedy
text: the README's two prompts through `Engine.generate` of each model, 80 tokens at temperature 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import flags  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from engine.shipped import training_record  # noqa: E402
from kernels.trellis_reference import TrellisMatrix, dequantize  # noqa: E402
from train.train_demo import corpus, forward_batch, layer_visibility  # noqa: E402

PROMPTS = ("def __init__(self", "The if statement is used for conditional execution")


def validation_windows(count: int, seq_len: int, seed: int) -> tuple[torch.Tensor, dict]:
    text, record = corpus()
    data = torch.tensor(list(text), dtype=torch.long)
    validation = data[int(len(data) * 0.98):]  # train_demo's split
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(validation) - seq_len - 1, (count,), generator=generator)
    return validation[starts[:, None] + torch.arange(seq_len + 1)[None, :]], record


@torch.no_grad()
def validation_loss(engine: Engine, windows: torch.Tensor, chunk: int = 4) -> float:
    """Mean next-byte cross-entropy (nats) over the windows, float32, experts dequantized where coded."""
    weights = {name: (dequantize(value) if isinstance(value, TrellisMatrix) else value.float())
               for name, value in engine.weights.items()}
    visibles = layer_visibility(engine.config, windows.shape[1] - 1, engine.device)
    total, count = 0.0, 0
    for begin in range(0, windows.shape[0], chunk):
        batch = windows[begin:begin + chunk].to(engine.device)
        logits, _ = forward_batch(engine.config, weights, batch[:, :-1], visibles)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1),
                                       reduction="sum"))
        count += batch[:, 1:].numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a trellis checkpoint directory of the demo (moe-inspector quantize demo ...)")
    parser.add_argument("--windows", type=int, default=16, help="validation windows of --seq-len bytes (default 16)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234, help="seed of the windows' positions")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    windows, record = validation_windows(args.windows, args.seq_len, args.seed)
    trained_on = (training_record("demo") or {}).get("data", {}).get("sha256")
    models = {"bf16": Engine.load("demo", device=args.device), "trellis": Engine.load(args.checkpoint, device=args.device)}
    if not isinstance(models["trellis"].weights["layers.0.w13"], TrellisMatrix):
        parser.error(f"{args.checkpoint}: its experts are not trellis-coded")
    resolved = flags.resolve([])
    result = {"checkpoint": args.checkpoint, "format": models["trellis"].weights["layers.0.w13"].code.describe(),
              "windows": args.windows, "seq_len": args.seq_len, "seed": args.seed, "device": args.device,
              "corpus_sha256": record["sha256"], "trained_on_sha256": trained_on, "models": {}}
    for label, engine in models.items():
        loss = validation_loss(engine, windows)
        texts = {prompt: engine.generate(prompt, args.max_tokens, resolved, timed=False).text for prompt in PROMPTS}
        result["models"][label] = {"validation_loss": loss, "weights": engine.weights_source, "greedy": texts}
    result["seconds"] = round(time.perf_counter() - began, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    same = "the same corpus" if record["sha256"] == trained_on else "another Python's corpus than the training run's"
    print(f"demo validation loss, {args.windows} windows of {args.seq_len} bytes (seed {args.seed}, {same}), "
          f"nats per byte, {args.device}:")
    for label, item in result["models"].items():
        print(f"  {label:<8} {item['validation_loss']:.4f}   ({item['weights']})")
    delta = result["models"]["trellis"]["validation_loss"] - result["models"]["bf16"]["validation_loss"]
    print(f"  trellis - bf16 = {delta:+.4f} ({result['format']})")
    for prompt in PROMPTS:
        print(f"\n$ generate --prompt {prompt!r} --max-tokens {args.max_tokens}")
        for label, item in result["models"].items():
            print(f"  {label:<8} {item['greedy'][prompt]!r}")
    print(f"\n{result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
