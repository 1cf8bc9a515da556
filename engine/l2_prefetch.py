"""The flag l2_prefetch: weights a one-row decode step already knows, asked into L2 on a side stream while the
layer's latency-bound kernels leave DRAM idle (kernels.l2_prefetch).

Two windows, each a fork of the side stream after a GEMV of the step (the prefetch waits for that GEMV to finish,
the next kernels on the step's stream wait for nothing of it):

  attention  after the layer's q/k/v GEMV, during rope_cache and attention's split and combine: the layer's o
             projection and router weights
  routing    after the o projection, during the router's fold: the next layer's packed q/k/v weight

The side stream joins the step's stream at the step's end (`join`), so a captured step's graph holds its prefetches
and a run's last step waits for them. Timing only: no kernel reads anything the prefetch writes (it writes nothing).
Latent-attention layers (DeepSeek) and steps of more than one row ask for nothing.
"""

from __future__ import annotations

import torch

WINDOWS = ("attention", "routing")  # engine.flags.L2_PREFETCH: "off", each, or both joined by +

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per device, shared by every step


def windows(value: str) -> frozenset[str]:
    """The windows a flag value opens ("off": none)."""
    return frozenset() if value == "off" else frozenset(value.split("+"))


class L2Prefetch:
    """One step's prefetches: `during(window, tensors)` forks the side stream from the current one and asks L2 for
    each tensor there, where `window` is open and the tensor can be prefetched; `join()` joins it back."""

    def __init__(self, opened: frozenset[str], device: torch.device) -> None:
        from kernels.l2_prefetch import supported

        unknown = set(opened) - set(WINDOWS)
        if unknown:
            raise ValueError(f"L2Prefetch: unknown windows {sorted(unknown)}; known: {', '.join(WINDOWS)}")
        self.opened = opened if supported(device) else frozenset()
        self.device = device
        self.forked = False

    def during(self, window: str, tensors) -> None:
        from kernels.l2_prefetch import prefetch_l2, refusal

        if window not in self.opened:
            return
        chosen = [t for t in tensors if t is not None and not refusal(t)]
        if not chosen:
            return
        side = _STREAMS.get(self.device)
        if side is None:
            side = _STREAMS[self.device] = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for t in chosen:
                prefetch_l2(t)
        self.forked = True

    def join(self) -> None:
        """The step's stream waits for every prefetch forked since the last join."""
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(_STREAMS[self.device])
            self.forked = False


class _Off:
    """What a step with no window open holds: asks for nothing."""

    opened = frozenset()

    def during(self, window: str, tensors) -> None:
        pass

    def join(self) -> None:
        pass


OFF = _Off()
