"""The routing file (engine.routing_file): a recording written and read back exactly, atomically; every
malformed, truncated or foreign file refused with one line naming the file and the problem (exit 2 from the
CLI), never a traceback, never another exception."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import flags, routing_file
from engine.errors import UserError
from engine.routing_record import RoutingRecorder, pack
from engine.runtime import Engine
from inspector.cli import main


@pytest.fixture(scope="module")
def tiny():
    return Engine.load("tiny", "cpu", seed=0, weights="random")


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    """A real tiny run's recording, saved (a prefill of 19 tokens, then 7 decode steps)."""
    run = tiny.generate("a routing file test", 8, flags.resolve(["record_routing=on"], environ={}))
    path = tmp_path_factory.mktemp("routing") / "tiny.safetensors"
    routing_file.save(run.routing, path)
    return run.routing, path


def test_a_file_reads_back_exactly(recorded):
    recording, path = recorded
    again = routing_file.load(path)
    assert again.layers == recording.layers and (again.experts, again.top_k) == (8, 2)
    assert (again.ids == recording.ids).all() and (again.weight_bits == recording.weight_bits).all()
    assert (again.steps == recording.steps).all() and (again.offsets == recording.offsets).all()
    assert (again.phases == recording.phases).all()
    assert again.header == json.loads(json.dumps(recording.header))
    assert again.truncated is None and again.unrecorded == []


def test_ids_are_stored_in_the_smallest_type_that_holds_every_expert(tmp_path):
    for experts, dtype in ((256, "U8"), (257, "I16"), (40000, "I32")):
        recorder = RoutingRecorder(experts, 2, 1 << 20)
        ids = np.array([[experts - 1, 0]], np.int32)
        import torch

        recorder.append(0, "decode", (0,), pack([(torch.from_numpy(ids), torch.tensor([[0.5, 0.5]]))]).numpy())
        path = tmp_path / f"{experts}.safetensors"
        routing_file.save(recorder.finish({"model": "x"}), path)
        header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
        assert header["ids"]["dtype"] == dtype and header["weights"]["dtype"] == "BF16"
        assert routing_file.load(path).ids[0, 0].tolist() == [experts - 1, 0]


