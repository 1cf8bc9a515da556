"""The flag l2_prefetch (engine.l2_prefetch, kernels.l2_prefetch): which weights a one-row decode step asks into L2,
where in the step, and that asking changes no token.

CPU: the windows a flag value opens, what the bulk prefetch refuses, and, on tiny's fused one-row step with a
recording stand-in for the prefetcher, each window's tensors and its place among the step's launches (after the q/k/v
GEMV and before rope_cache; after the o projection and before the router's fold), one join at the step's end, nothing
at three rows. GPU (`-m gpu`): the kernel itself, and graphed runs with every window equal to the run without.
"""

import pytest
import torch

from engine import decode_fused, flags, l2_prefetch
from engine.model import KVCache, forward
from engine.runtime import Dispatcher, Engine
from kernels import launches
from kernels.l2_prefetch import prefetch_l2, refusal


@pytest.mark.parametrize("value, opened", [("off", set()), ("attention", {"attention"}), ("routing", {"routing"}),
                                           ("attention+routing", {"attention", "routing"})])
def test_each_flag_value_opens_its_windows(value, opened):
    assert l2_prefetch.windows(flags.resolve([f"l2_prefetch={value}"], environ={})["l2_prefetch"]) == opened


def test_unknown_windows_and_values_are_refused():
    with pytest.raises(ValueError, match="unknown windows"):
        l2_prefetch.L2Prefetch(frozenset({"attention", "prefill"}), torch.device("cpu"))
    with pytest.raises(Exception, match="l2_prefetch"):
        flags.resolve(["l2_prefetch=everything"], environ={})


def test_a_cpu_opens_no_window():
    assert l2_prefetch.L2Prefetch(frozenset({"attention"}), torch.device("cpu")).opened == frozenset()


def test_the_bulk_prefetch_refuses_what_it_cannot_address():
    base = torch.randn(64, 64).to(torch.bfloat16)
    assert refusal(base) == ""
    assert refusal(base.t()) == "not contiguous"
    assert refusal(base.reshape(-1)[1:9]) == "not 16-byte aligned"
    assert "multiple of 16" in refusal(base.reshape(-1)[:7])
    with pytest.raises(ValueError, match="prefetch_l2: .*bulk L2 prefetch"):
        prefetch_l2(base)  # a CPU tensor


def _one_row_step(monkeypatch, opened, rows=1):
    """tiny (2 layers) with q/k/v packed, a 5-token prefill, then one fused decode step of `rows` rows with the
    windows `opened`; returns the engine, the recorders made and every launch of the step in order."""
    engine = Engine.load("tiny", "cpu", seed=0)
    decode_fused.pack_qkv(engine.config, engine.weights)
    config = engine.config
    cache = KVCache.allocate(config, rows, 24, engine.device, engine.dtype)
    dispatcher = Dispatcher(engine, flags.resolve(environ={}), timed=False)
    forward(config, engine.weights, torch.arange(1, 6).repeat(rows, 1), 0, cache, dispatcher)
    dispatcher.l2_prefetch_windows = opened
    order: list[str] = []  # every launch and every prefetch call of the step, in order
    made = []

    class Recording:
        """Stands in for engine.l2_prefetch.L2Prefetch: each call with its window and its tensors' addresses."""

        def __init__(self, opened, device):
            self.opened, self.calls = opened, []
            made.append(self)

        def during(self, window, tensors):
            if window in self.opened:
                order.append(f"prefetch:{window}")
                self.calls.append((window, [t.data_ptr() for t in tensors if t is not None]))

        def join(self):
            order.append("join")
            self.calls.append(("join", []))

    monkeypatch.setattr(decode_fused, "L2Prefetch", Recording)
    real_record = launches.record

    def record(name, *args, **kwargs):
        order.append(name)
        return real_record(name, *args, **kwargs)

    monkeypatch.setattr(launches, "record", record)
    decode_fused.forward_decode(config, engine.weights, torch.full((rows, 1), 3), torch.full((rows,), 5), 24, None,
                                cache, dispatcher)
    return engine, made, order


def test_a_one_row_step_asks_for_each_windows_weights_where_the_window_opens(monkeypatch):
    engine, made, order = _one_row_step(monkeypatch, frozenset({"attention", "routing"}))
    weights = engine.weights
    (prefetch,) = made
    assert prefetch.calls == [
        ("attention", [weights["layers.0.wo"].data_ptr(), weights["layers.0.router"].data_ptr()]),
        ("routing", [decode_fused.packed_qkv(weights, "layers.1.").data_ptr()]),
        ("attention", [weights["layers.1.wo"].data_ptr(), weights["layers.1.router"].data_ptr()]),
        ("join", [])]  # the last layer's routing window has no next layer to ask for
    # attention's window right after the q/k/v GEMV, before rope_cache; routing's right after o, before the router
    for layer in range(2):
        at = [i for i, name in enumerate(order) if name == "prefetch:attention"][layer]
        assert order[at - 1] in ("gemv", "gemv_norm") and order[at + 1] == "rope_cache", order
    at = order.index("prefetch:routing")
    assert order[at - 1] == "gemv" and order[at + 1] == "gemv_route", order
    assert order[-1] == "join" and order[-2] in ("gemv_norm", "gemv_pick"), order  # after the LM head


@pytest.mark.parametrize("opened, windows_asked", [(frozenset({"attention"}), {"attention"}),
                                                   (frozenset({"routing"}), {"routing"})])
def test_one_window_asks_for_its_own_weights_only(monkeypatch, opened, windows_asked):
    _, (prefetch,), _ = _one_row_step(monkeypatch, opened)
    assert {call[0] for call in prefetch.calls} - {"join"} == windows_asked


def test_off_or_three_rows_make_no_prefetcher(monkeypatch):
    assert _one_row_step(monkeypatch, frozenset())[1] == []
    assert _one_row_step(monkeypatch, frozenset({"attention", "routing"}), rows=3)[1] == []


@pytest.mark.gpu
def test_gpu_prefetch_leaves_its_tensor_alone_and_refuses_a_misaligned_one():
    weight = torch.randn(5120, 2048, device="cuda", dtype=torch.bfloat16)
    before = weight.clone()
    for programs, chunk, pause_ns in ((16, 65536, 0), (3, 4096, 200), (200, 16, 0)):
        prefetch_l2(weight, programs=programs, chunk=chunk, pause_ns=pause_ns)
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
    with pytest.raises(ValueError, match="aligned"):
        prefetch_l2(weight.reshape(-1)[1:4097])


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["attention", "routing", "attention+routing"])
def test_gpu_graphed_runs_with_a_window_open_give_the_tokens_of_a_run_without(value):
    """demo at one row (graphs of several steps, run-ahead) and at two (no window: more than one row)."""
    import random

    engine = Engine.load("demo", "cuda", seed=0)
    generator = random.Random(3)
    for lengths in ([37], [21, 50]):
        batch = [[generator.randrange(256) for _ in range(length)] for length in lengths]
        off = engine.generate_batch(batch, 20, flags.resolve(environ={}), graphs=True)
        on = engine.generate_batch(batch, 20, flags.resolve([f"l2_prefetch={value}"], environ={}), graphs=True)
        assert on.tokens == off.tokens
        decode = [step for step in on.steps if step["phase"] == "decode"]
        assert {step["graph"] for step in decode[1:]} == {"replay"}
        if len(lengths) == 1:
            assert on.counters["kernels"].get("l2_prefetch", 0) > 0
        else:
            assert on.counters["kernels"].get("l2_prefetch", 0) == 0
