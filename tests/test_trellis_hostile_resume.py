"""Hostile input to the trellis format's writer and reader: a partial directory tampered with before `quantize`
resumes it (a kept layer is checked as the loader would and quantized again when it fails, so a finished run
never publishes what every command refuses), a write that the disk refuses (one line, exit 2, the finished
layers kept for the same command), and a config.json whose model entry or seeds are of the wrong type or out of
range (one line naming the file and the key, before any weight loads)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine import trellis_checkpoint as tc
from engine import trellis_job
from engine.errors import UserError
from engine.trellis_job import parse_experts, partial_directory, quantize_model
from inspector import cli
from test_trellis_checkpoint import write_tiny_mixtral

EXPERTS = "trellis:K=2,code=1mad"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_tiny_mixtral(tmp_path_factory.mktemp("source") / "mixtral", layers=2)


@pytest.fixture(scope="module")
def whole(source, tmp_path_factory) -> Path:
    """An uninterrupted run's output: what every resumed run must equal."""
    out = tmp_path_factory.mktemp("whole") / "q"
    quantize_model(str(source), parse_experts(EXPERTS), out, device="cpu")
    return out


@pytest.fixture(scope="module")
def hyb(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hyb") / "q"
    quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cpu")
    return out


@pytest.fixture(scope="module")
def three_inst(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("3inst") / "q"
    quantize_model(str(source), parse_experts("trellis:K=2,code=3inst"), out, device="cpu")
    return out


@pytest.fixture(scope="module")
def finished(source, tmp_path_factory) -> Path:
    """A partial directory whose every layer is finished: a run stopped before its dense file."""
    out = tmp_path_factory.mktemp("finished") / "q"

    def stop(config):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trellis_job, "_dense_names", stop)
        with pytest.raises(KeyboardInterrupt):
            quantize_model(str(source), parse_experts(EXPERTS), out, device="cpu")
    partial = partial_directory(out)
    assert sorted(path.name for path in partial.iterdir()) == [
        "experts-00000.json", "experts-00000.safetensors", "experts-00001.json", "experts-00001.safetensors",
        "job.json"]
    return partial


def _run(argv, capsys):
    code = cli.main([str(part) for part in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("moe-inspector: error")]


def _resumable(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished partial directory, under the name a run writing tmp_path/out resumes."""
    out = tmp_path / "out"
    shutil.copytree(finished, partial_directory(out))
    return out


def _edit_report(partial: Path, layer: int, edit) -> None:
    path = partial / f"experts-{layer:05d}.json"
    reports = json.loads(path.read_text())
    edit(reports)
    path.write_text(json.dumps(reports))


def _tamper(case: str, partial: Path, hyb: Path, three_inst: Path) -> None:
    layer_path = partial / tc.layer_file(0)
    if case == "report not a list of reports":
        (partial / "experts-00000.json").write_text("[1]\n")
    elif case == "report a string":
        (partial / "experts-00000.json").write_text('"x"\n')
    elif case == "left_block 3":
        _edit_report(partial, 0, lambda reports: reports[0]["layout"].__setitem__(2, 3))
    elif case == "left_seed 2**70":
        _edit_report(partial, 0, lambda reports: reports[0]["layout"].__setitem__(0, 2**70))
    elif case == "shape of floats":
        _edit_report(partial, 0, lambda reports: reports[0].__setitem__("shape", [float(s) for s in reports[0]["shape"]]))
    elif case == "mse a string":
        _edit_report(partial, 0, lambda reports: reports[1].__setitem__("mse", "x"))
    elif case == "negative relative_mse":
        _edit_report(partial, 0, lambda reports: reports[1].__setitem__("relative_mse", -1.0))
    elif case == "link to another checkpoint's file":
        layer_path.unlink()
        layer_path.symlink_to(hyb / tc.layer_file(1))
    elif case == "a hyb checkpoint's layer file":
        shutil.copyfile(hyb / tc.layer_file(0), layer_path)
    elif case == "a 3inst checkpoint's layer file":  # the same tensors, names and shapes: only the error tells
        shutil.copyfile(three_inst / tc.layer_file(0), layer_path)
    elif case == "another model's codes":
        tensors = load_file(str(layer_path))
        tensors["layers.0.w2.trellis_codes"] = tensors["layers.0.w2.trellis_codes"].flip(0).contiguous()
        save_file(tensors, str(layer_path))
    elif case == "nan scale":
        tensors = load_file(str(layer_path))
        tensors["layers.0.w2.trellis_scales"].view(-1)[0] = float("nan")
        save_file(tensors, str(layer_path))
    elif case == "codes of another shape":
        tensors = load_file(str(layer_path))
        tensors["layers.0.w13.trellis_codes"] = tensors["layers.0.w13.trellis_codes"][:1].contiguous()
        save_file(tensors, str(layer_path))
    elif case == "report a FIFO":
        (partial / "experts-00000.json").unlink()
        os.mkfifo(partial / "experts-00000.json")
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "report not a list of reports", "report a string", "left_block 3", "left_seed 2**70", "shape of floats",
    "mse a string", "negative relative_mse", "link to another checkpoint's file", "a hyb checkpoint's layer file",
    "a 3inst checkpoint's layer file", "another model's codes", "nan scale", "codes of another shape",
    "report a FIFO"])
def test_a_tampered_kept_layer_is_quantized_again_with_a_note(source, whole, hyb, three_inst, finished, tmp_path,
                                                              capsys, case):
    """A kept layer is checked as the loader checks it, and against this run's code, seeds, blocks and shapes:
    one that fails is quantized again (a note says why), and the finished directory equals an uninterrupted
    run's; it used to crash (TypeError) or publish a directory every command refused."""
    out = _resumable(finished, tmp_path)
    hyb_bytes = (hyb / tc.layer_file(1)).read_bytes()
    _tamper(case, partial_directory(out), hyb, three_inst)
    code, printed, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    assert code == 0 and "Traceback" not in err, err
    notes = [line for line in err.splitlines() if line.startswith("moe-inspector: note")]
    assert len(notes) == 1 and "layer 0" in notes[0] and "quantizing layer 0 again" in notes[0], err
    assert "kept layers 1 of an earlier run" in printed
    assert not partial_directory(out).exists()
    for name in (tc.layer_file(0), tc.layer_file(1)):
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert (hyb / tc.layer_file(1)).read_bytes() == hyb_bytes  # the link's target was not written through
    config, _, layout = tc.read_config(json.loads((out / "config.json").read_text()), out / "config.json")
    tc.load_weights(out, config, layout, torch.device("cpu"), torch.bfloat16, stream=open(os.devnull, "w"))


def test_an_untouched_partial_directory_is_kept_whole(source, whole, finished, tmp_path, capsys):
    out = _resumable(finished, tmp_path)
    code, printed, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    assert code == 0 and "note" not in err and "kept layers 0, 1 of an earlier run" in printed, err
    for name in (tc.layer_file(0), tc.layer_file(1), tc.DENSE_FILE):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


@pytest.mark.parametrize("name", ["extra.safetensors", "experts-00007.safetensors", "notes.txt"])
def test_a_file_quantize_does_not_write_in_the_partial_directory_is_refused(source, finished, tmp_path, capsys,
                                                                           name):
    """It was published with the checkpoint, and a stray *.safetensors made every load refuse the directory."""
    out = _resumable(finished, tmp_path)
    (partial_directory(out) / name).write_bytes(b"x")
    code, _, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    errors = _errors(err)
    assert code == 2 and len(errors) == 1 and name in errors[0] and "rm -r" in errors[0], err
    assert "Traceback" not in err and not out.exists() and (partial_directory(out) / name).exists()


def test_a_leftover_temporary_link_is_not_written_through(source, finished, tmp_path, capsys):
    out = _resumable(finished, tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (partial_directory(out) / "config.json.tmp").symlink_to(victim)
    code, _, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    assert code == 0, err
    assert victim.read_text() == "keep" and not (out / "config.json.tmp").exists()


def test_a_linked_partial_directory_is_refused(source, finished, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished, tmp_path / "elsewhere")
    partial_directory(out).symlink_to(tmp_path / "elsewhere")
    code, _, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    errors = _errors(err)
    assert code == 2 and len(errors) == 1 and "a link" in errors[0] and not out.exists(), err


# --------------------------------------------------------------------------------------------
# A write the disk refuses
# --------------------------------------------------------------------------------------------

def _full_disk_at(suffix: str, monkeypatch) -> None:
    """safetensors' save_file fails as it does on a full disk, for the file whose name ends with `suffix`, after
    writing part of it."""
    save = tc.save_file

    def failing(tensors, filename, metadata=None):
        if filename.endswith(suffix):
            Path(filename).write_bytes(b"half")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(tc, "save_file", failing)


@pytest.mark.parametrize("failing", [tc.DENSE_FILE, tc.layer_file(1)])
def test_a_full_disk_is_one_line_and_the_run_resumes(source, whole, tmp_path, capsys, monkeypatch, failing):
    out = tmp_path / "out"
    argv = ["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"]
    with monkeypatch.context() as patch:
        _full_disk_at(failing + ".tmp", patch)
        code, printed, err = _run(argv, capsys)
    errors = _errors(err)
    assert code == 2 and printed == "" and "Traceback" not in err and len(errors) == 1, err
    assert f"{partial_directory(out) / failing}: cannot write it (No space left on device)" in errors[0]
    assert f"{out} was not written" in errors[0] and f"resume with `moe-inspector quantize {source}" in errors[0]
    partial = partial_directory(out)
    assert not out.exists() and not list(partial.glob("*.tmp")) and not (partial / failing).exists()
    assert (partial / tc.layer_file(0)).is_file()  # the finished layers stay for the same command
    code, printed, err = _run(argv, capsys)  # room again: the same command finishes the run
    assert code == 0 and "kept layers 0" in printed, err
    for name in (tc.layer_file(0), tc.layer_file(1), tc.DENSE_FILE):
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_json_write_the_system_refuses_is_one_line(source, tmp_path, capsys, monkeypatch):
    def refused(descriptor):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(tc.os, "fsync", refused)
    out = tmp_path / "out"
    code, _, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--device", "cpu"], capsys)
    errors = _errors(err)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"job.json: cannot write it ({os.strerror(errno.EDQUOT)})" in errors[0]
    assert not out.exists() and not (partial_directory(out) / "job.json.tmp").exists()


def test_a_shape_only_write_the_disk_refuses_leaves_nothing(source, tmp_path, capsys, monkeypatch):
    def refused(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tc.os, "fsync", refused)
    out = tmp_path / "out"
    code, _, err = _run(["quantize", source, "--experts", EXPERTS, "--out", out, "--shape-only"], capsys)
    errors = _errors(err)
    assert code == 2 and len(errors) == 1 and "config.json: cannot write it (No space left on device)" in errors[0]
    assert not out.exists() and not partial_directory(out).exists()


def test_shape_only_refuses_to_publish_a_quantize_runs_partial_directory(source, finished, tmp_path):
    out = _resumable(finished, tmp_path)
    with pytest.raises(UserError, match="a quantize run left this partial directory"):
        trellis_job.write_shape_only(str(source), parse_experts(EXPERTS), out)
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# config.json: the model entry and the seeds
# --------------------------------------------------------------------------------------------

def _edited(whole: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(whole, copy)
    values = json.loads((copy / "config.json").read_text())
    edit(values)
    (copy / "config.json").write_text(json.dumps(values))
    return copy


def _model(key: str, value):
    def edit(values):
        entry = values["moe_inspector"]["model"]
        *path, last = key.split(".")
        for part in path:
            entry = entry[int(part)] if isinstance(entry, list) else entry[part]
        if value is _DELETE:
            del entry[last]
        else:
            entry[last] = value
    return edit


def _quantization(key: str, value):
    def edit(values):
        entry = values["quantization_config"]
        *path, last = key.split("/")
        for part in path:
            entry = entry[part]
        if value is _DELETE:
            del entry[last]
        else:
            entry[last] = value
    return edit


_DELETE = object()


def _refused_before_loading(directory: Path, capsys, monkeypatch) -> str:
    def loads(*args, **kwargs):
        raise AssertionError("the weights loaded before config.json was checked")

    monkeypatch.setattr(tc, "load_weights", loads)
    code, out, err = _run(["bench", "--model", directory, "--pp", "4", "--tg", "none", "--batch", "1", "--reps",
                           "1", "--device", "cpu", "--no-progress"], capsys)
    errors = _errors(err)
    assert code == 2 and out == "" and len(errors) == 1 and "Traceback" not in err, err
    assert f"{directory / 'config.json'}: " in errors[0]
    return errors[0]


@pytest.mark.parametrize("key, value, expected", [
    ("norm_eps", "x", "a number > 0"), ("rope_theta", "x", "a number > 0"), ("norm_eps", 0, "a number > 0"),
    ("norm_eps", -1e-5, "a number > 0"), ("rope_theta", -10000.0, "a number > 0"),
    ("rope_theta", 0, "a number > 0"), ("activation_alpha", "1.7", "a finite number"),
    ("routed_scaling_factor", 0.0, "a number > 0"), ("clip_qkv", "x", "a number > 0"),
    ("hidden", "32", "an integer from 1"), ("hidden", 32.0, "an integer from 1"), ("hidden", True, "an integer"),
    ("n_layers", 10**9, "an integer from 1 to 4096"), ("vocab_size", 0, "an integer from 1"),
    ("max_seq_len", -1, "an integer from 1"), ("sinks", "yes", "true or false"), ("name", 7, "a string"),
    ("layer_masks.0.window", "16", "an integer from 0"), ("layer_masks", {"kind": "causal"}, "a list"),
    ("dense_layers", ["0"], "an integer from 0"), ("rope_scaling", {"factor": "x", "original_max_position": 4},
                                                   "a number > 0"),
    ("shared_experts", {"count": 1, "intermediate": -16}, "an integer from 1"),
])
def test_a_model_entry_of_the_wrong_type_or_range_is_one_line(whole, tmp_path, capsys, monkeypatch, key, value,
                                                              expected):
    """`norm_eps: "x"` loaded the weights and then crashed in rms_norm with a TypeError."""
    line = _refused_before_loading(_edited(whole, tmp_path, _model(key, value)), capsys, monkeypatch)
    named = key.split(".")[0] if key.startswith("layer_masks.") else key
    assert f"moe_inspector.model.{named}" in line and expected in line, line


@pytest.mark.parametrize("key, problem", [("hidden", "has no 'hidden'"), ("bogus", "unknown key 'bogus'")])
def test_a_model_entry_missing_a_field_or_with_another_is_one_line(whole, tmp_path, capsys, monkeypatch, key,
                                                                   problem):
    edit = _model(key, _DELETE) if key == "hidden" else _model(key, 1)
    line = _refused_before_loading(_edited(whole, tmp_path, edit), capsys, monkeypatch)
    assert problem in line, line


@pytest.mark.parametrize("key, value, problem", [
    ("matrices/layers.0.w13/left_seed", 2**64 + 5, "left_seed is 18446744073709551621, outside 0..2**64-1"),
    ("matrices/layers.0.w13/left_seed", -7, "left_seed is -7, outside"),
    ("matrices/layers.1.w2/right_seed", "5", "right_seed is '5', expected an integer"),
    ("matrices/layers.1.w2/right_seed", 5.0, "right_seed is 5.0, expected an integer"),
    ("matrices/layers.0.w13/shape", [2.0, 32, 32], "shape is [2.0, 32, 32]"),
    ("seed", "abc", "quantization_config.seed is 'abc', expected an integer"),
    ("seed", -1, "quantization_config.seed is -1, outside 0..2**63-1"),
    ("seed", 2**63, "quantization_config.seed is 9223372036854775808, outside"),
    ("seed", True, "quantization_config.seed is True, expected an integer"),
    ("seed", _DELETE, "quantization_config.seed is None, expected an integer"),
])
def test_a_seed_out_of_range_or_not_an_integer_is_one_line(whole, tmp_path, capsys, monkeypatch, key, value,
                                                           problem):
    """A sign seed outside 0..2**64-1 was masked to 64 bits (another seed than the one written), and a
    quantization seed of "abc" or -1 became 0."""
    line = _refused_before_loading(_edited(whole, tmp_path, _quantization(key, value)), capsys, monkeypatch)
    problem = problem.replace("2**64-1", str(2**64 - 1)).replace("2**63-1", str(2**63 - 1))
    assert problem in line, line


def test_the_largest_sign_seed_loads(whole, tmp_path, capsys):
    edited = _edited(whole, tmp_path, _quantization("matrices/layers.0.w13/left_seed", 2**64 - 1))
    code, _, err = _run(["bench", "--model", edited, "--pp", "4", "--tg", "none", "--batch", "1", "--reps", "1",
                         "--device", "cpu", "--no-progress"], capsys)
    assert code == 0, err


def test_a_calibration_file_that_is_a_pipe_is_refused_not_waited_on(tmp_path):
    """A FIFO with no writer under --calibration blocked quantize forever."""
    fifo = tmp_path / "calibration.txt"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="--calibration .*: not a regular file"):
        trellis_job._calibration_text(fifo)


def test_the_seed_ceiling_is_the_limits_one():
    from engine import limits

    assert tc.MAX_SEED == limits.MAX_SEED


def test_a_source_tokenizer_that_is_a_pipe_is_refused_before_quantizing(source, tmp_path):
    """It was skipped (not a regular file) and the checkpoint published without it, refusing text prompts."""
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    os.mkfifo(copy / "tokenizer.json")
    with pytest.raises(UserError, match="tokenizer.json: not a regular file"):
        quantize_model(str(copy), parse_experts(EXPERTS), tmp_path / "q", device="cpu")
    assert not (tmp_path / "q").exists()
