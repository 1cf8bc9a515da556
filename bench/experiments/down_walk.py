"""Down's walk with several tiles in one load (kernels.moe_gemv DOWN_TILES) on an H200, at the narrow models where
one token launches few down programs (Qwen3-30B-A3B: D 2048, F 768, E 128, top-8; DeepSeek-V2-Lite: D 2048,
F 1408, E 64, top-6, its two shared experts folded in as shared_fold=on runs them), v4-shape (D 4096, F 2048,
E 256, top-6) for comparison.

Part 1, the arm: each candidate (BLOCK_D, DOWN_BLOCK_F, TILES) checked against the reference, then both
kernels timed replayed 10 calls to a CUDA graph, beside the bandwidth bound of the bytes read (copy bandwidth
measured in this run); with --baseline FILE (another revision's kernels/moe_gemv.py, e.g. `git show
REV:kernels/moe_gemv.py`), that module's arm at its own table first. Part 2 (--steps), the step: the bench's tg128
@ b1 row of the Qwen3 and V2-Lite shapes (random weights drawn on the GPU from bench/configs) with the baseline's
kernels, at the arm's two best candidates, and with the baseline again (the drift); v4-shape with the baseline,
this tree's table, and both again. Each row in its own process, the module constants set before the run.

    python3 bench/experiments/down_walk.py [--baseline FILE] [--steps] [--shapes qwen3,dsv2,v4]
                                                                    # JSON to $OUT/down_walk.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.bench import copy_bandwidth, graph_call_us  # noqa: E402
from engine.provenance import commit_label  # noqa: E402
from kernels import moe_gemv  # noqa: E402
from kernels.reference import moe_reference  # noqa: E402

SHAPES = {"qwen3": (2048, 768, 128, 8, 0), "dsv2": (2048, 1408, 64, 6, 2816), "v4": (4096, 2048, 256, 6, 0)}
CONFIGS = {"qwen3": "bench/configs/qwen3-30b-a3b", "dsv2": "bench/configs/deepseek-v2-lite"}
# (BLOCK_D, DOWN_BLOCK_F, TILES, warps) as the narrow schedule's; the first is the one-tile walk at DOWN_BLOCK_D
CANDIDATES = [(8, 1024, 1, 4), (4, 1024, 4, 4), (4, 1024, 4, 8), (8, 1024, 4, 8), (4, 1024, 8, 8), (8, 1024, 2, 8),
              (2, 1024, 8, 4), (4, 512, 8, 8), (8, 512, 4, 8), (8, 1024, 2, 4)]
# run 66, at 4 warps: (8, 1024, 2), (4, 1024, 2), (8, 512, 2), (8, 512, 4), (8, 256, 4), (16, 512, 2), (16, 256, 4),
# (4, 512, 4), (2, 1024, 4) all behind (4, 1024, 4)
FIELDS = ("NARROW_DOWN_BLOCK_D", "DOWN_BLOCK_F", "DOWN_TILES", "NARROW_DOWN_WARPS")


def _set(candidate) -> None:
    for field, value in zip(FIELDS, candidate):
        setattr(moe_gemv, field, value)
    moe_gemv.MIN_DOWN_PROGRAMS = 1 << 30  # the narrow schedule at every shape: exactly these blocks


def load_baseline(path: str):
    """Another revision's kernels/moe_gemv.py as its own module (its imports resolve to this tree's kernels)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_gemv_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arm_rows(shapes, bandwidth, baseline=None) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    saved = {field: getattr(moe_gemv, field) for field in FIELDS + ("MIN_DOWN_PROGRAMS",)}
    rows = []
    for shape in shapes:
        D, F, E, K, Fs = SHAPES[shape]
        w13 = (torch.randn(E, 2 * F, D, generator=generator, device="cuda") / D ** 0.5).bfloat16()
        w2 = (torch.randn(E, D, F, generator=generator, device="cuda") / F ** 0.5).bfloat16()
        shared = None
        if Fs:
            shared = ((torch.randn(2 * Fs, D, generator=generator, device="cuda") / D ** 0.5).bfloat16(),
                      (torch.randn(D, Fs, generator=generator, device="cuda") / Fs ** 0.5).bfloat16())
        x = torch.randn(1, D, generator=generator, device="cuda").bfloat16()
        ids = torch.randperm(E, generator=generator, device="cuda")[:K].int()[None]
        weights = torch.softmax(torch.randn(1, K, generator=generator, device="cuda"), -1).bfloat16()
        expected = moe_reference(x, w13, w2, ids, weights).float()
        if shared:
            gate, up = (x.float() @ shared[0].float().t()).chunk(2, dim=-1)
            expected += (torch.nn.functional.silu(gate) * up) @ shared[1].float().t()
        nbytes = (K * w13[0].numel() * 3 // 2 + 3 * D * Fs) * 2
        bound_us = nbytes / bandwidth * 1e6
        if baseline is not None:
            out = baseline.moe_gemv(x, w13, w2, ids, weights, shared=shared).float()
            error = ((out - expected).abs().max() / expected.abs().max()).item()
            us = graph_call_us(lambda: baseline.moe_gemv(x, w13, w2, ids, weights, shared=shared), calls=10)
            rows.append({"shape": shape, "block_d": "baseline", "block_f": "", "tiles": "", "table": False,
                         "baseline": True, "us": round(us, 2), "bound_us": round(bound_us, 2),
                         "ratio": round(us / bound_us, 3), "max_rel_error": error, "ok": error < 2e-2})
        for candidate in CANDIDATES:
            _set(candidate)
            label = {"shape": shape, "block_d": candidate[0], "block_f": candidate[1], "tiles": candidate[2],
                     "warps": candidate[3], "table": candidate == CANDIDATES[0]}
            try:
                out = moe_gemv.moe_gemv(x, w13, w2, ids, weights, shared=shared).float()
                error = ((out - expected).abs().max() / expected.abs().max()).item()
                us = graph_call_us(lambda: moe_gemv.moe_gemv(x, w13, w2, ids, weights, shared=shared), calls=10)
            except Exception as problem:  # noqa: BLE001 - a candidate that does not build is a row, not a crash
                rows.append({**label, "error": str(problem)[:160]})
                continue
            rows.append({**label, "us": round(us, 2), "bound_us": round(bound_us, 2), "ratio": round(us / bound_us, 3),
                         "max_rel_error": error, "ok": error < 2e-2})
            for field, value in saved.items():
                setattr(moe_gemv, field, value)
        del w13, w2, shared
        torch.cuda.empty_cache()
    return rows


STEP = """
import importlib.util, json, sys
sys.path.insert(0, {repo!r})
import kernels
if {baseline!r}:  # the baseline's kernels in place of this tree's, before anything imports them
    spec = importlib.util.spec_from_file_location("kernels.moe_gemv", {baseline!r})
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels.moe_gemv"] = module
    spec.loader.exec_module(module)
    kernels.moe_gemv = module
from kernels import moe_gemv
for field, value in {constants!r}.items():
    setattr(moe_gemv, field, value)
from inspector.cli import main
code = main({argv!r})
sys.exit(code)
"""


def step_row(shape: str, candidate, out_dir: Path, tag: str, baseline: str = "") -> dict:
    """One tg128 @ b1 row in its own process: `candidate` set (None: the module's own table), or `baseline`'s
    kernels."""
    constants = {} if candidate is None else dict(zip(FIELDS, candidate), MIN_DOWN_PROGRAMS=1 << 30)
    json_out = out_dir / f"down_walk_{shape}_{tag}.json"
    model = (["--model", "v4-shape", "--gpu-weights"] if shape == "v4"
             else ["--model", CONFIGS[shape], "--weights", "random"])
    argv = ["bench", *model, "--pp", "none", "--tg", "128", "--batch", "1",
            "--reps", "2", "--no-progress", "--format", "md", "--json-out", str(json_out)]
    if shape == "dsv2":
        argv += ["--set", "shared_fold=on"]
    done = subprocess.run([sys.executable, "-c", STEP.format(repo=str(REPO), constants=constants, argv=argv,
                                                                 baseline=baseline)],
                          cwd=REPO, capture_output=True, text=True, timeout=150)
    if done.returncode != 0:
        return {"shape": shape, "tag": tag, "candidate": candidate, "error": done.stderr[-400:]}
    target = json.loads(json_out.read_text())["targets"]["rows"][0]
    return {"shape": shape, "tag": tag, "candidate": candidate, "tps": round(target["tps"], 1),
            "ratio_to_bound": round(target["ratio_to_bound"], 4),
            "device_us_per_step": round(target["device_us_per_step"], 1)}


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,dsv2,v4")
    parser.add_argument("--steps", action="store_true", help="also the tg128 rows (part 2, about 5 minutes)")
    parser.add_argument("--baseline", default="", help="another revision's kernels/moe_gemv.py to time beside")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT", REPO / "bench" / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth(torch.device("cuda"))["bytes_per_s"]
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; commit {commit_label()}")
    rows = arm_rows(args.shapes.split(","), bandwidth, load_baseline(args.baseline) if args.baseline else None)
    print("| shape | BLOCK_D | BLOCK_F | TILES | warps | arm us | x bound | rel err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['shape']} | {row['block_d']} | {row['block_f']} | {row['tiles']} | {row['warps']} | "
                  f"failed: {row['error']} | | |")
            continue
        mark = " (table)" if row["table"] else ""
        if row.get("baseline"):
            print(f"| {row['shape']} | baseline | | | | {row['us']:.2f} | {row['ratio']:.3f} | "
                  f"{row['max_rel_error']:.1e} |")
            continue
        print(f"| {row['shape']} | {row['block_d']} | {row['block_f']} | {row['tiles']}{mark} | {row['warps']} | "
              f"{row['us']:.2f} | "
              f"{row['ratio']:.3f} | {row['max_rel_error']:.1e}{'' if row['ok'] else ' WRONG'} |", flush=True)
    steps = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        (out_dir / "down_walk.json").write_text(json.dumps(
            {"commit": commit_label(), "device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth,
             "arm": rows, "steps": steps}, indent=1, default=str))

    save()
    if args.steps:
        base = args.baseline
        for shape in args.shapes.split(","):
            if shape == "v4":  # v4-shape takes TILES = 1 at one token: this tree's table against the baseline
                plan = [("baseline", None, base), ("table", None, ""), ("baseline-again", None, base)]
            else:
                good = sorted((r for r in rows if r["shape"] == shape and r.get("ok") and not r["table"]
                               and not r.get("baseline")), key=lambda r: r["us"])[:2]
                plan = [("baseline" if base else "table", None, base)]  # None: the module's own schedule
                plan += [(f"best{i + 1}", (r["block_d"], r["block_f"], r["tiles"], r["warps"]), "")
                         for i, r in enumerate(good)]
                plan += [(plan[0][0] + "-again", plan[0][1], base)]
            for tag, candidate, baseline in plan:
                row = step_row(shape, candidate, out_dir, tag, baseline)
                steps.append(row)
                save()
                print(f"step {shape} {tag} {candidate}: " + (row.get("error") or
                      f"{row['tps']} t/s, {row['ratio_to_bound']}x the bound, {row['device_us_per_step']} us/step"),
                      flush=True)
    return 1 if any(not r.get("ok", True) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
