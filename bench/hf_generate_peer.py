"""transformers' own `generate` on a checkpoint directory's shape with random weights: the figure a user would
set beside `moe-inspector bench` for the same model, prompt length and token count.

    python bench/hf_generate_peer.py --model bench/configs/qwen3-30b-a3b --tokens 128 --prompt 32 --out peer.json

The model is built from config.json on the GPU in bf16 (no weights read: the timing does not depend on their
values), the prompt is `--prompt` random token ids, and generation is greedy with `min_new_tokens` =
`max_new_tokens` so every run decodes the same count. One warm-up, then `--reps` timed runs (CUDA synchronized
around each); tokens/s counts the generated tokens over the whole call, prefill included, and the decode-only
rate subtracts a separately timed one-token call (the prefill and the first token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a directory holding config.json")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    import transformers

    config = transformers.AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device=args.device)

    def generate(count: int) -> float:
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=count, min_new_tokens=count, pad_token_id=0)
        sync()
        assert out.shape[1] == args.prompt + count
        return time.perf_counter() - started

    generate(min(args.tokens, 8))  # warm-up
    whole = [generate(args.tokens) for _ in range(args.reps)]
    first = [generate(1) for _ in range(args.reps)]
    decode_s = statistics.median(whole) - statistics.median(first)
    result = {
        "model": str(args.model), "transformers": transformers.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "batch": args.batch, "prompt_tokens": args.prompt,
        "generated_tokens": args.tokens, "whole_s": whole, "first_token_s": first,
        "tokens_per_s": args.batch * args.tokens / statistics.median(whole),
        "decode_tokens_per_s": args.batch * (args.tokens - 1) / decode_s,
        "experts_implementation": getattr(config, "experts_implementation", None),
        "attn_implementation": getattr(config, "_attn_implementation", None),
    }
    print(f"transformers {transformers.__version__} generate, {config.model_type} {config.num_hidden_layers} layers, "
          f"b{args.batch}, prompt {args.prompt}, {args.tokens} tokens: {result['tokens_per_s']:.1f} t/s whole call, "
          f"{result['decode_tokens_per_s']:.1f} t/s decode ({1e3 / result['decode_tokens_per_s'] * args.batch:.2f} ms "
          f"per step); attention {result['attn_implementation']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
