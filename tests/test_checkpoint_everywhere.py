"""A checkpoint directory works wherever a preset does: bench, sessions (a path relative to the session
file) and replay, the TUI; a directory holding only config.json runs with random weights of its shape;
the results record the checkpoint; a moved checkpoint and a config without weights are refused in a line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import flags  # noqa: E402
from engine.runtime import Engine  # noqa: E402
from inspector import cli  # noqa: E402

CONFIG = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=300, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
              norm_topk_prob=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint saved by transformers, with a tokenizer.json (test_hf_models' BPE)."""
    from test_hf_models import _write_tokenizer

    directory = tmp_path_factory.mktemp("models") / "qwen3"
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory


@pytest.fixture
def config_only(tmp_path, checkpoint):
    directory = tmp_path / "shape"
    directory.mkdir()
    shutil.copy(checkpoint / "config.json", directory / "config.json")
    return directory


def _run(argv, capsys):
    code = cli.main([str(part) for part in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _recorded_session(directory: Path, folder: str, steps: str, capsys, engine: str = "") -> Path:
    """A session in `directory` on the checkpoint ./`folder` beside it (`engine`: more [engine] lines), run once."""
    session = directory / "s.toml"
    session.write_text(f'[session]\nversion = 1\nname = "dir"\n\n[engine]\nmodel = "./{folder}"\ndevice = "cpu"\n'
                       f'{engine}\n{steps}')
    code, _, err = _run(["run", session], capsys)
    assert code == 0, err
    return session


def test_bench_takes_a_checkpoint_directory_and_records_it(checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code, text, _ = _run(["bench", "--model", checkpoint, "--device", "cpu", "--pp", "16", "--tg", "8",
                          "--batch", "1", "--reps", "1", "--no-progress", "--json-out", out], capsys)
    assert code == 0, text
    footer = json.loads(out.read_text())["footer"]
    assert footer["checkpoint"]["family"] == "qwen3-moe"
    assert footer["checkpoint"]["weights"]["source"] == "files"
    assert footer["checkpoint"]["weights"]["files"][0]["bytes"] > 0
    assert len(footer["checkpoint"]["config_sha256"]) == 16
    assert "checkpoint:" in text and "qwen3-moe" in text


def test_a_config_only_directory_needs_random_weights(config_only, capsys):
    code, _, err = _run(["bench", "--model", config_only, "--device", "cpu", "--pp", "16", "--tg", "none",
                         "--batch", "1", "--reps", "1", "--no-progress"], capsys)
    assert code == 2 and "config.json but no *.safetensors: give --weights random" in err
    assert len(err.strip().splitlines()) == 1
    code, text, _ = _run(["bench", "--model", config_only, "--weights", "random", "--device", "cpu", "--pp", "16",
                          "--tg", "4", "--batch", "1", "--reps", "1", "--no-progress", "--format", "json"], capsys)
    assert code == 0
    footer = json.loads(text)["footer"]
    assert footer["checkpoint"]["weights"] == {"source": "random", "seed": 0, "drawn_on": "cpu"}


def test_random_weights_of_a_directory_have_its_shape_and_are_deterministic(config_only):
    one, two = (Engine.load(str(config_only), "cpu", seed=3, weights="random") for _ in range(2))
    assert one.config.n_experts == 8 and one.config.qk_norm == "per_head"
    assert all(torch.equal(one.weights[name], two.weights[name]) for name in one.weights)
    resolved = flags.resolve(environ={})
    assert one.generate("same", 4, resolved).tokens == two.generate("same", 4, resolved).tokens


def test_a_checkpoint_without_its_tokenizer_benches_but_refuses_text(checkpoint, tmp_path, capsys):
    directory = tmp_path / "untokenized"
    shutil.copytree(checkpoint, directory)
    (directory / "tokenizer.json").unlink()
    code, _, err = _run(["generate", "--model", directory, "--device", "cpu", "--prompt", "hello"], capsys)
    assert code == 2 and "a text prompt needs the checkpoint's tokenizer.json" in err
    code, text, _ = _run(["bench", "--model", directory, "--device", "cpu", "--pp", "16", "--tg", "none",
                          "--batch", "1", "--reps", "1", "--no-progress", "--format", "json"], capsys)
    assert code == 0 and "prompts as byte tokens: no tokenizer.json" in json.loads(text)["footer"]["weights"]


def test_a_text_prompt_is_refused_before_a_weight_is_read(checkpoint, tmp_path, capsys):
    """generate and compare know they will encode text: without a tokenizer the refusal comes before the load (here
    the weights are garbage, so a refusal after loading them would name the file instead)."""
    directory = tmp_path / "untokenized"
    shutil.copytree(checkpoint, directory)
    (directory / "tokenizer.json").unlink()
    for weights in directory.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    for command in (["generate", "--prompt", "hello"], ["compare", "--prompt", "hello"]):
        code, _, err = _run([*command, "--model", directory, "--device", "cpu"], capsys)
        assert code == 2 and "a text prompt needs the checkpoint's tokenizer.json" in err, err


def test_a_model_larger_than_free_memory_is_refused_before_loading(config_only, monkeypatch):
    from engine import model_source
    from engine.errors import UserError

    monkeypatch.setattr(model_source, "free_bytes", lambda device: 1000)
    with pytest.raises(UserError, match=r"take 0\.\d\d GiB .* more than 90% of the 0\.00 GiB free"):
        Engine.load(str(config_only), "cpu", weights="random")

    with pytest.raises(UserError, match="config.json but no \\*.safetensors: give --weights random"):
        Engine.load(str(config_only), "cpu")  # the missing weights first: their fix holds at any size


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["compare", "--prompt", "hi"]])
def test_a_preset_larger_than_free_memory_is_refused_before_a_weight_is_drawn(command, monkeypatch, capsys):
    """A preset's weights go through the same check as a directory's: one line naming both sizes and the presets
    that would fit, exit 2, nothing drawn (v4-shape on a CPU grew until the OS killed it)."""
    from engine import model_source, runtime

    monkeypatch.setattr(model_source, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(runtime, "random_weights", lambda *args, **kwargs: pytest.fail("weights drawn"))
    code, _, err = _run([*command, "--model", "tiny", "--device", "cpu", "--max-tokens", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--model tiny: the model's weights take" in err and "use a smaller preset (demo, v4-shape)" in err


def test_a_session_runs_and_replays_a_relative_checkpoint_and_refuses_it_moved(checkpoint, tmp_path, capsys):
    session_directory = tmp_path / "work"
    session_directory.mkdir()
    shutil.copytree(checkpoint, session_directory / "ckpt")
    session = _recorded_session(session_directory, "ckpt", '[[step]]\naction = "prompt"\nprompt = "hello"\n'
                                'max_tokens = 5\n\n[[step]]\naction = "bench"\npp = [16]\ntg = [4]\nbatch = [1]\n'
                                'reps = 1\n', capsys)
    header = json.loads((session_directory / "s.results.jsonl").read_text().splitlines()[0])
    assert header["model"] == "./ckpt" and header["checkpoint"]["family"] == "qwen3-moe"
    assert header["checkpoint"]["path"] == str((session_directory / "ckpt").resolve())
    code, _, err = _run(["replay", session], capsys)
    assert code == 0, err
    (session_directory / "ckpt").rename(session_directory / "moved")
    code, _, err = _run(["run", session], capsys)
    assert code == 2 and "ckpt does not exist" in err and "was the checkpoint moved?" in err
    assert (session_directory / "s.results.jsonl").exists()  # nothing recorded is lost
    # the path fixed as the refusal says: the same checkpoint by content, so the recording replays
    session.write_text(session.read_text().replace('model = "./ckpt"', 'model = "./moved"'))
    code, _, err = _run(["replay", session], capsys)
    assert code == 0, err
    (session_directory / "moved" / "config.json").write_text(
        (session_directory / "moved" / "config.json").read_text().replace("}", ', "note": 1}', 1))
    code, _, err = _run(["replay", session], capsys)
    assert code == 2 and "config.json sha256" in err, err


def test_replay_refuses_a_checkpoint_changed_in_place_and_reads_older_recordings(checkpoint, tmp_path, capsys):
    """A fine-tune written over the same files keeps every name and size: the results header's sampled hash of each
    file tells it apart before anything re-runs. A recording made before the hash was kept still replays."""
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    session = _recorded_session(tmp_path, "ckpt", '[[step]]\naction = "prompt"\nprompt = "hello"\nmax_tokens = 3\n',
                                capsys)
    results = tmp_path / "s.results.jsonl"
    lines = results.read_text().splitlines()
    header = json.loads(lines[0])
    files = header["checkpoint"]["weights"]["files"]
    assert files and all(len(entry["sample_sha256"]) == 16 for entry in files)
    for entry in files:  # as a recording before the sampled hash: compared by name and size
        del entry["sample_sha256"]
    results.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    code, _, err = _run(["replay", session], capsys)
    assert code == 0, err
    results.write_text("\n".join(lines) + "\n")
    weights = tmp_path / "ckpt" / files[0]["file"]
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(255 - value for value in data[middle:middle + 8])
    weights.write_bytes(bytes(data))
    code, out, err = _run(["replay", session], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"other bytes in {weights.name} (the same name and size: a checkpoint changed in place)" in err


def test_the_tui_runs_a_checkpoint_directory(checkpoint):
    from test_tui import make_app, run_prompt, synchronously

    from inspector import events
    from inspector.widgets.dispatch_log import DispatchLog

    engine = Engine.load(str(checkpoint), "cpu")

    @synchronously
    async def drive():
        app = make_app(engine)
        async with app.run_test(size=(200, 50)) as pilot:
            main = await run_prompt(pilot, app, "hello", max_tokens=4)
            run = main.current_run
            assert len(run.tokens[events.A]) == len(run.tokens[events.B]) == 4
            assert len(main.query_one(DispatchLog).entries) == 2 * 4 * 2 * engine.config.n_layers

    drive()


def _counting_loads(monkeypatch) -> list:
    """Every Engine.load from here on, counted (the replay preflight must refuse before any)."""
    loads, load = [], Engine.load.__func__

    def counted(cls, *args, **kwargs):
        loads.append(args[:1])
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(counted))
    return loads


def test_provenance_before_loading_is_what_the_load_records(checkpoint, config_only):
    """The replay preflight predicts a load's provenance from config.json and file sizes: it must not drift."""
    device = torch.device("cpu")
    for model, weights in ((str(checkpoint), "auto"), (str(config_only), "random")):
        engine = Engine.load(model, "cpu", 3, weights)
        assert Engine.provenance_before_load(model, device, 3, weights) == (None, engine.checkpoint)
    for model, weights in (("tiny", "auto"), ("tiny", "random"), ("demo", "random")):
        words, checkpoint = Engine.provenance_before_load(model, device, 3, weights)
        assert checkpoint is None and words == Engine.load(model, "cpu", 3, weights).weights_source


def test_replay_refuses_other_weights_before_running_a_step(config_only, tmp_path, capsys, monkeypatch):
    """replay re-ran the whole session, then refused it for other weights: a changed config.json (and a preset's
    other weights) is named in one line, exit 2, before a model is loaded or a step runs."""
    session_directory = tmp_path / "work"
    shutil.copytree(config_only, session_directory / "shape")
    session = _recorded_session(session_directory, "shape", '[[step]]\naction = "prompt"\nprompt = "hi"\n'
                                'max_tokens = 2\n', capsys, engine='weights = "random"\n')
    results = session_directory / "s.results.jsonl"
    recorded = results.read_text()
    config_path = session_directory / "shape" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = 5000.0  # another model under the same path and family
    config_path.write_text(json.dumps(config))
    loads = _counting_loads(monkeypatch)
    code, out, err = _run(["replay", session], capsys)
    assert code == 2 and loads == [] and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    old_hash = json.loads(recorded.splitlines()[0])["checkpoint"]["config_sha256"]
    assert f"recorded with config.json sha256 {old_hash}, the checkpoint now has " in err
    assert "nothing was re-run" in err and results.read_text() == recorded  # nothing recorded is lost

    preset = tmp_path / "p.toml"  # a preset: the weights' words
    preset.write_text('[session]\nversion = 1\nname = "p"\n\n[engine]\nmodel = "tiny"\ndevice = "cpu"\n\n'
                      '[[step]]\naction = "prompt"\nprompt = "hi"\nmax_tokens = 2\n')
    code, _, err = _run(["run", preset], capsys)
    assert code == 0, err
    lines = (tmp_path / "p.results.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["weights"] == "random, seed 0"
    (tmp_path / "p.results.jsonl").write_text("\n".join([json.dumps({**header, "weights": "random, seed 7"}),
                                                         *lines[1:]]) + "\n")
    loads.clear()
    code, _, err = _run(["replay", preset], capsys)
    assert code == 2 and loads == [] and len(err.strip().splitlines()) == 1
    assert "recorded with weights 'random, seed 7', the model now loads 'random, seed 0'" in err
