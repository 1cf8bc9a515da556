"""The training forward is the engine's forward: same weights, same logits."""

import torch

from engine import flags
from engine.config import PRESETS
from engine.model import random_weights
from engine.runtime import Engine
from train.train_demo import forward_batch, layer_visibility


def test_training_forward_matches_the_engine_prefill_logits():
    config = PRESETS["demo"]
    weights = random_weights(config, 5, torch.device("cpu"), torch.float32)
    engine = Engine(config, torch.device("cpu"), weights=weights)
    prompt = "Training and inference must agree on the composite mask and the sinks. " * 3  # > window 128
    tokens = torch.tensor([list(prompt.encode())])
    logits, balance = forward_batch(config, weights, tokens, layer_visibility(config, tokens.shape[1], "cpu"))
    generated = engine.generate(prompt, 1, flags.resolve(["moe_gate=reference"], environ={}))
    expected = generated.logits[0]
    error = (logits[0, -1] - expected).norm() / expected.norm()
    assert error < 1e-5, float(error)
    assert torch.isfinite(balance)
