"""Train the embedded `demo` checkpoint: plain torch, text that ships with every Python.

    python3 train/train_demo.py --minutes 4 --out engine/weights/demo/model.safetensors

Data: the English documentation in `pydoc_data/topics.py` plus standard-library sources (a
fixed, sorted list of top-level modules), byte-level. The script records what it trained on
(file list, byte counts, sha256 of the corpus, Python version), the steps, the loss curve and
the seed into the checkpoint's metadata and a JSON log beside it, so the run can be reproduced.

The architecture is exactly the `demo` preset's (head_dim 512 with learned sinks, the composite
mask on even layers, 64 experts top-6), so every flag of the inspector acts on the result. The
forward below is the engine's math written for a batch of training windows; a CPU test checks
that it gives the engine's logits on the same weights (tests/test_train_demo.py).

Knows nothing of screens or sessions; needs torch and safetensors only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import ModelConfig, from_name  # noqa: E402
from engine.model import apply_rope, random_weights, rms_norm, rope_tables  # noqa: E402
from kernels.reference import MaskSpec, visible_mask  # noqa: E402

STDLIB_BYTES = 2_000_000  # how much standard-library source joins the documentation


def corpus() -> tuple[bytes, dict]:
    """The training text and a record of exactly what it is."""
    import pydoc_data.topics as topics

    parts = [f"{name}\n{'=' * len(name)}\n\n{text}\n\n" for name, text in sorted(topics.topics.items())]
    documentation = "".join(parts).encode("utf-8")
    library = Path(sysconfig.get_paths()["stdlib"])
    sources, used = [], []
    total = 0
    for path in sorted(library.glob("*.py")):
        data = path.read_bytes()
        if total + len(data) > STDLIB_BYTES:
            continue
        sources.append(b"# file: " + path.name.encode() + b"\n" + data + b"\n")
        used.append(path.name)
        total += len(data)
    text = documentation + b"".join(sources)
    record = {
        "python": sys.version.split()[0], "documentation_bytes": len(documentation),
        "stdlib_files": used, "stdlib_bytes": total, "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest(),
    }
    return text, record


def attention_batch(q, k, v, sinks, visible):
    """q [B,T,Hq,hd], k/v [B,T,Hkv,hd], sinks [Hq], visible [T,T] -> [B,T,Hq,hd]; the engine's
    reference semantics (fp32 scores, the sink as an extra column) for a batch of windows."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2).float()  # [B, Hq, T, hd]
    kh = k.transpose(1, 2).float().repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).float().repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, Hq, T, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ vh).transpose(1, 2).to(q.dtype)


def experts_batch(h, w13, w2, ids, weights):
    """The reference MoE arm's math, differentiable: h [N,D], ids/weights [N,k] -> [N,D]."""
    out = torch.zeros_like(h, dtype=torch.float32)
    f = w13.shape[1] // 2
    flat_ids = ids.reshape(-1)
    flat_tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(ids.shape[1])
    flat_weights = weights.reshape(-1)
    order = torch.argsort(flat_ids)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            pairs = order[start:start + count]
            tokens = flat_tokens[pairs]
            gate_up = h[tokens] @ w13[expert].t()
            hidden = F.silu(gate_up[:, :f]) * gate_up[:, f:]
            out = out.index_add(0, tokens, ((hidden @ w2[expert].t()) * flat_weights[pairs, None]).float())
        start += count
    return out.to(h.dtype)


