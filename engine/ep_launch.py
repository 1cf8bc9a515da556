"""Launching an expert-parallel run (engine.expert_parallel) as one command: the ranks, their process group,
and how a run ends when one of them cannot go on.

- `run(ep, target, payload)` spawns `ep` processes (torch.multiprocessing, start method spawn), each joining
  one group over TCP on a free localhost port (gloo on CPU, NCCL on CUDA, rank r on GPU r), and calls
  `target(group, payload)` in each (an engine.expert_parallel.ExpertGroup). Under torchrun (WORLD_SIZE in the
  environment) this process is one rank already: the group comes from torchrun's environment, and
  WORLD_SIZE must equal `ep`.
- The result: rank 0's return value. A rank's UserError (bad input: `ep` not dividing the experts, a bad
  model) ends the run with that one line, as UserError in the caller (exit 2); a rank that dies (a crash, a
  kill, an exit) ends every other rank (terminated by the parent; a rank stuck in a collective also raises
  after the group's timeout) and the run with one line naming the rank and how it ended. Nothing here
  writes a file: the caller's rank 0 writes its results (atomically) only after its run completed.

`target` and `payload` must pickle (a module-level function and plain values). Knows nothing of models or
printing. The test hook `FAIL_RANK_KEY`: a payload dict holding it names a rank that exits (code 9) once it
has joined the group, to test that a dying rank ends the run.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import time
from typing import Any, Callable

from engine.errors import UserError
from engine.expert_parallel import ExpertGroup, parse_ep

TIMEOUT_S = 300  # a collective waiting longer than this for a peer raises: a rank stuck on a dead peer ends
FAIL_RANK_KEY = "_ep_test_fail_rank"  # the test hook (module docstring)
FAIL_EXIT_CODE = 9


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or any launcher that sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def backend_for(device: str) -> str:
    """nccl when the run is on CUDA GPUs, gloo on CPUs."""
    import torch

    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if wants_cuda else "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` runs on: GPU `rank` of the host (LOCAL_RANK under torchrun) for CUDA, else `device`."""
    if backend_for(device) != "nccl":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    return f"cuda:{local}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _join(rank: int, size: int, backend: str, init_method: str, timeout_s: float) -> ExpertGroup:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ExpertGroup(rank, size, backend)


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(index: int, size: int, init_method: str, backend: str, timeout_s: float,
               target: Callable, payload: Any, queue) -> None:
    """One spawned rank: join, run, post (rank, "done", rank 0's value pickled), (rank, "refused", its UserError's
    line) or (rank, "error", a line naming another exception), exit (0, or 2 after a post of either)."""
    code = 0
    try:
        group = _join(index, size, backend, init_method, timeout_s)
        if isinstance(payload, dict) and payload.get(FAIL_RANK_KEY) == index:
            os._exit(FAIL_EXIT_CODE)  # the test hook: a rank that dies without a word
        value = target(group, payload)
        # pickled here: a tensor sent as itself would be shared through a file descriptor this process takes away
        queue.put((index, "done", pickle.dumps(value) if index == 0 else None))
    except UserError as error:
        queue.put((index, "refused", str(error)))
        code = 2
    except Exception as error:  # a peer's death seen from here (a collective's timeout or reset), or a bug
        queue.put((index, "error", f"rank {index} stopped: {type(error).__name__}: {str(error).splitlines()[0]}"
                                   if str(error) else f"rank {index} stopped: {type(error).__name__}"))
        code = 2
    finally:
        try:
            _leave()
        except Exception:
            pass
    sys.stdout.flush()
    sys.exit(code)


def run(ep: int, target: Callable, payload: Any, device: str = "cpu", timeout_s: float = TIMEOUT_S) -> Any:
    """`target(group, payload)` on `ep` ranks (module docstring); rank 0's return value."""
    ep = parse_ep(ep)
    backend = backend_for(device)
    if under_torchrun():
        return _run_torchrun(ep, target, payload, backend, timeout_s)
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < ep:
            raise UserError(f"--ep {ep}: {torch.cuda.device_count()} CUDA GPUs are visible here; give at most that "
                            f"many ranks, or --device cpu")
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.start_processes(_rank_main, args=(ep, init_method, backend, timeout_s, target, payload, queue),
                                 nprocs=ep, join=False, start_method="spawn")
    posts: list[tuple[int, str, Any]] = []
    failure = None
    while True:
        try:
            finished = context.join(timeout=0.2)
        except mp.ProcessExitedException as error:  # the others were terminated by join itself
            failure = error
            finished = True
        except mp.ProcessRaisedException as error:  # cannot happen (_rank_main catches), kept one line
            failure = error
            finished = True
        while not queue.empty():
            posts.append(queue.get())
        if finished:
            break
    while not queue.empty():
        posts.append(queue.get())
    # The cause, in this order: a rank that died without a word (an exit code no rank of ours returns: not 0, not
    # 2, not the SIGTERM the join sent the others), a rank's UserError, another exception; a peer's error after
    # the cause (a collective's reset) is its consequence.
    deaths = [(index, process.exitcode) for index, process in enumerate(context.processes)
              if process.exitcode not in (0, 2, -signal.SIGTERM, None)]
    if deaths:
        index, code = deaths[0]
        raise UserError(f"--ep {ep}: {_how_ended(index, code)}; every rank stopped, nothing was written")
    for kind in ("refused", "error"):
        lines = [line for _, posted, line in posts if posted == kind]
        if lines:
            raise UserError(lines[0])
    if failure is not None:
        ended = _how_ended(failure.error_index, getattr(failure, "exit_code", None))
        raise UserError(f"--ep {ep}: {ended}; every rank stopped, nothing was written")
    done = [post for post in posts if post[1] == "done" and post[0] == 0]
    if not done:
        raise UserError(f"--ep {ep}: rank 0 ended without a result; every rank stopped, nothing was written")
    return pickle.loads(done[0][2])


def _how_ended(index: int, exit_code: int) -> str:
    if exit_code is not None and exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"rank {index} was killed by {name}"
    return f"rank {index} died (exit code {exit_code})"


def _run_torchrun(ep: int, target: Callable, payload: Any, backend: str, timeout_s: float) -> Any:
    """This process is rank RANK of WORLD_SIZE: join through torchrun's environment and run. Only rank 0 names a
    problem; the others exit 2 quietly (torchrun then stops the rest)."""
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if size != ep:
        if rank == 0:
            raise UserError(f"--ep {ep} but torchrun started {size} ranks (WORLD_SIZE={size}): give "
                            f"--nproc-per-node {ep}, or --ep {size}")
        raise SystemExit(2)
    started = time.monotonic()
    try:
        group = _join(rank, size, backend, "env://", timeout_s)
        if isinstance(payload, dict) and payload.get(FAIL_RANK_KEY) == rank:
            os._exit(FAIL_EXIT_CODE)
        return target(group, payload)
    except UserError:
        if rank == 0:
            raise
        raise SystemExit(2)
    except Exception as error:
        line = f"rank {rank} stopped after {time.monotonic() - started:.0f} s: {type(error).__name__}"
        if rank == 0:
            raise UserError(line) from None
        raise SystemExit(2)
    finally:
        _leave()
