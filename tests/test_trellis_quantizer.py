"""The Viterbi search of engine.trellis_quantizer: exactly optimal on tiny trellises (brute force over every
path), tail-biting, within the error target at L = 16 on Gaussian data, and Hessian feedback that lowers
the error it is meant to lower."""

from __future__ import annotations

import pytest
import torch

from engine.trellis_quantizer import (quantization_report, quantize_sequences, quantize_stack, tail_biting_viterbi,
                                      viterbi)
from kernels.trellis_reference import (TrellisCode, code_rms, default_hyb_table, dequantize, pack_states,
                                       state_values)

# tiny trellises: L state bits, K V bits per step, S steps (L, step_bits, steps, V)
TINY = [(6, 2, 6, 1), (6, 2, 5, 2), (5, 1, 7, 1), (6, 3, 4, 1)]


def _brute_force(targets: torch.Tensor, values: torch.Tensor, step_bits: int, circular: bool) -> dict:
    """Every path of a tiny trellis, enumerated by its bit string: {overlap (None unless circular): best
    error} for one sequence. circular: the stream is S*KV bits read around (tail-biting), state t the
    L-bit window at bit t*KV; else L + (S-1) KV bits read straight."""
    bits_l = values.shape[0].bit_length() - 1
    steps = targets.shape[0]
    length = steps * step_bits if circular else bits_l + (steps - 1) * step_bits
    streams = torch.arange(1 << length)  # every bit string, most significant bit first

    def bit(position: int) -> torch.Tensor:
        return (streams >> (length - 1 - position % length)) & 1

    states = torch.stack([sum(bit(t * step_bits + i) << (bits_l - 1 - i) for i in range(bits_l))
                          for t in range(steps)], dim=1)  # [paths, S]
    errors = ((values[states] - targets) ** 2).sum(dim=(1, 2)).double()  # [paths]
    if not circular:
        return {None: float(errors.min())}
    overlaps = states[:, 0] >> step_bits
    return {int(o): float(errors[overlaps == o].min()) for o in overlaps.unique()}


@pytest.mark.parametrize("bits_l, step_bits, steps, v", TINY)
def test_viterbi_is_optimal_against_brute_force(bits_l, step_bits, steps, v):
    generator = torch.Generator().manual_seed(bits_l * 100 + steps)
    values = torch.randn(1 << bits_l, v, generator=generator)
    targets = torch.randn(1, steps, v, generator=generator)
    free = _brute_force(targets[0], values, step_bits, circular=False)[None]
    states, error = viterbi(targets, values, step_bits)
    assert float(error[0]) == pytest.approx(free, rel=1e-5)
    assert float(((values[states[0]] - targets[0]) ** 2).sum()) == pytest.approx(free, rel=1e-5)
    wrapping = _brute_force(targets[0], values, step_bits, circular=True)
    for overlap, expected in wrapping.items():  # pass two is optimal among paths of its overlap
        states, error = viterbi(targets, values, step_bits, torch.tensor([overlap]))
        assert float(error[0]) == pytest.approx(expected, rel=1e-5), overlap
        assert int(states[0, 0]) >> step_bits == overlap
        assert int(states[0, -1]) & ((1 << (bits_l - step_bits)) - 1) == overlap  # it wraps
    # the two passes return a wrapping path no better than the best wrapping path of all
    states, error = tail_biting_viterbi(targets, values, step_bits)
    assert float(error[0]) >= min(wrapping.values()) - 1e-5
    following = ((states.roll(1, dims=1) << step_bits) & ((1 << bits_l) - 1)) >> step_bits
    assert torch.equal(following, states >> step_bits)


def test_batched_search_equals_one_sequence_at_a_time():
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(1 << 8, 1, generator=generator)
    targets = torch.randn(6, 20, 1, generator=generator)
    states, error = tail_biting_viterbi(targets, values, 2)
    for row in range(6):
        one, one_error = tail_biting_viterbi(targets[row:row + 1], values, 2)
        assert torch.equal(one[0], states[row]) and float(one_error[0]) == pytest.approx(float(error[row]))


def test_gaussian_error_at_k2_is_within_the_target():
    """Reduced size of bench/trellis_quality.py: 8 sequences of 256 N(0, 1) weights, hyb at K = 2. Target
    0.075 per weight (rate-distortion 0.0625, 2-bit Lloyd-Max 0.1175)."""
    code = TrellisCode.of("hyb", 2)
    table = default_hyb_table()
    values = state_values(code, table) / code_rms(code, table)
    data = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    states = quantize_sequences(data, code, values, batch=4)
    decoded = values[states].reshape(8, 256)
    mse = float(((decoded - data) ** 2).mean())
    assert mse <= 0.075
    pack_states(states, code)  # a valid packed path


def test_quantize_stack_round_trips_through_the_format():
    code = TrellisCode.of("3inst", 2)
    weights = torch.randn(1, 16, 48, generator=torch.Generator().manual_seed(1)) * 0.05  # C = 48: blocks of 16
    done = []
    matrix = quantize_stack(weights, code, left_seed=3, right_seed=4, advance=done.append)
    assert sum(done) == 16 * 48 // 256
    assert matrix.shape == (1, 16, 48) and matrix.right_block == 16 and matrix.left_block == 16
    report = quantization_report(weights, dequantize(matrix))
    # rotations are orthogonal, so the error is the trellis's on the rotated rows (~0.07 of their power)
    assert 0.04 < report.relative_mse < 0.09, report


def test_hessian_feedback_lowers_the_output_error():
    """With correlated inputs, LDLQ's tr(E H E^T) beats the plain search's, which it does not optimise."""
    generator = torch.Generator().manual_seed(2)
    columns = 32
    mixing = torch.randn(columns, columns, generator=generator)
    inputs = torch.randn(512, columns, generator=generator) @ (mixing * torch.linspace(0.1, 3, columns))
    hessian = (inputs.t() @ inputs).unsqueeze(0)  # [1, C, C]
    weights = torch.randn(1, 16, columns, generator=generator)
    code = TrellisCode.of("hyb", 2)

    def output_error(matrix) -> float:
        error = (dequantize(matrix) - weights)[0].double()
        return float(torch.trace(error @ hessian[0].double() @ error.t()))

    plain = quantize_stack(weights, code, left_seed=1, right_seed=2)
    fed_back = quantize_stack(weights, code, left_seed=1, right_seed=2, hessian=hessian)
    assert output_error(fed_back) < 0.9 * output_error(plain)
