"""A quantize run: a model (a preset or a checkpoint directory) -> a trellis checkpoint directory
(engine.trellis_checkpoint), resumably.

The run writes into a hidden sibling of the output, `.NAME.partial/`, and renames it to NAME only when
every file is in place, so a kill leaves either no output directory or a complete one. Inside the partial
directory each layer's experts go to their own file, written whole (temporary name, then rename) with
its error report beside it; the same command run again finds the partial directory, checks that it was
started with the same source and code (`job.json`), and skips the layers it finished, each checked first as the
loader checks it and against this run's code, seeds, blocks and shapes: one that fails (cut, edited, replaced by
a link or another checkpoint's file) is quantized again, with a note. A file the run does not write refuses the
resume, and a write the system refuses (a full disk) is one line; the finished layers stay for the same command.

Only the routed experts of the MoE layers are coded. Dense tensors (attention, norms, router, embeddings, head,
shared experts, the MLPs of dense layers) are copied as they are, in bf16. Seeds: each
matrix's sign seeds are crc32 of (seed, matrix name, side), recorded in config.json. With a calibration
text, the model runs it first (reference arms) and each expert's inputs' Hessians weigh its error (LDLQ).
Knows nothing of argument parsing or screens (inspector.commands.quantize).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from engine import trellis_checkpoint as tc
from engine.comma_list import split_items
from engine.errors import UserError
from engine.printable import printable
from engine.progress import Progress
from engine.source_fingerprint import differences, fingerprint
from engine.trellis_quantizer import quantization_report, quantize_stack
from kernels.trellis_reference import (BITS_PER_WEIGHT, CODES, SEQUENCE, TILE, TrellisCode, TrellisMatrix,
                                       default_hyb_table, dequantize, hadamard_block)

JOB_FILE = "job.json"
# Experts quantized per call: bounds the float32 copies the search makes of a stack (rotated, normalised,
# tiles) to about 3 x 4 x 2^26 bytes whatever the model
_CHUNK_WEIGHTS = 1 << 26


def parse_experts(text: str) -> TrellisCode:
    """`trellis:K=2,code=hyb` (V optional, it must be the code's own) -> the code; UserError otherwise."""
    allowed = (f"trellis:K=<{'|'.join(map(str, BITS_PER_WEIGHT))}>,code=<{'|'.join(CODES)}>[,V=<1|2>]")
    kind, _, options = text.partition(":")
    if kind != "trellis":
        raise UserError(f"--experts {text!r}: the expert format must be {allowed}")
    values: dict[str, str] = {}
    for item in split_items(options, "--experts"):
        key, equals, value = item.partition("=")
        if not equals or key not in ("K", "V", "code") or key in values:
            raise UserError(f"--experts {text!r}: {item!r} is not K=, V= or code= (or is given twice); use {allowed}")
        values[key] = value
    if "K" not in values or "code" not in values:
        raise UserError(f"--experts {text!r}: give both K and code, e.g. trellis:K=2,code=hyb")
    if values["code"] not in CODES:
        raise UserError(f"--experts {text!r}: unknown code {values['code']!r}; choose one of {', '.join(CODES)}")
    numbers = [values["K"], values.get("V", str(CODES[values["code"]]))]
    if not all(number.isascii() and number.isdigit() for number in numbers):  # int() takes " 2", "2_0", "٢"
        raise UserError(f"--experts {text!r}: K and V are integers written in digits; use {allowed}")
    bits, step = (int(number) for number in numbers)
    try:
        return TrellisCode(values["code"], bits, step)
    except ValueError as error:
        raise UserError(f"--experts {text!r}: {error}") from None


def matrix_seeds(seed: int, matrix: str) -> tuple[int, int]:
    return (zlib.crc32(f"{seed}:{matrix}:left".encode()), zlib.crc32(f"{seed}:{matrix}:right".encode()))


def partial_directory(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


@dataclass
class QuantizeResult:
    out: Path
    code: TrellisCode
    matrices: list[dict]  # per matrix: name, shape, mse, relative_mse, max_abs_error, seconds
    resumed_layers: list[int]
    seconds: float
    expert_bytes: int
    bf16_expert_bytes: int

    def to_json(self) -> dict:
        return {"out": str(self.out), "code": self.code.describe(), "matrices": self.matrices,
                "resumed_layers": self.resumed_layers, "seconds": round(self.seconds, 2),
                "expert_bytes": self.expert_bytes, "bf16_expert_bytes": self.bf16_expert_bytes}


def _check_output(out: Path) -> None:
    if out.exists() or out.is_symlink():
        raise UserError(f"--out {out}: exists; quantize writes a new directory and never overwrites one: choose "
                        f"another path or remove it")
    if not out.parent.exists():
        raise UserError(f"--out {out}: the parent directory {out.parent} does not exist; create it first (mkdir -p)")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: {out.parent} is not a directory; check the path")
    try:  # a real write, not os.access: root passes access() on a read-only or pseudo file system
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=out.parent))
    except OSError as error:
        raise UserError(f"--out {out}: cannot write in {out.parent} ({error.strerror}); pick a writable "
                        f"place") from None