def forward_batch(config: ModelConfig, weights: dict, tokens: torch.Tensor, visibles: list[torch.Tensor]):
    """tokens [B, T] -> logits [B, T, V] and the router's load-balancing loss."""
    c = config
    batch, steps = tokens.shape
    x = weights["embed"][tokens]
    cos, sin = rope_tables(c, torch.arange(steps, device=tokens.device))
    balance = 0.0
    for layer in range(c.n_layers):
        p = f"layers.{layer}."
        h = rms_norm(x, weights[p + "attn_norm"], c.norm_eps)
        q = apply_rope((h @ weights[p + "wq"].t()).view(batch, steps, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope((h @ weights[p + "wk"].t()).view(batch, steps, c.n_kv_heads, c.head_dim), cos, sin)
        v = (h @ weights[p + "wv"].t()).view(batch, steps, c.n_kv_heads, c.head_dim)
        attended = attention_batch(q, k, v, weights[p + "sinks"], visibles[layer])
        x = x + attended.reshape(batch, steps, -1) @ weights[p + "wo"].t()
        h = rms_norm(x, weights[p + "moe_norm"], c.norm_eps).reshape(batch * steps, c.hidden)
        logits = h.float() @ weights[p + "router"].float().t()  # [N, E]
        top_logits, top_ids = torch.topk(logits, c.top_k, dim=-1)
        routed = experts_batch(h, weights[p + "w13"], weights[p + "w2"], top_ids,
                               torch.softmax(top_logits, dim=-1).to(h.dtype))
        x = x + routed.view(batch, steps, c.hidden)
        # Switch-style balance: fraction of pairs per expert times mean router probability.
        fraction = torch.bincount(top_ids.reshape(-1), minlength=c.n_experts).float() / top_ids.numel()
        balance = balance + c.n_experts * (fraction * torch.softmax(logits, dim=-1).mean(0)).sum()
    x = rms_norm(x, weights["norm"], c.norm_eps)
    return x.float() @ weights["lm_head"].float().t(), balance / c.n_layers


def layer_visibility(config: ModelConfig, steps: int, device) -> list[torch.Tensor]:
    positions = torch.arange(steps, device=device)
    return [visible_mask(MaskSpec(mask.kind, mask.window, mask.block), positions, positions)
            for mask in config.layer_masks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget for the training loop")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512, help="longer than the demo window, so the mask matters")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balance-weight", type=float, default=0.01)
    parser.add_argument("--out", default="engine/weights/demo/model.safetensors")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    config = from_name("demo")
    text, data_record = corpus()
    data = torch.tensor(list(text), dtype=torch.long)
    split = int(len(data) * 0.98)
    train, validation = data[:split].to(device), data[split:].to(device)
    weights = {name: tensor.float().to(device).requires_grad_(True)
               for name, tensor in random_weights(config, args.seed, torch.device("cpu"), torch.float32).items()}
    optimizer = torch.optim.AdamW(weights.values(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    visibles = layer_visibility(config, args.seq_len, device)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)

    def windows(source: torch.Tensor, count: int) -> torch.Tensor:
        starts = torch.randint(0, len(source) - args.seq_len - 1, (count,), generator=generator).to(device)
        return source[starts[:, None] + offsets[None, :]]

    def loss_on(batch: torch.Tensor):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, balance = forward_batch(config, weights, batch[:, :-1], visibles)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        return loss, balance

    curve, started, step = [], time.time(), 0
    budget = args.minutes * 60
    warmup = 100
    while step < args.max_steps and time.time() - started < budget:
        progress = (time.time() - started) / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, balance = loss_on(windows(train, args.batch))
        optimizer.zero_grad(set_to_none=True)
        (loss + args.balance_weight * balance).backward()
        torch.nn.utils.clip_grad_norm_(weights.values(), 1.0)
        optimizer.step()
        if step % 50 == 0:
            with torch.no_grad():
                validation_loss, _ = loss_on(windows(validation, 8))
            curve.append({"step": step, "seconds": round(time.time() - started, 1), "train_loss": round(loss.item(), 4),
                          "validation_loss": round(validation_loss.item(), 4), "balance": round(float(balance), 4),
                          "lr": round(lr, 6)})
            print(json.dumps(curve[-1]), flush=True)
        step += 1

    record = {
        "preset": config.name, "seed": args.seed, "steps": step, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "balance_weight": args.balance_weight, "minutes": args.minutes,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "data": data_record, "loss_curve": curve,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().to(torch.bfloat16).cpu().contiguous() for name, tensor in weights.items()}
    save_file(tensors, str(out), metadata={"moe_inspector": json.dumps({"preset": config.name}),
                                           "training": json.dumps(record)})
    (out.parent / "training.json").write_text(json.dumps(record, indent=2))
    print(f"saved {out} ({os.path.getsize(out) / 1e6:.2f} MB) after {step} steps; "
          f"last validation loss {curve[-1]['validation_loss'] if curve else 'n/a'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
