"""The user's files and the machine against hostile input, through the CLI and the TUI's recorder:
output paths refused before any work (exit 2, one line, nothing changed), a write that fails after
the work, kill -9 during a recorder save, sessions whose comments and recorded results survive
the TUI, checkpoints that point outside their directory, sizes refused before allocation, and
NaN or inf weights. All on the CPU, in seconds.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import atomic_file, limits
from engine.errors import UserError
from inspector.cli import main
from inspector.session import load_session
from inspector.session_recorder import SessionRecorder

REPOSITORY = Path(__file__).resolve().parent.parent
SESSIONS = REPOSITORY / "sessions"

SESSION = """# My notes on this session: the comment and the blank lines must survive every save.
[session]
version = 1
name = "mine"   # a trailing comment

[engine]
model = "tiny"
device = "cpu"

# the starting flags
[flags]
moe_gate = "floor"

[[step]]
action = "prompt"
prompt = "hi"
max_tokens = 2   # short, on purpose
"""


pytestmark = pytest.mark.usefixtures("pinned_environment")  # conftest: no calibration, no MOEI_*


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def session_file(tmp_path, text=SESSION, name="mine.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# Output paths: refused before anything runs
# --------------------------------------------------------------------------------------------

def _refusals(tmp_path, session):
    (tmp_path / "a-directory").mkdir()
    readonly = tmp_path / "readonly.jsonl"
    readonly.write_text("keep")
    readonly.chmod(0o444)
    (tmp_path / "link.jsonl").symlink_to(session)
    os.link(session, tmp_path / "hard.jsonl")
    return [
        (["--results", session], "the session file being run"),
        (["--report", session], "the session file being run"),
        (["--results", tmp_path / "link.jsonl"], "the session file being run"),  # a symbolic link to it
        (["--results", tmp_path / "hard.jsonl"], "the session file being run"),  # a hard link to it
        (["--report", tmp_path / "r.jsonl", "--results", tmp_path / "r.jsonl"], "name the same file"),
        (["--report", tmp_path / "mine.results.jsonl"], "the results file name the same file"),
        (["--results", tmp_path / "no-such-dir" / "r.jsonl"], "does not exist"),
        (["--results", tmp_path / "a-directory"], "is a directory"),
        (["--report", tmp_path / "a-directory"], "is a directory"),
        (["--results", session / "r.jsonl"], "not a directory"),
        (["--results", readonly], "read-only"),
        (["--report", ""], "an empty path"),
        (["--results", "/proc/r.jsonl"], "cannot create a file"),
    ]


def test_run_refuses_every_bad_output_path_before_running_and_changes_nothing(tmp_path, capsys):
    session = session_file(tmp_path)
    before = {path: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    for options, fragment in _refusals(tmp_path, session):
        started = time.perf_counter()
        code, out, err = cli(capsys, "run", session, *options)
        assert code == 2 and out == "" and fragment in err, (options, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert time.perf_counter() - started < 5  # refused before the engine loads
    assert session.read_bytes() == before[session]
    assert (tmp_path / "readonly.jsonl").read_text() == "keep"
    assert not (tmp_path / "mine.results.jsonl").exists()


def test_a_write_that_fails_after_the_run_is_one_line_and_keeps_the_old_file(tmp_path, capsys, monkeypatch):
    session = session_file(tmp_path)
    results = tmp_path / "mine.results.jsonl"
    results.write_text("the previous recording\n")

    def disk_full(offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_file, "after_chunk", disk_full)
    code, _, err = cli(capsys, "run", session)
    assert code == 2 and "No space left on device" in err and "Traceback" not in err
    assert results.read_text() == "the previous recording\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.results.jsonl", "mine.toml"]


def test_bench_and_sweep_refuse_their_output_paths_before_measuring(tmp_path, capsys):
    base = ["bench", "--model", "tiny", "--device", "cpu", "--pp", "4", "--tg", "none", "--batch", "1", "--reps", "1"]
    code, out, err = cli(capsys, *base, "--json-out", tmp_path)
    assert code == 2 and out == "" and "is a directory" in err
    code, out, err = cli(capsys, *base, "--json-out", tmp_path / "missing" / "b.json")
    assert code == 2 and out == "" and "does not exist" in err
    code, _, err = cli(capsys, "sweep", "--model", "tiny", "--calibration", tmp_path)
    assert code == 2 and "is a directory" in err  # before the check for a GPU
    corrupt = tmp_path / "calibration.json"
    corrupt.write_text("{not json")
    code, _, err = cli(capsys, "sweep", "--model", "tiny", "--calibration", corrupt)
    assert code == 2 and "not replaced" in err and corrupt.read_text() == "{not json"


def test_a_corrupt_calibration_file_is_no_calibration(tmp_path, capsys, monkeypatch):
    for text in ["[" * 5000, '{"version": 1, "entries": 5}', '{"version": 1, "entries": [{"crossover_tokens": 1e999}]}',
                 json.dumps({"version": 1, "entries": [{"device": "cpu", "k": 2, "experts": 8, "hidden": 64,
                                                        "intermediate": 32, "tile_m": 16, "crossover_tokens": -3}]})]:
        path = tmp_path / "calibration.json"
        path.write_text(text)
        monkeypatch.setenv("MOEI_CALIBRATION", str(path))
        code, _, err = cli(capsys, "generate", "--model", "tiny", "--device", "cpu", "--prompt", "hi",
                           "--max-tokens", "1")
        assert code == 0 and "Traceback" not in err, text[:40]


# --------------------------------------------------------------------------------------------
# The TUI's recorder: the user's file is kept
# --------------------------------------------------------------------------------------------

def test_the_recorder_keeps_comments_layout_and_earlier_steps(tmp_path):
    path = session_file(tmp_path)
    recorder = SessionRecorder.load(path)
    recorder.append({"action": "prompt", "prompt": "again", "max_tokens": 3, "flags": {"tile_m": 32}})
    recorder.append({"action": "curve", "tokens": [1, 64]})
    text = path.read_text()
    assert text.startswith(SESSION)  # every byte of the user's file, then the new tables
    session = load_session(path)
    assert [step.action for step in session.steps] == ["prompt", "prompt", "curve"]
    assert session.configs[0].flags == {"tile_m": 32}


def test_the_recorder_edits_flags_in_place_before_the_first_step(tmp_path):
    path = session_file(tmp_path, SESSION.split("[[step]]")[0])
    recorder = SessionRecorder.load(path)
    recorder.append({"action": "flag", "name": "moe_gate", "value": "tile-fill"})
    recorder.append({"action": "flag", "name": "fused_mask", "value": "drop"})
    text = path.read_text()
    assert "# My notes on this session" in text and "# a trailing comment" in text and "# the starting flags" in text
    assert load_session(path).flags == {"moe_gate": "tile-fill", "fused_mask": "drop"}


def test_a_refused_save_as_changes_nothing_and_recording_continues_where_it_was(tmp_path):
    from inspector.tui import TuiSession
    from engine.runtime import Engine

    path = session_file(tmp_path)
    engine = Engine.load("tiny", "cpu", 0)
    session = TuiSession.open(path, engine)
    before = path.read_bytes()
    for refused in [tmp_path, tmp_path / "missing" / "x.toml", path.with_name("mine.results.jsonl")]:
        with pytest.raises(UserError):
            session.save_as(refused)
        assert session.path == path and path.read_bytes() == before
    session.record({"action": "curve", "tokens": [1, 2]})
    assert session.path == path and len(load_session(path).steps) == 2  # autosave still goes to the file


def test_results_recorded_by_run_survive_the_tui_and_replay_still_matches(tmp_path, capsys):
    """The issue's case: `run` records, the TUI opens the hand-written file and runs one prompt,
    and then `replay` must still find every step's recording."""
    from inspector.tui import TuiSession
    from engine.runtime import Engine

    path = session_file(tmp_path)
    code, _, err = cli(capsys, "run", path)
    assert code == 0, err
    engine = Engine.load("tiny", "cpu", 0)
    session = TuiSession.open(path, engine)
    assert len(session.lines) == 1 and not session.note
    flags = session.starting_flags()
    generation = engine.generate("next", 2, flags)
    session.record({"action": "prompt", "prompt": "next", "max_tokens": 2, "flags": dict(flags.values)},
                   {"generations": [generation], "walls": (0.1,)})
    assert path.read_text().startswith(SESSION)
    lines = (tmp_path / "mine.results.jsonl").read_text().splitlines()
    assert len(lines) == 3  # the header, the recording of run's step and the TUI's
    code, _, err = cli(capsys, "replay", path)
    assert code == 0, err