def _check_outside(out: Path, model: str) -> None:
    """The output may not lie inside the source checkpoint's directory: quantize never writes into the user's
    model (a later load of the source would also find a checkpoint nested in it)."""
    source = Path(model).expanduser()
    if not source.is_dir():
        return  # a preset
    inside = out.resolve().parent
    if inside == source.resolve() or source.resolve() in inside.parents:
        raise UserError(f"--out {out}: inside the source model's directory {source}; quantize never writes into "
                        f"the model it reads: pick a path outside it")


def _source(engine, model: str, weights: str) -> dict:
    """What config.json records of the source: enough to load it again, and its fingerprint
    (engine.source_fingerprint), which check-quant and a resumed run compare with the model they are given."""
    where = str(Path(model).resolve()) if engine.checkpoint is not None else model
    return {"model": where, "weights": weights, "seed": engine.seed, "description": engine.weights_source,
            "fingerprint": fingerprint(model, weights, engine.seed)}


def _check_not_trellis(model: str) -> None:
    """Refuse a trellis checkpoint directory from its config.json alone, before its weights load."""
    from engine.hf_loader import read_config_values
    from engine.trellis_checkpoint import is_trellis_config

    directory = Path(model).expanduser()
    if not (directory / "config.json").is_file():
        return  # a preset, or a directory the loader refuses with its own line
    values, _ = read_config_values(directory)  # the loader's reader: its size bound, its one-line errors
    if is_trellis_config(values):
        raise UserError(f"--model {model}: its experts are trellis-coded already; quantize the original model")


