"""f3 checks the attention the loaded model runs: the sinks kernel with the composite mask on the presets, the
absorbed latent kernel (check-attention --mla's check) at a DeepSeek model's latent shape, the decode kernel
(check-attention --decode's check) on causal or window-only layers (tests/test_attention_screen_decode.py), and
nothing (one line, nothing run) on a model whose layers no fused kernel takes, such as Qwen3-MoE at head_dim 96.

The models are config.json-only directories with random weights (Engine.load(weights="random")): the screen reads
the config, and the checks draw their own inputs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from textual.widgets import Input

from engine.config import PRESETS, LayerMask
from engine.runtime import Engine
from inspector.screens import attention_check as screen_module
from inspector.screens.attention_check import AttentionCheckScreen, why_not_this_model
from test_tui import make_app, synchronously, wait_until

QWEN3_HEAD_DIM_96 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                      "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 96, "num_experts": 8,
                      "num_experts_per_tok": 2, "vocab_size": 300, "max_position_embeddings": 512,
                      "norm_topk_prob": True}
DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
               "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 1,
               "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "vocab_size": 320, "max_position_embeddings": 2048, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
               "qk_nope_head_dim": 16, "v_head_dim": 12, "q_lora_rank": None, "n_shared_experts": 2,
               "first_k_dense_replace": 0, "topk_method": "greedy"}


def _engine(tmp_path, config: dict) -> Engine:
    directory = tmp_path / config["model_type"]
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return Engine.load(str(directory), "cpu", weights="random")


def _calls():
    calls = []

    def fake_check(**parameters):
        calls.append(parameters)
        raise AssertionError("no check matches this model: nothing may run")

    return calls, fake_check


@synchronously
async def test_f3_on_a_head_dim_no_fused_kernel_takes_says_so_in_one_line_and_runs_nothing(tmp_path):
    engine = _engine(tmp_path, QWEN3_HEAD_DIM_96)
    assert engine.config.head_dim == 96 and not engine.config.sinks
    calls, fake_check = _calls()
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, AttentionCheckScreen)
        screen.check = fake_check  # what f3 loaded is replaced: nothing may call it
        await pilot.press("f7")
        await pilot.pause(0.3)
        shown = str(screen.query_one("#check-output").render())
        assert calls == [] and not screen.running and screen.result is None
        assert shown == why_not_this_model(engine) and "\n" not in shown
        assert shown.startswith("head_dim 96: the fused attention kernel takes head_dim 64, 128, 256, 512, so this "
                                "model's layers run the unfused reference")
        assert not list(screen.query(Input))  # no sizes of a check that does not apply
        assert screen.check_action("run_check", ()) is False  # the footer offers no f7 to run it
        assert "interpreter" not in str(screen.query_one("#check-shape").render())
        assert not [action for action in app.actions if action["action"] == "check-attention"]
    assert screen_module.check_kind(engine) is None


def test_causal_or_window_only_layers_take_the_decode_check_and_a_composite_mask_without_sinks_none():
    """gpt-oss's layers (sinks, a sliding window, causal) and plain causal ones run the decode check; a composite mask
    without sinks is what no check takes."""
    check_kind, SINKS, DECODE = screen_module.check_kind, screen_module.SINKS, screen_module.DECODE
    tiny = PRESETS["tiny"]
    window = dataclasses.replace(tiny, layer_masks=(LayerMask("window", 16), LayerMask("causal")))
    causal = dataclasses.replace(tiny, layer_masks=(LayerMask("causal"), LayerMask("causal")), sinks=False)
    for config in (window, causal):
        engine = type("E", (), {"config": config})()
        assert check_kind(engine) == DECODE and why_not_this_model(engine) is None
    composite = type("E", (), {"config": dataclasses.replace(tiny, sinks=False)})()
    assert check_kind(composite) is None
    assert why_not_this_model(composite).startswith("nothing to check: its layers run the fused kernel with causal "
                                                    "and composite(W=16,B=8) masks, no sinks")
    assert "causal or window-only layers (--decode)" in why_not_this_model(composite)
    assert check_kind(type("E", (), {"config": tiny})()) == SINKS


async def open_check_screen(app, pilot) -> AttentionCheckScreen:
    """f3 from the main screen: the attention check screen, with a check that applies."""
    await pilot.press("f3")
    await pilot.pause()
    screen = app.screen
    assert isinstance(screen, AttentionCheckScreen) and screen.unavailable is None
    return screen


@synchronously
async def test_f3_on_deepseek_runs_the_latent_check_at_the_models_shape(tmp_path):
    engine = _engine(tmp_path, DEEPSEEK_V2)
    app = make_app(engine)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_check_screen(app, pilot)
        assert [box.id for box in screen.query(Input)] == ["check-seq-len", "check-heads"]
        assert "latent 32 + RoPE 16, no-RoPE 16, value 12 dims" in str(screen.query_one("#check-shape").render())
        await pilot.press("f7")  # the real check: check-attention --mla's, under the interpreter
        await wait_until(pilot, lambda: screen.result is not None, timeout=120)
        result = screen.result
        assert result["config"]["kv_lora_rank"] == 32 and result["config"]["rope_dim"] == 16
        assert result["config"]["nope_dim"] == 16 and result["config"]["v_dim"] == 12
        assert result["config"]["heads"] == 4 and result["config"]["seq_len"] == 48
        assert result["verdict"] == "causal" and result["ok"]
        shown = str(screen.query_one("#check-output").render())
        assert "check-attention --mla" in shown and "verdict: causal" in shown
        recorded = [action for action in app.actions if action["action"] == "check-attention"]
        assert len(recorded) == 1 and recorded[0]["mla"] is True  # the session's step with mla = true
        assert {key: recorded[0][key] for key in ("seq_len", "heads", "kv_lora_rank", "rope_dim", "nope_dim",
                                                   "v_dim")} == {"seq_len": 48, "heads": 4, "kv_lora_rank": 32,
                                                                 "rope_dim": 16, "nope_dim": 16, "v_dim": 12}
    assert screen_module.check_kind(engine) == screen_module.MLA
