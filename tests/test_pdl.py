"""kernels.pdl's switches: on by default on a Hopper GPU whose Triton has the GDC intrinsics (runs 29-32),
off with MOEI_PDL=0; the preload follows PDL unless MOEI_PDL_PRELOAD=0; never on a CPU."""

import torch

from kernels import pdl


def _hopper(monkeypatch):
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    return torch.device("cuda", 0)


def test_pdl_and_its_preload_are_on_by_default_on_hopper(monkeypatch):
    device = _hopper(monkeypatch)
    monkeypatch.delenv("MOEI_PDL", raising=False)
    monkeypatch.delenv("MOEI_PDL_PRELOAD", raising=False)
    assert pdl.enabled(device) and pdl.preload(device)
    assert pdl.launch_options(device) == {"USE_GDC": True, "launch_pdl": True}


def test_switches_turn_them_off(monkeypatch):
    device = _hopper(monkeypatch)
    monkeypatch.setenv("MOEI_PDL_PRELOAD", "0")
    assert pdl.enabled(device) and not pdl.preload(device)
    monkeypatch.delenv("MOEI_PDL_PRELOAD")
    monkeypatch.setenv("MOEI_PDL", "0")
    assert not pdl.enabled(device) and not pdl.preload(device)
    assert pdl.launch_options(device) == {"USE_GDC": False}


def test_the_preload_can_be_kept_to_some_kernels(monkeypatch):
    device = _hopper(monkeypatch)
    monkeypatch.setenv("MOEI_PDL_PRELOAD", "gemv,down")
    assert pdl.preload(device, "gemv") and pdl.preload(device, "down") and not pdl.preload(device, "fused")
    assert pdl.preload(device)  # some kernel preloads (the bench footer says so)
    monkeypatch.setenv("MOEI_PDL_PRELOAD", "1")
    assert all(pdl.preload(device, kernel) for kernel in pdl.PRELOADERS)


def test_never_on_a_cpu_or_before_hopper(monkeypatch):
    monkeypatch.delenv("MOEI_PDL", raising=False)
    assert not pdl.enabled(torch.device("cpu")) and not pdl.preload(torch.device("cpu"))
    device = _hopper(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.enabled(device)