def test_a_failed_write_leaves_the_old_file_whole(recorded, tmp_path, monkeypatch):
    recording, path = recorded
    target = tmp_path / "kept.safetensors"
    target.write_bytes(path.read_bytes())
    before = target.read_bytes()

    def broken(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(UserError, match="cannot write the routing file"):
        routing_file.save(recording, target)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["kept.safetensors"]


def test_an_empty_run_or_a_bad_place_is_refused(tmp_path):
    empty = RoutingRecorder(8, 2, 1 << 20).finish()
    with pytest.raises(UserError, match="recorded no routing"):
        routing_file.save(empty, tmp_path / "x.safetensors")


def _tensors(path):
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return raw, length, json.loads(raw[8:8 + length])


def _rewrite(path, target, header=None, data=None):
    """`path` with its JSON header replaced by `header` and/or its data by `data`."""
    raw, length, parsed = _tensors(path)
    body = raw[8 + length:] if data is None else data
    text = json.dumps(parsed if header is None else header).encode()
    target.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return target


def _poke(path, target, tensor: str, index: int, value: bytes):
    """`path` with byte `index` of `tensor`'s data overwritten."""
    raw, length, parsed = _tensors(path)
    begin = 8 + length + parsed[tensor]["data_offsets"][0] + index
    target.write_bytes(raw[:begin] + value + raw[begin + len(value):])
    return target


def _refused(path, *pieces):
    with pytest.raises(UserError) as caught:
        routing_file.load(path)
    message = str(caught.value)
    assert message.startswith(str(path)) and "\n" not in message
    for piece in pieces:
        assert piece in message, message
    return message


def test_hostile_files_are_refused_with_one_line(recorded, tmp_path):
    _, path = recorded
    raw, length, header = _tensors(path)
    _refused(tmp_path / "missing.safetensors", "no such file")
    _refused(tmp_path, "is a directory")
    (tmp_path / "short").write_bytes(b"\x01\x02")
    _refused(tmp_path / "short", "truncated")
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(tmp_path / "huge", "header")
    (tmp_path / "cut-header").write_bytes(raw[:8 + length // 2])
    _refused(tmp_path / "cut-header", "truncated")
    (tmp_path / "cut-data").write_bytes(raw[:-5])
    _refused(tmp_path / "cut-data", "truncated")
    (tmp_path / "text").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    _refused(tmp_path / "text", "not JSON")
    (tmp_path / "list").write_bytes(struct.pack("<Q", 2) + b"[]")
    _refused(tmp_path / "list", "not a JSON object")
    plain = dict(header)
    plain["__metadata__"] = {"format": "pt"}
    _refused(_rewrite(path, tmp_path / "weights", plain), "not a routing file")
    versioned = json.loads(json.dumps(header))
    versioned["__metadata__"]["version"] = "9"
    _refused(_rewrite(path, tmp_path / "version", versioned), "version '9'")
    shaped = json.loads(json.dumps(header))
    shaped["ids"]["shape"] = [shaped["ids"]["shape"][0], 3, 2]
    _refused(_rewrite(path, tmp_path / "shape", shaped), "'ids'")
    beyond = json.loads(json.dumps(header))
    beyond["phases"]["data_offsets"] = [10 ** 9, 10 ** 9 + beyond["phases"]["shape"][0]]
    _refused(_rewrite(path, tmp_path / "beyond", beyond), "truncated", "'phases'")
    typed = json.loads(json.dumps(header))
    typed["weights"]["dtype"] = "F64"
    _refused(_rewrite(path, tmp_path / "dtype", typed), "dtype 'F64'")
    _refused(_poke(path, tmp_path / "range", "ids", 5, bytes([200])), "expert id 200", "out of range for 8 experts")
    _refused(_poke(path, tmp_path / "twice", "ids", 0, bytes([raw[8 + length + header["ids"]["data_offsets"][0] + 1]])),
             "picks an expert twice")
    _refused(_poke(path, tmp_path / "nan", "weights", 0, b"\xc0\x7f"), "infinite or NaN")
    _refused(_poke(path, tmp_path / "offsets", "offsets", 8, struct.pack("<q", 10 ** 6)), "offsets")
    _refused(_poke(path, tmp_path / "phase", "phases", 0, b"\x07"), "phase code 7")


def test_a_file_from_another_model_names_the_mismatch(recorded, tmp_path, capsys):
    _, path = recorded
    assert main(["routing", str(path), "--model", "demo"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "Traceback" not in error
    assert f"{path}: recorded on tiny (2 MoE layers, 8 experts, top-2), not the shape of demo (2 MoE layers, " \
           f"64 experts, top-6): experts, k differ" in error
    assert main(["routing", str(path), "--model", "tiny"]) == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=4000), flips=st.lists(st.tuples(st.integers(0, 4000),
                                                                              st.integers(0, 255)), max_size=4))
def test_any_damage_is_a_user_error_or_a_valid_recording(recorded, tmp_path, cut, flips):
    _, path = recorded
    raw = bytearray(path.read_bytes())
    for index, value in flips:
        raw[index % len(raw)] = value
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(bytes(raw[:max(0, len(raw) - cut)]) if cut % 3 else bytes(raw))
    try:
        recording = routing_file.load(damaged)
    except UserError as error:
        assert "\n" not in str(error) and str(error).startswith(str(damaged))
        return
    assert recording.ids.max() < recording.experts and recording.tokens == recording.offsets[-1]


@pytest.mark.parametrize("key, value, piece", [
    ("moe", {"layers": list(range(400)), "experts": 1 << 20, "top_k": 1}, "(layer, expert) loads a summary holds"),
    ("header", {"prompt": "x"}, "\"header\".prompt is not"),
    ("header", {"prompt": {"tokens": 5}}, "\"header\".prompt is not"),
    ("header", {"prompt": {"text": 7}}, "\"header\".prompt is not"),
    ("truncated", {"cap_bytes": "x"}, "\"truncated\" is not the cap's counts"),
    ("unrecorded", [1], "\"unrecorded\" is not a list of"),
    ("unrecorded", [[0, 2, 3]], "\"unrecorded\" is not a list of"),
])
def test_metadata_the_summary_cannot_use_is_refused_before_it_is_built(recorded, tmp_path, key, value, piece):
    """A few KB claiming 400 layers of 2**20 experts took 3.5 GB; a prompt of "x" was an AttributeError."""
    _, path = recorded
    _, _, header = _tensors(path)
    header["__metadata__"][key] = json.dumps(value)
    _refused(_rewrite(path, tmp_path / "hostile.safetensors", header), piece)


def test_the_woken_count_per_step_needs_no_step_by_expert_mask():
    """4096 steps of 2**20 experts made a [steps, E] mask of 4 GB; the count is the distinct (step, expert) keys."""
    import numpy as np

    from engine.routing_stats import _woken_per_step

    ids = np.array([[0, 5], [5, 9], [1 << 19, 3], [3, 1 << 19]], dtype=np.int32)  # rows 0-1 step 0, rows 2-3 step 2
    offsets = np.array([0, 2, 2, 4])
    assert _woken_per_step(ids, offsets, 1 << 20).tolist() == [3, 0, 2]