def quantize_model(model: str, code: TrellisCode, out: str | Path, *, seed: int = 0, device: str = "auto",
                   weights: str = "auto", stream: TextIO | None = None, batch: int | None = None,
                   calibration: str | Path | None = None, calibration_tokens: int = 8192) -> QuantizeResult:
    """Quantize `model`'s experts into `code` and write the checkpoint directory `out` (module docstring).
    `calibration`: a text file run through the model first; each expert's error is then weighed by its
    inputs' Hessian (engine.trellis_quantizer, LDLQ) instead of plain. A UserError, before anything is
    written, for an output that exists, a model whose experts this format does not compute (biases, clamped
    SwiGLU), sides that are not multiples of 16 or an unreadable calibration file."""
    from engine.runtime import Engine

    out = Path(out)
    _check_output(out)
    _check_outside(out, model)
    text = None if calibration is None else _calibration_text(Path(calibration))  # before the model loads
    _check_not_trellis(model)
    tokenizer_file = Path(model) / "tokenizer.json"
    if os.path.lexists(tokenizer_file) and not tokenizer_file.is_file():  # copied at the end: a pipe would hang it,
        # and skipping it would publish a checkpoint that refuses text prompts
        raise UserError(f"{printable(str(tokenizer_file))}: not a regular file (a device, a socket, a pipe or a link "
                        f"that leads nowhere); the quantized checkpoint copies the source's tokenizer: replace it by "
                        f"the file")
    engine = Engine.load(model, device=device, weights=weights)
    config = engine.config
    if not config.plain_experts:
        raise UserError(f"--model {model}: {config.name}'s experts have biases or the clamped SwiGLU, which the "
                        f"trellis arms do not compute; quantize a model with plain SwiGLU experts")
    if isinstance(engine.weights[f"layers.{config.moe_layers[0]}.w13"], TrellisMatrix):
        raise UserError(f"--model {model}: its experts are trellis-coded already; quantize the original model")
    for size, what in ((config.hidden, "hidden size"), (config.intermediate, "expert intermediate size")):
        if size % TILE:
            raise UserError(f"--model {model}: {what} {size} is not a multiple of the {TILE} x {TILE} trellis tile")
    source = _source(engine, model, weights)
    hessians = None
    if calibration is not None:
        tokens = engine.encode_prompt(text)[:calibration_tokens]
        hessians = calibration_hessians(engine, tokens)
        source["calibration"] = {"file": str(Path(calibration).resolve()), "tokens": len(tokens),
                                 "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
    job = {"format_version": tc.FORMAT_VERSION, "source": source, "code": code.code, "bits_per_weight": code.K,
           "weights_per_step": code.V, "seed": seed}
    partial = partial_directory(out)
    if partial.is_symlink():
        raise UserError(f"{partial}: a link (to {os.readlink(partial)}); quantize makes its partial directory itself: "
                        f"remove the link (rm {partial})")
    if partial.is_dir() and (partial / JOB_FILE).is_file():
        try:
            started = json.loads((partial / JOB_FILE).read_text())
        except (OSError, ValueError):
            started = None
        if started != job:
            raise UserError(f"{partial}: a quantize run with other settings left this partial directory "
                            f"({'; '.join(_job_differences(started, job))}); finish it with "
                            f"`{_resume_command(started, out)}`, or remove it (rm -r {partial}) to start over")
    else:
        partial.mkdir(exist_ok=True)
        tc.write_json(partial / JOB_FILE, job)
    table = default_hyb_table() if code.needs_table else None
    stream = sys.stderr if stream is None else stream
    _check_partial_names(partial, config)
    kept = {}
    for layer in config.moe_layers:  # each kept layer checked as the loader would, before the first is reused
        kept[layer], why = _finished_layer(engine, partial, layer, code, seed, table)
        if why:
            print(printable(f"moe-inspector: note: {why}; quantizing layer {layer} again", limit=None), file=stream)
    sequences = sum(int(engine.weights[name].numel()) // SEQUENCE for name in tc.expert_matrices(config))
    progress = Progress(sequences, f"quantizing {config.name} to {code.describe()}", stream=stream)
    began = time.perf_counter()
    reports, resumed, layouts = [], [], {}
    try:
        for layer in config.moe_layers:  # a dense layer has no experts: dense.safetensors keeps its MLP
            done = kept[layer]
            if done is not None:
                resumed.append(layer)
                progress.advance(sum(item["sequences"] for item in done), note=f"layer {layer} (kept)")
            else:
                done = _quantize_layer(engine, layer, code, seed, table, partial, progress, batch, hessians)
            for item in done:
                layouts[item["name"]] = tc.MatrixLayout(tuple(item["shape"]), *item["layout"])
            reports.extend(done)
    finally:
        progress.close()
    layout = tc.TrellisLayout(code, seed, layouts)
    tc.write_tensors(partial / tc.DENSE_FILE, {name: engine.weights[name].to(torch.bfloat16)
                                               for name in _dense_names(config)})
    # a preset reads bytes, and so do a directory's random weights (as their own load does, with a byte vocabulary);
    # a directory's own weights its tokenizer.json, or none (prompts refused as its own loader does)
    drawn = weights == "random" and config.vocab_size >= 256
    tokenizer = "bytes" if engine.checkpoint is None or drawn else "none"
    if engine.checkpoint is not None and (Path(model) / "tokenizer.json").is_file():
        tc.write_bytes(partial / "tokenizer.json", (Path(model) / "tokenizer.json").read_bytes())
        tokenizer = "tokenizer.json"
    seconds = time.perf_counter() - began
    result = QuantizeResult(out, code, [{k: v for k, v in item.items() if k != "layout"} for item in reports],
                            resumed, seconds, tc.expert_bytes(config, code), tc.bf16_expert_bytes(config))
    tc.write_json(partial / tc.REPORT_FILE, result.to_json() | {"source": source})
    written = tc.config_json(config, layout, source, tokenizer)
    tc.read_config(json.loads(json.dumps(written)), partial / "config.json")  # what every load will check first
    tc.write_json(partial / "config.json", written)
    for path in partial.glob("experts-*.json"):  # the per-layer reports live on in quantization.json
        path.unlink()
    for name in _partial_names(config):  # a killed write's leftovers
        if name.endswith(".tmp"):
            (partial / name).unlink(missing_ok=True)
    (partial / JOB_FILE).unlink()
    os.replace(partial, out)  # the output appears whole, or not at all
    return result


def _job_differences(started, job: dict) -> list[str]:
    """What differs between the job.json a partial directory was started with and this run's, in words."""
    if not isinstance(started, dict):
        return [f"its {JOB_FILE} is unreadable"]
    words = []
    for key, what in (("format_version", "format version"), ("code", "code"), ("bits_per_weight", "K"),
                      ("weights_per_step", "V"), ("seed", "--seed")):
        if started.get(key) != job[key]:
            words.append(f"{what} {started.get(key)} then, {job[key]} now")
    then = started.get("source") if isinstance(started.get("source"), dict) else {}
    now = job["source"]
    for key, what in (("model", "model"), ("weights", "--weights"), ("seed", "weight seed")):
        if then.get(key) != now.get(key):
            words.append(f"{what} {then.get(key)} then, {now.get(key)} now")
    if then.get("calibration") != now.get("calibration"):
        words.append("the --calibration text or its token count differs")
    recorded = then.get("fingerprint")
    if not isinstance(recorded, dict):
        words.append("the source's fingerprint was not recorded then")
    else:
        words += [f"the source changed: {item}" for item in differences(recorded, now["fingerprint"])]
    return words or [f"{JOB_FILE} differs"]


def _resume_command(started, out: Path) -> str:
    """The quantize command that finishes the run a job.json records (as far as it records one)."""
    if not isinstance(started, dict) or not isinstance(started.get("source"), dict):
        return f"moe-inspector quantize MODEL --experts FORMAT --out {out}"
    source = started["source"]
    words = [f"moe-inspector quantize {source.get('model')} --experts "
             f"trellis:K={started.get('bits_per_weight')},code={started.get('code')} --out {out}"]
    if started.get("seed"):
        words.append(f"--seed {started['seed']}")
    if source.get("weights") == "random":
        words.append("--weights random")
    calibration = source.get("calibration")
    if isinstance(calibration, dict):
        words.append(f"--calibration {calibration.get('file')} --calibration-tokens {calibration.get('tokens')}")
    return " ".join(words)


class _Collector:
    """Layer hooks around a reference-arm Dispatcher that add each expert's inputs' second moments: for w13 the
    normed hidden states routed to it, for w2 its SwiGLU activations from the model's own (unquantized) weights."""

    def __init__(self, engine, sums: dict[str, torch.Tensor]) -> None:
        from engine import flags
        from engine.dispatcher import Dispatcher

        self.engine, self.sums = engine, sums
        self.dispatcher = Dispatcher(engine, flags.resolve(["moe_gate=reference", "flash_512=off"]), timed=False)

    def attention(self, *args):
        return self.dispatcher.attention(*args)

    def moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None):
        inputs, hidden = self.sums[f"layers.{layer}.w13"], self.sums[f"layers.{layer}.w2"]
        f = w13.shape[1] // 2
        flat_ids = topk_ids.reshape(-1).long()
        flat_tokens = torch.arange(h.shape[0], device=h.device).repeat_interleave(topk_ids.shape[1])
        for expert in torch.unique(flat_ids).tolist():
            x = h[flat_tokens[flat_ids == expert]].float()  # [P, D]
            gate_up = x @ w13[expert].float().t()
            activation = torch.nn.functional.silu(gate_up[:, :f]) * gate_up[:, f:]  # [P, F]
            inputs[expert] += x.t() @ x
            hidden[expert] += activation.t() @ activation
        return self.dispatcher.moe(layer, h, w13, w2, topk_ids, topk_weights, experts=experts, woken=woken)


def calibration_hessians(engine, tokens: list[int], window: int = 512) -> dict[str, torch.Tensor]:
    """Per coded matrix, the sum over the calibration tokens routed to each expert of x x^T (float32 [E, C, C]):
    the Hessians `quantize_stack(hessian=)` weighs the error with. The tokens run in windows of `window` through
    the reference arms."""
    from engine.model import KVCache, forward

    config = engine.config
    needed = config.n_moe_layers * config.n_experts * (config.hidden ** 2 + config.intermediate ** 2) * 4
    from engine.model_source import free_bytes, gib

    free = free_bytes(engine.device)
    if free is not None and needed > 0.5 * free:
        raise UserError(f"--calibration: the Hessians of {config.name} take {gib(needed)}, more than half the "
                        f"{gib(free)} free; quantize without --calibration")
    sums = {}
    for name in tc.expert_matrices(config):
        columns = config.hidden if name.endswith(".w13") else config.intermediate
        sums[name] = torch.zeros(config.n_experts, columns, columns, dtype=torch.float32, device=engine.device)
    window = min(window, config.max_seq_len)
    hooks = _Collector(engine, sums)
    with torch.inference_mode():
        for begin in range(0, len(tokens), window):
            piece = torch.tensor([tokens[begin:begin + window]], device=engine.device)
            cache = KVCache.allocate(config, 1, piece.shape[1], engine.device, engine.dtype)
            forward(config, engine.weights, piece, 0, cache, hooks)
    return sums


def _dense_names(config) -> list[str]:
    from engine.model import tensor_shapes

    return [name for name in tensor_shapes(config) if not name.endswith((".w13", ".w2"))]


def _layer_report_path(partial: Path, layer: int) -> Path:
    return partial / tc.layer_file(layer).replace(".safetensors", ".json")


# The files a partial directory may hold: what the run writes, and its temporary names
_PARTIAL_FILES = (JOB_FILE, "config.json", tc.DENSE_FILE, tc.REPORT_FILE, "tokenizer.json")
# A layer's report is a few hundred bytes; anything far larger was not written by quantize
_MAX_REPORT_BYTES = 1 << 20
_REPORT_KEYS = ("name", "shape", "sequences", "mse", "relative_mse", "max_abs_error", "seconds", "layout")


def _partial_names(config) -> set[str]:
    names = set(_PARTIAL_FILES)
    for layer in config.moe_layers:
        names |= {tc.layer_file(layer), _layer_report_path(Path(), layer).name}
    return names | {name + ".tmp" for name in names}


def _check_partial_names(partial: Path, config) -> None:
    """A partial directory holds only files this run writes: anything else would be published with the checkpoint
    (a stray *.safetensors makes every load refuse it)."""
    names = _partial_names(config)
    for path in sorted(partial.iterdir()):
        if path.name not in names:
            raise UserError(printable(f"{path}: not a file quantize writes, in its partial directory: remove it, or "
                                      f"remove the partial directory (rm -r {partial}) to start over", limit=None))


def _matrix_layout(config, name: str, shape, seed: int) -> list[int]:
    """[left_seed, right_seed, left_block, right_block] of a coded matrix stack of `shape` [E, N, C]."""
    _, rows, columns = shape
    left_block = hadamard_block(config.intermediate) if name.endswith(".w13") else hadamard_block(rows)
    return [*matrix_seeds(seed, name), left_block, hadamard_block(columns)]


def _finished_layer(engine, partial: Path, layer: int, code: TrellisCode, seed: int,
                    table: torch.Tensor | None) -> tuple[list[dict] | None, str]:
    """(the reports of a layer a previous run finished, '') when its tensors and its report were both written and
    the tensors pass the loader's checks for this run's code, seeds, blocks and shapes (engine.trellis_checkpoint.
    read_layer_file); else (None, why it is not kept: '' for a layer that was not finished): a layer whose file was
    cut, emptied, replaced or edited since is quantized again, so the run never publishes what a load refuses."""
    report = _layer_report_path(partial, layer)
    tensors = partial / tc.layer_file(layer)
    if not os.path.lexists(tensors) or not os.path.lexists(report):
        return None, ""  # not finished (killed between the two writes), or never started
    expected = []
    for matrix in tc.MATRICES:
        name = f"layers.{layer}.{matrix}"
        shape = list(engine.weights[name].shape)
        expected.append({"name": name, "shape": shape, "sequences": math.prod(shape) // SEQUENCE,
                         "layout": _matrix_layout(engine.config, name, shape, seed)})
    try:
        reports = _read_report(report, expected)
        layouts = {item["name"]: tc.MatrixLayout(tuple(item["shape"]), *item["layout"]) for item in expected}
        stacks = tc.read_layer_file(tensors, layer, tc.TrellisLayout(code, seed, layouts))
        if table is not None and not torch.equal(stacks[f"layers.{layer}.w13"].table, table):
            raise UserError(f"{tensors}: its hyb table is not the one this run codes with")
        for item in reports:  # the codes measure the error their report says: this model's weights, in this code
            measured = _kept_error(engine.weights[item["name"]], stacks[item["name"]])
            if not math.isclose(measured, item["mse"], rel_tol=1e-3, abs_tol=1e-12):
                raise UserError(f"{tensors}: {item['name']}'s codes are {measured:.3e} from this model's weights, "
                                f"their report says {item['mse']:.3e}: they code another model or another code")
    except UserError as error:
        return None, f"layer {layer} in {partial} is not kept ({error})"
    return reports, ""


def _kept_error(weights: torch.Tensor, stack: TrellisMatrix) -> float:
    """The mean squared error of a kept stack against the weights it codes, measured as `_quantize_layer` measures
    it (the same chunks of experts)."""
    experts, rows, columns = weights.shape
    per_chunk = max(1, _CHUNK_WEIGHTS // (rows * columns))
    squared = 0.0
    for start in range(0, experts, per_chunk):
        end = start + per_chunk
        piece = TrellisMatrix(stack.code, stack.codes[start:end], stack.scales[start:end], stack.table,
                              stack.left_signs, stack.right_signs, stack.left_block, stack.right_block,
                              stack.left_seed, stack.right_seed).to(weights.device)
        report = quantization_report(weights[start:end], dequantize(piece))
        squared += report.mse * report.weights
    return squared / weights.numel()


def _read_report(path: Path, expected: list[dict]) -> list[dict]:
    """A layer's report (experts-LLLLL.json) as `_quantize_layer` writes it, with `expected`'s names, shapes,
    sequence counts and layouts and non-negative errors; UserError naming the file otherwise."""
    if not path.is_file() or path.stat().st_size > _MAX_REPORT_BYTES:
        raise UserError(f"{path}: not a layer report (a regular file of at most {_MAX_REPORT_BYTES} bytes)")
    try:
        reports = json.loads(path.read_text())  # as written: NaN is the relative error of an all-zero matrix
    except (OSError, ValueError, RecursionError) as error:
        raise UserError(f"{path}: unreadable ({type(error).__name__})") from None
    if not isinstance(reports, list) or len(reports) != len(expected):
        raise UserError(f"{path}: not a list of the reports of {', '.join(item['name'] for item in expected)}")
    for item, wanted in zip(reports, expected):
        if not isinstance(item, dict) or sorted(item) != sorted(_REPORT_KEYS):
            raise UserError(f"{path}: a report is not an object of {', '.join(_REPORT_KEYS)}")
        for key, value in wanted.items():  # compared as JSON: 4.0 is not 4, true is not 1
            if json.dumps(item[key]) != json.dumps(value):
                raise UserError(f"{path}: {wanted['name']}'s {key} is {printable(repr(item[key]), 60)}, this run's "
                                f"is {value!r}")
        for key in ("mse", "relative_mse", "max_abs_error", "seconds"):
            if not _measured(item[key], nan=key == "relative_mse"):
                raise UserError(f"{path}: {wanted['name']}'s {key} is {printable(repr(item[key]), 60)}, not an error "
                                f"a run measures")
    return reports


def _measured(number, nan: bool) -> bool:
    """A number >= 0 as a report records it (NaN where `nan`: the relative error of an all-zero matrix)."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    try:
        number = float(number)
    except OverflowError:
        return False
    return (math.isfinite(number) and number >= 0) or (nan and math.isnan(number))


# A calibration text is read whole into memory (and tokenized): far above any useful calibration set (the Hessians
# saturate at a few hundred thousand tokens), far below a machine's memory.
MAX_CALIBRATION_BYTES = 256 * 1024 * 1024


def _calibration_text(path: Path) -> str:
    """The calibration file's text: a regular file (a FIFO would wait for a writer forever) of at most
    MAX_CALIBRATION_BYTES of UTF-8; UserError naming --calibration otherwise."""
    from engine.bounded_read import read_regular

    try:
        text = read_regular(path, MAX_CALIBRATION_BYTES, f"--calibration {path}", "give a text file").decode("utf-8")
    except OSError as error:
        raise UserError(f"--calibration {path}: cannot read it ({error.strerror or error}); give a text file") from None
    except UnicodeDecodeError as error:
        raise UserError(f"--calibration {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not text.strip():
        raise UserError(f"--calibration {path}: the file is empty; give text the model reads")
    return text


def _quantize_layer(engine, layer: int, code: TrellisCode, seed: int, table, partial: Path, progress: Progress,
                    batch: int | None, hessians: dict | None = None) -> list[dict]:
    config = engine.config
    reports, stacks = [], {}
    for matrix in ("w13", "w2"):
        name = f"layers.{layer}.{matrix}"
        weights = engine.weights[name]  # [E, N, C]
        experts, rows, columns = weights.shape
        left_seed, right_seed, left_block, right_block = _matrix_layout(config, name, weights.shape, seed)
        began = time.perf_counter()
        per_chunk = max(1, _CHUNK_WEIGHTS // (rows * columns))
        pieces, squared, power, largest = [], 0.0, 0.0, 0.0
        for start in range(0, experts, per_chunk):
            chunk = weights[start:start + per_chunk]
            if not torch.isfinite(chunk).all():
                raise UserError(f"{name}: experts {start}..{start + len(chunk) - 1} hold NaN or infinite weights; "
                                f"no code approximates them: fix the source checkpoint")
            hessian = None if hessians is None else _usable(hessians[name][start:start + per_chunk])
            stack = quantize_stack(chunk, code, left_seed=left_seed, right_seed=right_seed, left_block=left_block,
                                   right_block=right_block, table=table, batch=batch, hessian=hessian,
                                   advance=lambda count, name=name: progress.advance(count, note=name))
            report = quantization_report(chunk, dequantize(stack))
            squared += report.mse * report.weights
            power += float(chunk.double().pow(2).sum())
            largest = max(largest, report.max_abs_error)
            pieces.append(stack)
        stack = _concatenate(pieces)
        stacks[matrix] = stack
        count = experts * rows * columns
        reports.append({"name": name, "shape": [experts, rows, columns], "sequences": count // SEQUENCE,
                        "mse": squared / count, "relative_mse": squared / power if power > 0 else float("nan"),
                        "max_abs_error": largest, "seconds": round(time.perf_counter() - began, 2),
                        "layout": [left_seed, right_seed, left_block, right_block]})
    tc.write_tensors(partial / tc.layer_file(layer), tc.layer_tensors(layer, stacks["w13"], stacks["w2"]))
    tc.write_json(_layer_report_path(partial, layer), reports)  # after the tensors: a report means they are whole
    return reports


def _usable(hessian: torch.Tensor) -> torch.Tensor:
    """An expert no calibration token reached has H = 0: the identity stands in (the plain squared error)."""
    empty = hessian.diagonal(dim1=-2, dim2=-1).sum(-1) <= 0  # [E]
    if bool(empty.any()):
        hessian = hessian.clone()
        hessian[empty] = torch.eye(hessian.shape[-1], dtype=hessian.dtype, device=hessian.device)
    return hessian


def _concatenate(pieces: list[TrellisMatrix]) -> TrellisMatrix:
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    return TrellisMatrix(first.code, torch.cat([piece.codes for piece in pieces]),
                         torch.cat([piece.scales for piece in pieces]), first.table, first.left_signs,
                         first.right_signs, first.left_block, first.right_block, first.left_seed, first.right_seed)


def write_shape_only(model: str, code: TrellisCode, out: str | Path, *, seed: int = 0) -> Path:
    """`quantize --shape-only`: a trellis directory holding only config.json (the model's shape, the code, each
    matrix's seeds and blocks), for `--weights random` (random valid codes drawn on the device): a v4-shape
    trellis model for kernel timing without a quantization run. Nothing is loaded or searched."""
    from engine.model_source import model_config

    out = Path(out)
    _check_output(out)
    _check_outside(out, model)
    config = model_config(model)
    if not config.plain_experts:
        raise UserError(f"--model {model}: {config.name}'s experts have biases or the clamped SwiGLU, which the "
                        f"trellis arms do not compute")
    for size, what in ((config.hidden, "hidden size"), (config.intermediate, "expert intermediate size")):
        if size % TILE:
            raise UserError(f"--model {model}: {what} {size} is not a multiple of the {TILE} x {TILE} trellis tile")
    layouts = {}
    for name in tc.expert_matrices(config):
        shape = ((config.n_experts, 2 * config.intermediate, config.hidden) if name.endswith(".w13")
                 else (config.n_experts, config.hidden, config.intermediate))
        left_block = hadamard_block(config.intermediate) if name.endswith(".w13") else hadamard_block(shape[1])
        layouts[name] = tc.MatrixLayout(shape, *matrix_seeds(seed, name), left_block, hadamard_block(shape[2]))
    source = {"model": model, "weights": "none (shape only: load with --weights random)", "seed": seed}
    partial = partial_directory(out)
    if partial.is_symlink() or (partial.is_dir() and any(partial.iterdir())):  # a run's layers would go with it
        raise UserError(f"{partial}: a quantize run left this partial directory; finish it, or remove it "
                        f"(rm -r {partial}) to write --shape-only at {out}")
    partial.mkdir(exist_ok=True)
    try:
        tc.write_json(partial / "config.json", tc.config_json(config, tc.TrellisLayout(code, seed, layouts), source,
                                                              "bytes" if config.vocab_size == 256 else "none"))
    except tc.WriteError:
        partial.rmdir()  # it held only config.json, which the failed write removed
        raise
    os.replace(partial, out)
    return out
