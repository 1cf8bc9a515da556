"""GPU probe: how much faster is a decode GEMV whose weight was prefetched into L2 (sm_90
`cp.async.bulk.prefetch.L2`, the kernel below) during an idle window, against the same GEMV reading DRAM?

For the v4-shape wo [4096, 4096] (33.5 MB) and packed qkv [5120, 4096] (41.9 MB) weights, bf16, one row:
  cold      L2 flushed (a 512 MB read), a spin of W us, then the GEMV (timed by events around it alone);
  warm      the GEMV right after the same GEMV (its weight as much in L2 as it can be);
  prefetch  flushed, then `prefetch` (below) with P programs of C-byte chunks, a spin of W us, the GEMV;
  side      as prefetch, but the prefetch on a second stream that the spin does not wait for.
A long spin (torch.cuda._sleep) before each repetition keeps the host's launches off the timeline.
Medians of REPS repetitions.
Also the prefetch kernel's own device time, and the copy bandwidth (a device-to-device copy of 1 GiB).

    python3 bench/experiments/probe_l2.py [--json PATH]

H200, run 26 (bench/results/2026-11-29-h200-run26-l2-probe-one-launch): L2 60 MiB, copy 4.27 TB/s. wo: 12.96 us cold,
11.23 us after the prefetch (8 programs; 11.7-12.0 with 32 or 132; no gain at 1 MB per instruction), 9.23 us
warm, whatever the window (2-10 us); qkv: 14.42, 12.86, 10.93 us. The prefetch kernel stays resident until its
lines land (8.0 us for wo's 33.6 MB, the copy time), so it has to run on a side stream. In the v4 decode step
(the qkv weight at the step's start, wo and the router's after the qkv GEMV, on a side stream joined at the
step's end) q/k/v and o each took 1.25 us less but the step went from 133.5 to 135.9 and 135.7 us (runs 26,
27): attention slowed beside the prefetch's DRAM traffic, and the fork and join cost the rest. Not kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from kernels.gemv import gemv  # noqa: E402
from kernels.l2_prefetch import prefetch_l2  # noqa: E402

REPS = 40
CYCLES_PER_US = 1980  # the H200's boost clock; the spin's length in us is measured below


def prefetch(weight: torch.Tensor, programs: int = 32, chunk: int = 65536) -> None:
    """Bulk L2 prefetches over all of `weight`'s bytes from `programs` programs, `chunk` bytes per instruction,
    on the current stream (kernels.l2_prefetch, what the flag l2_prefetch launches)."""
    prefetch_l2(weight, programs=programs, chunk=chunk)


def _timed(before, work, reps=REPS) -> float:
    """Median device us of `work` (events around it alone), `before` enqueued first each time."""
    times = []
    for _ in range(reps):
        torch.cuda._sleep(400 * CYCLES_PER_US)  # the host enqueues everything below while this spins
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    print(f"device {props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB, {props.multi_processor_count} SMs")
    flush = torch.randn(256 * 2**20, device=device, dtype=torch.bfloat16)  # 512 MB
    side = torch.cuda.Stream()

    def flush_l2():
        flush.sum(dtype=torch.float32)

    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = _timed(lambda: None, lambda: dst.copy_(src), reps=10)
    bandwidth = 2 * src.numel() / (copy_us * 1e-6)  # read + write
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (1 GiB device-to-device: {copy_us:.0f} us)")
    results = {"copy_tb_s": bandwidth / 1e12, "rows": []}
    for window in (2, 5, 10):
        spin = _timed(lambda: None, lambda w=window: torch.cuda._sleep(w * CYCLES_PER_US))
        print(f"spin {window} us asked: {spin:.1f} us measured")
    for name, shape in (("wo", (4096, 4096)), ("qkv", (5120, 4096))):
        w = torch.randn(shape, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, shape[1], device=device, dtype=torch.bfloat16)
        reference = gemv(x, w).clone()
        mb = w.numel() * 2 / 1e6
        bound = w.numel() * 2 / bandwidth * 1e6

        def run():
            gemv(x, w)

        def row(label, us):
            print(f"{name:4s} {mb:5.1f} MB  {label:44s} {us:6.2f} us  ({us / bound:.2f}x its copy bound {bound:.2f})")
            results["rows"].append({"weight": name, "case": label, "us": us, "bound_us": bound})

        row("warm (right after itself)", _timed(run, run))
        for window in (2, 5, 10):
            row(f"cold, spin {window}", _timed(lambda w_=window: (flush_l2(), torch.cuda._sleep(w_ * CYCLES_PER_US)),
                                               run))
        for programs, chunk in ((8, 65536), (32, 65536), (132, 65536), (32, 16384), (32, 1 << 20)):
            for window in (2, 5, 10):
                def before(p=programs, c=chunk, w_=window):
                    flush_l2()
                    prefetch(w, programs=p, chunk=c)
                    torch.cuda._sleep(w_ * CYCLES_PER_US)
                row(f"prefetch P={programs} C={chunk // 1024}K, spin {window}", _timed(before, run))
        for window in (5, 10):
            def before_side(w_=window):
                flush_l2()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    prefetch(w)
                torch.cuda._sleep(w_ * CYCLES_PER_US)
                torch.cuda.current_stream().wait_stream(side)
            row(f"side-stream prefetch, spin {window}", _timed(before_side, run))
        issue = _timed(lambda: (flush_l2(), torch.cuda._sleep(2 * CYCLES_PER_US)), lambda: prefetch(w))
        row("the prefetch kernel itself (P=32 C=64K)", issue)
        torch.cuda.synchronize()
        if not torch.equal(gemv(x, w), reference):
            print(f"FAIL: {name}: the GEMV after prefetches differs from before")
            return 1
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
