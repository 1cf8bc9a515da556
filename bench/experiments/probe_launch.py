"""GPU probe of the host costs around a decode step's graph launch (the host time per decode step).

Four questions, each answered by a measurement in one process (run on a GPU; prints one table):
  1. launch of a graph while a replay of the SAME graph is still queued, against alternating two
     graphs captured from the same work (the device kept busy by a spin kernel so both are queued);
  2. the same launches after a torch.profiler session has run in the process (does the profiler
     leave the CUDA API slower for the rest of the process?);
  3. whether a device-to-pinned-host copy can be captured in a graph (and lands on replay);
  4. whether a Triton kernel can store straight into pinned host memory (zero-copy outputs);
  5. whether timing events recorded inside a capture (torch.cuda.Event(external=True)) time each replay;
  6. the host cost of an event record and a graph launch through torch's C methods, against the CUDA
     driver's cuEventRecord / cuGraphLaunch called through ctypes on the same handles.

    python3 bench/experiments/probe_launch.py
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import triton
import triton.language as tl


@triton.jit
def _tiny(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


@triton.jit
def _store_token(out_ptr, value):
    tl.store(out_ptr + tl.arange(0, 1), tl.full([1], value, tl.int64))


def _capture(x, y, kernels=13):
    graph = torch.cuda.CUDAGraph()
    for _ in range(2):  # warm-up compiles outside the capture
        _tiny[(4,)](x, y, x.numel(), BLOCK=256)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            _tiny[(4,)](x, y, x.numel(), BLOCK=256)
    return graph


def launch_costs(graphs, launches=200) -> list[float]:
    """Host µs per graph launch, the device kept busy so the launches queue behind each other."""
    costs = []
    launch = [super(torch.cuda.CUDAGraph, g).replay for g in graphs]
    for block in range(launches // 20):
        torch.cuda._sleep(50_000_000)  # ~ tens of ms of spin: everything below queues
        for i in range(20):
            started = time.perf_counter()
            launch[i % len(launch)]()
            costs.append((time.perf_counter() - started) * 1e6)
        torch.cuda.synchronize()
    return costs


def main() -> None:
    device = torch.device("cuda")
    x = torch.randn(1024, device=device)
    y = torch.empty_like(x)
    one, two = _capture(x, y), _capture(x, y)
    rows = []

    def report(label, costs):
        rows.append(f"{label:<60} median {statistics.median(costs):7.2f} µs  mean {statistics.fmean(costs):7.2f}")

    report("1. same graph, replays queued", launch_costs([one]))
    report("1. two graphs alternating, replays queued", launch_costs([one, two]))
    idle = []
    launch = super(torch.cuda.CUDAGraph, one).replay
    for _ in range(200):
        torch.cuda.synchronize()
        started = time.perf_counter()
        launch()
        idle.append((time.perf_counter() - started) * 1e6)
    report("1. same graph, nothing queued", idle)

    # 3. a device -> pinned host copy inside a capture
    source = torch.arange(8, dtype=torch.int64, device=device)
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            source.add_(1)
            pinned.copy_(source, non_blocking=True)
        graph.replay()
        torch.cuda.synchronize()
        rows.append(f"3. captured D2H copy: ok, landed {pinned.tolist()} (want 1..8 after one replay + capture "
                    f"not run: {list(range(1, 9))})")
    except Exception as error:  # noqa: BLE001 - the probe reports what failed
        rows.append(f"3. captured D2H copy: FAILED {type(error).__name__}: {error}")

    # 4. a Triton store into pinned host memory
    host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    try:
        _store_token[(1,)](host, 12345)
        torch.cuda.synchronize()
        rows.append(f"4. Triton store into pinned host memory: ok, read {host.item()} (want 12345)")
    except Exception as error:  # noqa: BLE001
        rows.append(f"4. Triton store into pinned host memory: FAILED {type(error).__name__}: {error}")

    # 5. timing events captured in the graph: each replay records them
    try:
        begin = torch.cuda.Event(enable_timing=True, external=True)
        end = torch.cuda.Event(enable_timing=True, external=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            begin.record()
            torch.cuda._sleep(200_000)
            end.record()
        spans = []
        for cycles in (1, 2):
            graph.replay()
            end.synchronize()
            spans.append(begin.elapsed_time(end) * 1e3)
        host = []
        for _ in range(100):
            torch.cuda.synchronize()
            started = time.perf_counter()
            super(torch.cuda.CUDAGraph, graph).replay()
            host.append((time.perf_counter() - started) * 1e6)
        rows.append(f"5. captured timing events: ok, replays timed {spans[0]:.1f} and {spans[1]:.1f} us "
                    f"(a ~200k-cycle spin); launch of that graph median {statistics.median(host):.2f} us")
    except Exception as error:  # noqa: BLE001
        rows.append(f"5. captured timing events: FAILED {type(error).__name__}: {error}")

    # 6. torch's C methods against the driver API through ctypes
    try:
        import ctypes

        driver = ctypes.CDLL("libcuda.so.1")
        driver.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        driver.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        stream = torch.cuda.current_stream()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        record = super(torch.cuda.Event, event).record
        handle, raw_stream = event.cuda_event, stream.cuda_stream
        exec_handle = one.raw_cuda_graph_exec()

        def per_call(call, count=2000):
            costs = []
            for block in range(count // 20):
                torch.cuda._sleep(20_000_000)
                for _ in range(20):
                    started = time.perf_counter()
                    call()
                    costs.append((time.perf_counter() - started) * 1e6)
                torch.cuda.synchronize()
            return costs

        report("6. event record, torch C method", per_call(lambda: record(stream)))
        report("6. event record, cuEventRecord via ctypes", per_call(lambda: driver.cuEventRecord(handle, raw_stream)))
        report("6. graph launch, torch C method", per_call(launch, 400))
        launch_raw = partial(driver.cuGraphLaunch, exec_handle, raw_stream)
        report("6. graph launch, cuGraphLaunch via ctypes", per_call(launch_raw, 400))
    except Exception as error:  # noqa: BLE001
        rows.append(f"6. driver calls: FAILED {type(error).__name__}: {error}")

    # 2. after a profiler session
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        launch_costs([one], 40)
    report("2. after a torch.profiler session: same graph, queued", launch_costs([one]))
    report("2. after a torch.profiler session: two graphs, queued", launch_costs([one, two]))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