def test_results_that_cannot_be_merged_are_left_as_they_are(tmp_path, capsys):
    from inspector.tui import TuiSession
    from engine.runtime import Engine

    path = session_file(tmp_path)
    results = tmp_path / "mine.results.jsonl"
    assert cli(capsys, "run", path)[0] == 0
    header, *steps = results.read_text().splitlines()
    forged = json.loads(header)
    forged["device"] = "NVIDIA H200"  # recorded elsewhere: nothing to merge with a CPU session
    results.write_text("\n".join([json.dumps(forged), *steps]) + "\n")
    before = results.read_bytes()
    session = TuiSession.open(path, Engine.load("tiny", "cpu", 0))
    assert "left as it is" in session.note
    session.record({"action": "curve", "tokens": [1, 2]})
    assert results.read_bytes() == before and len(load_session(path).steps) == 2


KILL_DURING_RECORDER_SAVE = """
import sys, time
from engine import atomic_file
from inspector.session_recorder import SessionRecorder

recorder = SessionRecorder.load(sys.argv[1])

def slow(offset):
    if offset == 0:
        print("writing", flush=True)
    time.sleep(0.5)

atomic_file.after_chunk = slow
recorder.append({"action": "prompt", "prompt": "x" * 300000, "max_tokens": 1})  # ~300 KB: several chunks
print("finished", flush=True)
"""


