"""Quantizer quality on i.i.d. N(0, 1) data: mean squared error per weight of every trellis code at K = 2, 3, 4.

    python bench/trellis_quality.py                                  # CPU: 64 sequences per code (minutes)
    python bench/trellis_quality.py --device cuda --sequences 4096   # the H200 (about a minute)

Two figures per code:
  trellis   the tail-biting Viterbi search alone (engine.trellis_quantizer.quantize_sequences) on
            sequences of 256 weights, the codes scaled to unit RMS: the code's own distortion, the figure
            the QTIP paper tabulates (close to 0.07 at K = 2 for its L = 16 codes)
  pipeline  engine.trellis_quantizer.quantize_stack on a [1, rows, 256] matrix of the same data: Hadamard
            rotations, per-row scales, the search, the scales refit by least squares; what `quantize` does
Beside them the bounds: the rate-distortion limit 2^(-2K) and the Lloyd-Max scalar quantizer at K bits
(0.1175, 0.03454, 0.009497 for K = 2, 3, 4). Target (K = 2): at most 0.075. Each MSE is printed with its
standard error over the sequences, so two runs can be compared. Exit 1 when a K = 2 figure misses the target.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.trellis_quantizer import default_batch, quantize_sequences, quantize_stack  # noqa: E402
from kernels.trellis_reference import (BITS_PER_WEIGHT, CODES, SEQUENCE, TrellisCode, code_rms,  # noqa: E402
                                       default_hyb_table, dequantize, state_values)

LLOYD_MAX = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}  # Gaussian, Max (1960)
TARGET_K2 = 0.075


def _mean_and_error(squared: torch.Tensor) -> tuple[float, float]:
    """squared [n, 256] -> (mean per weight, standard error of that mean over the n sequences)."""
    per_sequence = squared.double().mean(dim=1)
    return float(per_sequence.mean()), float(per_sequence.std() / math.sqrt(per_sequence.numel()))


def measure(code: TrellisCode, data: torch.Tensor, batch: int) -> dict:
    table = default_hyb_table() if code.needs_table else None
    values = (state_values(code, table, data.device) / code_rms(code, table))  # unit RMS codes
    began = time.perf_counter()
    states = quantize_sequences(data, code, values, batch)
    trellis = _mean_and_error((values[states].reshape(data.shape) - data) ** 2)
    searched = time.perf_counter() - began
    began = time.perf_counter()
    matrix = quantize_stack(data.reshape(1, -1, SEQUENCE), code, left_seed=1, right_seed=2, table=table, batch=batch)
    pipeline = _mean_and_error((dequantize(matrix)[0] - data.reshape(-1, SEQUENCE)) ** 2)
    return {"code": code.code, "K": code.K, "V": code.V, "trellis": trellis, "pipeline": pipeline,
            "rate_distortion": 2.0 ** (-2 * code.K), "lloyd_max": LLOYD_MAX[code.K],
            "seconds": (searched, time.perf_counter() - began)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, default=64, help="sequences of 256 weights per code (multiple of 16)")
    parser.add_argument("--codes", default=",".join(CODES))
    parser.add_argument("--bits", default=",".join(map(str, BITS_PER_WEIGHT)))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sequences < 16 or args.sequences % 16:
        parser.error("--sequences must be a multiple of 16 (the pipeline's matrix has rows of 16 tiles)")
    device = torch.device(args.device)
    data = torch.randn(args.sequences, SEQUENCE, generator=torch.Generator().manual_seed(args.seed)).to(device)
    batch = default_batch(device)
    print(f"trellis quality: {args.sequences} sequences of {SEQUENCE} N(0,1) weights, seed {args.seed}, "
          f"{args.device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}")
    print(f"{'code':<6}{'K':>2}{'V':>3}  {'trellis MSE':>18}  {'pipeline MSE':>18}  {'R-D 2^-2K':>10}  "
          f"{'Lloyd-Max':>10}  {'s search/pipe':>14}")
    missed = []
    for bits in (int(b) for b in args.bits.split(",")):
        for name in args.codes.split(","):
            row = measure(TrellisCode.of(name, bits), data, batch)
            (trellis, trellis_error), (pipeline, pipeline_error) = row["trellis"], row["pipeline"]
            print(f"{name:<6}{bits:>2}{row['V']:>3}  {trellis:>10.5f} ± {trellis_error:.5f}  "
                  f"{pipeline:>10.5f} ± {pipeline_error:.5f}  {row['rate_distortion']:>10.5f}  "
                  f"{row['lloyd_max']:>10.5f}  {row['seconds'][0]:>6.1f}/{row['seconds'][1]:<6.1f}", flush=True)
            if bits == 2 and max(trellis, pipeline) > TARGET_K2:
                missed.append(name)
    print(f"target K = 2: MSE <= {TARGET_K2}: " + ("met by every code" if not missed else f"MISSED by {missed}"))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
