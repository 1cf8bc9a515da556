"""Trellis codes on a GPU: the reference decode and the Viterbi search give the CPU's bits there, a preset
quantizes, loads and generates on the GPU, and check-quant's rotated arm sits on the dequantized reference in
bf16. Run with `python -m pytest -m gpu tests/test_trellis_gpu.py` on the device machine."""

from __future__ import annotations

import json

import pytest
import torch

from engine import flags
from engine.runtime import Engine
from engine.trellis_job import parse_experts, quantize_model
from engine.trellis_quantizer import quantize_sequences
from kernels.trellis_reference import (CODES, TrellisCode, code_rms, code_values, default_hyb_table,
                                       dequantize_rotated, pack_states, random_trellis_matrix, state_values)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("code", list(CODES))
def test_code_values_on_the_gpu_are_the_cpus_bits(code):
    states = torch.arange(1 << 16)
    table = default_hyb_table()
    assert torch.equal(code_values(code, states.cuda(), table.cuda()).cpu(), code_values(code, states, table))


def test_a_random_stack_decodes_to_the_same_bits_on_both_devices():
    code = TrellisCode.of("hyb", 3)
    matrix = random_trellis_matrix(3, 64, 96, code, seed=5, device="cuda", row_block=16)
    assert torch.equal(dequantize_rotated(matrix).cpu(), dequantize_rotated(matrix.to("cpu")))


@pytest.mark.parametrize("name, bits", [("hyb", 2), ("1mad", 2), ("3inst", 4)])
def test_the_search_finds_the_cpus_paths_and_the_error_target(name, bits):
    code = TrellisCode.of(name, bits)
    table = default_hyb_table() if code.needs_table else None
    data = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    values = state_values(code, table) / code_rms(code, table)
    on_gpu = quantize_sequences(data.cuda(), code, values.cuda(), batch=16).cpu()
    on_cpu = quantize_sequences(data, code, values, batch=4)
    # elementwise IEEE float ops and an integer minimum: the same paths on both devices
    assert torch.equal(on_gpu, on_cpu)
    pack_states(on_gpu, code)
    if bits == 2:
        assert float(((values[on_gpu].reshape(data.shape) - data) ** 2).mean()) <= 0.075


def test_a_preset_quantizes_loads_and_generates_on_the_gpu(tmp_path):
    out = tmp_path / "tiny-hyb2"
    result = quantize_model("tiny", parse_experts("trellis:K=2,code=hyb"), out, device="cuda")
    assert all(item["relative_mse"] < 0.09 for item in result.matrices)
    engine = Engine.load(str(out), device="cuda")
    generation = engine.generate("The if statement", 8, flags.resolve([]))
    assert len(generation.tokens) == 8
    record = generation.steps[-1]["moe"][0]
    # the trellis arms run on the GPU (kernels/trellis_gemv.py, trellis_grouped.py) and never sync the host, so
    # trellis layers no longer keep decode steps out of CUDA graphs
    assert record["weight_format"] == "trellis hyb K=2 V=2 L=16" and record["executed_arm"].startswith("trellis_")
    batch = engine.generate_batch([[1, 2, 3], [4, 5]], 4, flags.resolve([]))
    decode = [step for step in batch.steps if step["phase"] == "decode"]
    assert decode and not any("trellis experts" in (step.get("eager_reason") or "") for step in decode)
    from engine.quant_check import check_quant

    checked = check_quant(str(out), layer=1, tokens=(1, 64), arm="rotated-torch", device="cuda")
    assert checked["ok"], json.dumps(checked, default=str)[:2000]


def test_a_checkpoints_coded_experts_are_set_against_its_source_on_the_gpu(tmp_path, capsys):
    """A Qwen2-MoE checkpoint quantized on the GPU: compare --b-model source runs A on the trellis arms and B on
    the bf16 experts of the source, and check-quant reads the source's one layer (hf_loader.load_some) on cuda."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_trellis_families import _build

    from engine.quant_check import check_quant
    from inspector import cli

    source = _build("qwen2-moe", tmp_path / "source")
    out = tmp_path / "hyb2"
    quantize_model(str(source), parse_experts("trellis:K=2,code=hyb"), out, device="cuda")
    code = cli.main(["compare", "--model", str(out), "--b-model", "source", "--device", "cuda", "--prompt",
                     "routed experts", "--max-tokens", "4", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    both = json.loads(captured.out)
    arms = {side: {(record["weight_format"], record["executed_arm"]) for step in both[side]["steps"]
                   for record in step["moe"]} for side in ("a", "b")}
    assert {fmt for fmt, _ in arms["a"]} == {"trellis hyb K=2 V=2 L=16"}, arms
    assert all(arm.startswith("trellis_") for _, arm in arms["a"]), arms
    assert {fmt for fmt, _ in arms["b"]} == {"bf16"} and not any(arm.startswith("trellis") for _, arm in arms["b"])
    assert 1e-3 < both["logit_rel_err"][0] < 1
    checked = check_quant(str(out), tokens=(1, 64), device="cuda")
    assert checked["ok"], json.dumps(checked, default=str)[:2000]
