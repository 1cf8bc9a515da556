"""kernels.pdl's switches: on by default on a Hopper GPU whose Triton has the GDC intrinsics, off with the
flag pdl=off; the preload follows PDL for the kernels the flag pdl_preload names; never on a CPU."""

import torch

from engine import flags
from kernels import pdl, settings


def _hopper(monkeypatch):
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    return torch.device("cuda", 0)


def _launch(*assignments: str) -> settings.LaunchSettings:
    return flags.launch_settings(flags.resolve(list(assignments), environ={}))


def test_pdl_and_its_preload_are_on_by_default_on_hopper(monkeypatch):
    device = _hopper(monkeypatch)
    with settings.using(_launch()):
        assert pdl.enabled(device) and pdl.preload(device)
        assert pdl.launch_options(device) == {"USE_GDC": True, "launch_pdl": True}
    assert settings.current() == settings.LaunchSettings() == _launch()  # the kernels' defaults are the flags'


def test_flags_turn_them_off(monkeypatch):
    device = _hopper(monkeypatch)
    with settings.using(_launch("pdl_preload=off")):
        assert pdl.enabled(device) and not pdl.preload(device)
    with settings.using(_launch("pdl=off")):
        assert not pdl.enabled(device) and not pdl.preload(device)
        assert pdl.launch_options(device) == {"USE_GDC": False}
    assert pdl.enabled(device)  # `using` put the defaults back


def test_settings_passed_in_win_over_the_current_ones(monkeypatch):
    device = _hopper(monkeypatch)
    off = _launch("pdl=off")
    assert not pdl.enabled(device, off) and not pdl.preload(device, "gemv", off)
    with settings.using(off):
        assert pdl.enabled(device, _launch()) and pdl.preload(device, "gemv", _launch())


def test_the_preload_can_be_kept_to_some_kernels(monkeypatch):
    device = _hopper(monkeypatch)
    with settings.using(_launch("pdl_preload=gemv+down")):
        assert pdl.preload(device, "gemv") and pdl.preload(device, "down") and not pdl.preload(device, "fused")
        assert pdl.preload(device)  # some kernel preloads (the bench footer says so)
    with settings.using(_launch("pdl_preload=on")):
        assert all(pdl.preload(device, kernel) for kernel in pdl.PRELOADERS)


def test_never_on_a_cpu_or_before_hopper(monkeypatch):
    assert not pdl.enabled(torch.device("cpu")) and not pdl.preload(torch.device("cpu"))
    device = _hopper(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.enabled(device)