def test_kill_9_during_a_recorder_save_leaves_the_old_file_and_no_temporary(tmp_path):
    path = session_file(tmp_path)
    process = subprocess.Popen([sys.executable, "-c", KILL_DURING_RECORDER_SAVE, str(path)], cwd=REPOSITORY,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "writing\n"
        time.sleep(0.2)
        during = sorted(entry.name for entry in tmp_path.iterdir())
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    assert during == ["mine.toml"] and sorted(entry.name for entry in tmp_path.iterdir()) == ["mine.toml"]
    assert path.read_text() == SESSION  # the old file, whole


def test_a_named_temporary_left_by_a_kill_is_removed_by_the_next_write(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    leftover = tmp_path / f".s.toml.deadbeef{atomic_file.TEMP_SUFFIX}"
    leftover.write_text("half")
    old = time.time() - 2 * atomic_file.STALE_AFTER_S
    os.utime(leftover, (old, old))
    atomic_file.atomic_write_text(path, "whole")
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["s.toml"]


def test_an_output_that_is_a_link_is_written_through_and_the_link_kept(tmp_path, capsys):
    """A results file linked into a store: `run` updates the store's file and keeps the link (replacing the link
    by a regular file left the store's copy stale)."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "real.results.jsonl").write_text("old")
    (store / "report.md").write_text("old")
    session = tmp_path / "s.toml"
    session.write_text(SESSION)
    (tmp_path / "s.results.jsonl").symlink_to(store / "real.results.jsonl")
    (tmp_path / "report.md").symlink_to(store / "report.md")
    assert main(["run", str(session), "--device", "cpu", "--report", str(tmp_path / "report.md")]) == 0, \
        capsys.readouterr().err
    for link, target in (("s.results.jsonl", "real.results.jsonl"), ("report.md", "report.md")):
        assert (tmp_path / link).is_symlink() and (store / target).read_text() != "old"
    assert sorted(entry.name for entry in store.iterdir()) == ["real.results.jsonl", "report.md"]


def test_a_pasted_byte_that_is_not_utf8_becomes_a_replacement_character():
    pytest.importorskip("textual")
    from textual.drivers import linux_driver

    from inspector.terminal_input import tolerate_invalid_utf8

    strict = __import__("codecs").getincrementaldecoder("utf-8")()
    with pytest.raises(UnicodeDecodeError):
        strict.decode(b"\xff", final=True)  # what the driver did: its input thread died, the app exited 0
    assert tolerate_invalid_utf8()
    assert linux_driver.getincrementaldecoder("utf-8")().decode(b"a\xffb", final=True) == "a\ufffdb"


# --------------------------------------------------------------------------------------------
# Sizes, refused with both numbers before anything is allocated
# --------------------------------------------------------------------------------------------

def test_sizes_are_refused_with_the_limit_and_where_it_comes_from(capsys, monkeypatch):
    cases = [
        (["check-attention", "--device", "cpu", "--seq-len", "25000"], "needs about"),
        (["check-attention", "--device", "cpu", "--heads", "100000"], "needs about"),
        (["bench", "--model", "tiny", "--device", "cpu", "--pp", "4", "--tg", "none", "--batch", "99999999999"],
         "needs about"),
        (["bench", "--model", "tiny", "--device", "cpu", "--pp", "4", "--tg", "none", "--reps", "99999999"],
         "more than 1000"),
        (["bench", "--model", "tiny", "--device", "cpu", "--pp", ",".join(["4"] * 300), "--tg", "none"],
         "more than the 256"),
        (["curve", "--experts", "9223372036854775807"], "more than 1048576"),
        (["curve", "--tokens", "9" * 400], "a number of 400 digits"),
        (["generate", "--model", "tiny", "--device", "cpu", "--prompt", os.fsdecode(b"\xff"), "--max-tokens", "1"],
         "byte 0xff"),
    ]
    monkeypatch.setattr(limits, "available_bytes", lambda device: 16 * 2**30)  # the same on every machine
    for argv, fragment in cases:
        started = time.perf_counter()
        code, out, err = cli(capsys, *argv)
        assert code == 2 and fragment in err and "Traceback" not in err, (argv, err)
        assert time.perf_counter() - started < 5
    _, _, err = cli(capsys, *cases[0][0])
    assert "16.0 GiB" in err  # both sizes in the message


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

CONFIG = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_hidden_layers=2, hidden_size=32,
              intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=256, hidden_act="silu")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {"model.embed_tokens.weight": draw(64, 32), "model.norm.weight": 1 + draw(32),
               "lm_head.weight": draw(64, 32)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        tensors.update({prefix + "input_layernorm.weight": 1 + draw(32),
                        prefix + "post_attention_layernorm.weight": 1 + draw(32),
                        prefix + "self_attn.q_proj.weight": draw(32, 32), prefix + "self_attn.k_proj.weight": draw(16, 32),
                        prefix + "self_attn.v_proj.weight": draw(16, 32), prefix + "self_attn.o_proj.weight": draw(32, 32),
                        prefix + "block_sparse_moe.gate.weight": draw(4, 32)})
        for expert in range(4):
            experts = prefix + f"block_sparse_moe.experts.{expert}."
            tensors.update({experts + "w1.weight": draw(16, 32), experts + "w3.weight": draw(16, 32),
                            experts + "w2.weight": draw(32, 16)})
    return tensors


def make_checkpoint(directory: Path, config=None, tensors=None, shards: int = 1) -> Path:
    """A tiny Mixtral-format checkpoint (config.json, safetensors, tokenizer.json), without transformers."""
    pytest.importorskip("tokenizers")  # in the test extra; HF checkpoints need it
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**CONFIG, **(config or {})}))
    tokenizer = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(63)}, "[UNK]": 63}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    tensors = _tensors() if tensors is None else tensors
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names, weight_map = sorted(tensors), {}
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: tensors[name] for name in names[shard::shards]}, str(directory / file_name))
        weight_map.update({name: file_name for name in names[shard::shards]})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def generate(capsys, directory):
    return cli(capsys, "generate", "--model", directory, "--prompt", "w1 w2", "--max-tokens", "1", "--device", "cpu")


def test_a_good_checkpoint_still_loads(tmp_path, capsys):
    code, out, err = generate(capsys, make_checkpoint(tmp_path / "ok", shards=2))
    assert code == 0, err


@pytest.mark.parametrize("shard", ["../../../../../../etc/passwd", "/etc/passwd", "../other/model.safetensors",
                                   "sub/../../escape.safetensors"])
def test_index_shards_outside_the_directory_are_refused_unopened(tmp_path, capsys, monkeypatch, shard):
    from engine import checkpoint

    directory = make_checkpoint(tmp_path / "ckpt", shards=2)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    opened = []
    monkeypatch.setattr(checkpoint, "read_header", lambda path: opened.append(path) or {})
    code, _, err = generate(capsys, directory)
    assert code == 2 and "lies outside the checkpoint directory" in err and repr(shard) in err
    assert not any("passwd" in str(path) or "other" in str(path) for path in opened)
    assert "3475222254926655346" not in err  # b"root:x:0" read as a header length


def test_symbolic_links_leading_out_are_refused_and_the_hub_cache_layout_is_kept(tmp_path, capsys):
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    directory = make_checkpoint(tmp_path / "links")
    (directory / "zz.safetensors").symlink_to(outside)
    code, _, err = generate(capsys, directory)
    assert code == 2 and "zz.safetensors" in err and "lies outside" in err and str(outside) in err
    # The hub cache: snapshots/REVISION/FILE -> ../../blobs/HASH, each file a link into the blob store.
    repository = tmp_path / "models--org--tiny"
    built = make_checkpoint(tmp_path / "built")
    snapshot = repository / "snapshots" / "0123abc"
    (repository / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in built.iterdir():
        blob = repository / "blobs" / f"hash-{file.name}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    code, _, err = generate(capsys, snapshot)
    assert code == 0, err


@pytest.mark.parametrize("config, fragment", [
    ({"num_local_experts": 10**9}, "more than 65536"),
    ({"num_hidden_layers": 10**8}, "more than 4096"),
    ({"num_hidden_layers": 4000}, "holds tensors of 2 layers"),
    ({"num_local_experts": 60000}, "per-expert tensors of 4 experts"),
    ({"hidden_size": 200000}, "config.json makes it"),
    ({"rms_norm_eps": [1]}, "'rms_norm_eps' is [1], expected a number"),
    ({"rope_scaling": "yarn"}, "expected an object"),
    ({"architectures": [[]]}, "expected a list of strings"),
    ({"quantization_config": "mxfp4"}, "expected an object"),
    ({"rms_norm_eps": -1}, "'rms_norm_eps' is -1, and it must be above 0"),
    ({"rope_theta": 0}, "'rope_theta' is 0, and it must be above 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.0}}, "rope_scaling.'factor' is 0.0, and it must be above 0"),
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters says rope_type 'default' and rope_scaling says 'yarn'"),
])
def test_config_sizes_and_types_are_refused_before_any_allocation(tmp_path, capsys, monkeypatch, config, fragment):
    from engine import hf_loader

    directory = make_checkpoint(tmp_path / "ckpt", config)

    original = torch.empty

    def no_weight_allocation(*shape, **kwargs):  # a scalar (an element size) is fine; a weight is not
        sizes = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if sizes and __import__("math").prod(sizes) > 1:
            raise AssertionError(f"allocated {tuple(sizes)} before validating")
        return original(*shape, **kwargs)

    monkeypatch.setattr(hf_loader.torch, "empty", no_weight_allocation)
    started = time.perf_counter()
    code, _, err = generate(capsys, directory)
    assert code == 2 and fragment in err and "Traceback" not in err, err
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weights_are_refused_naming_the_tensor_unless_allowed(tmp_path, capsys, monkeypatch, value):
    tensors = _tensors()
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    tensors[name][3, 4] = value
    directory = make_checkpoint(tmp_path / "ckpt", tensors=tensors)
    code, _, err = generate(capsys, directory)
    assert code == 2 and name in err and "MOEI_NONFINITE_WEIGHTS=allow" in err
    monkeypatch.setenv("MOEI_NONFINITE_WEIGHTS", "allow")
    code, _, err = generate(capsys, directory)
    assert code == 0, err


def test_a_hostile_tensor_name_reaches_the_terminal_escaped(tmp_path, capsys):
    tensors = _tensors()
    tensors["\x1b[2Jmodel.extra"] = torch.ones(2)
    code, _, err = generate(capsys, make_checkpoint(tmp_path / "ckpt", tensors=tensors))
    assert code == 2 and "\x1b" not in err and "\\x1b[2Jmodel.extra" in err


def test_no_output_overwrites_the_calibration_file_a_run_reads(tmp_path, capsys, monkeypatch):
    calibration = tmp_path / "calibration.json"
    calibration.write_text("{}")
    monkeypatch.setenv("MOEI_CALIBRATION", str(calibration))
    session = tmp_path / "s.toml"
    session.write_text(SESSION)
    for option in ("--report", "--trace"):
        assert main(["run", str(session), "--device", "cpu", option, str(calibration)]) == 2
        err = capsys.readouterr().err
        assert "that is the calibration file moe_gate=measured reads" in err and calibration.read_text() == "{}"


def test_a_tied_head_stored_unlike_the_embedding_is_refused(tmp_path, capsys):
    """tie_word_embeddings with an lm_head.weight of its own: the config and the weights disagree (transformers
    and this engine read it differently), refused before loading; one equal to the embedding loads."""
    tensors = _tensors()
    directory = make_checkpoint(tmp_path / "differs", {"tie_word_embeddings": True}, tensors)
    code, _, err = generate(capsys, directory)
    assert code == 2 and "tensor lm_head.weight is not the embedding (model.embed_tokens.weight), and config.json " \
        "sets tie_word_embeddings" in err, err
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    code, _, err = generate(capsys, make_checkpoint(tmp_path / "same", {"tie_word_embeddings": True}, tensors))
    assert code == 0, err


def test_an_index_that_is_not_a_regular_file_is_refused_not_skipped(tmp_path, capsys):
    """A FIFO under the index's name was skipped and the shards globbed: the checkpoint is not what it says."""
    directory = make_checkpoint(tmp_path / "fifo-index", shards=2)
    index = directory / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)
    code, _, err = generate(capsys, directory)
    assert code == 2 and "model.safetensors.index.json: not a regular file" in err, err


def test_outputs_never_replace_a_checkpoints_generation_config(tmp_path, capsys):
    directory = make_checkpoint(tmp_path / "ckpt")
    (directory / "generation_config.json").write_text("{}")
    code, _, err = cli(capsys, "generate", "--model", directory, "--prompt", "w1", "--max-tokens", "1", "--device",
                       "cpu", "--trace", directory / "generation_config.json")
    assert code == 2 and "a file a load of the checkpoint" in err
    assert (directory / "generation_config.json").read_text() == "{}"


def _overlap(header: dict) -> None:
    """model.norm.weight's bytes moved onto the start of the embedding's."""
    first = header["model.embed_tokens.weight"]["data_offsets"][0]
    span = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [first, first + span[1] - span[0]]


@pytest.mark.parametrize("edit, fragment", [
    (lambda header: header.update({"__metadata__": {"format": ["pt"]}}), "__metadata__ is not an object of text"),
    (_overlap, "claim overlapping bytes"),
])
def test_a_header_the_reader_would_refuse_names_the_problem_not_another_tensor(tmp_path, capsys, edit, fragment):
    """safetensors refused these naming model.embed_tokens.weight, a tensor with nothing wrong."""
    import struct

    directory = make_checkpoint(tmp_path / "ckpt")
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])
    code, _, err = generate(capsys, directory)
    assert code == 2 and fragment in err, err
