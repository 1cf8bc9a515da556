"""f3 on a Qwen3-MoE checkpoint (made with transformers here: causal layers, no sinks, GQA 4/2, head_dim 64) runs
check-attention --decode's check at the model's attention shape, shows it as the CLI prints it, and records it as
a session step with decode = true; before the decode check it said "nothing to check" for every causal or
window-only model. Mode drop (fused_mask=drop) must come back reads_stale."""

from __future__ import annotations

import pytest
import torch
from textual.widgets import Input

from engine.runtime import Engine
from inspector.screens import attention_check as screen_module
from test_attention_screen import open_check_screen
from test_tui import make_app, synchronously, wait_until

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Engine:
    directory = tmp_path_factory.mktemp("qwen3-decode")
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=300, intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, norm_topk_prob=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    return Engine.load(str(directory), "cpu")


@synchronously
async def test_f3_on_qwen3_runs_the_decode_check_at_the_models_shape(qwen3):
    assert screen_module.check_kind(qwen3) == screen_module.DECODE
    app = make_app(qwen3)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_check_screen(app, pilot)
        assert [box.id for box in screen.query(Input)] == ["check-seq-len", "check-batch"]
        header = str(screen.query_one("#check-shape").render())
        assert "head_dim 64, 4 heads / 2 kv heads, no sinks, causal layers only" in header
        await pilot.press("f7")  # the real check under the interpreter
        await wait_until(pilot, lambda: screen.result is not None, timeout=120)
        result = screen.result
        assert result["verdict"] == "ok" and result["ok"], result["sentence"]
        assert {key: result["config"][key] for key in ("heads", "kv_heads", "head_dim", "window", "sinks", "seq_len",
                                                        "batch")} == {
            "heads": 4, "kv_heads": 2, "head_dim": 64, "window": None, "sinks": False, "seq_len": 160, "batch": 4}
        shown = str(screen.query_one("#check-output").render())
        assert "check-attention --decode" in shown and "verdict: ok" in shown and "nothing to check" not in shown
        recorded = [action for action in app.actions if action["action"] == "check-attention"]
        assert len(recorded) == 1 and recorded[0]["decode"] is True
        assert {key: recorded[0][key] for key in ("seq_len", "batch", "heads", "kv_heads", "head_dim", "sinks",
                                                   "mode")} == {
            "seq_len": 160, "batch": 4, "heads": 4, "kv_heads": 2, "head_dim": 64, "sinks": False, "mode": "honor"}


@synchronously
async def test_f3_decode_check_in_mode_drop_reads_stale_and_refuses_a_bad_size(qwen3):
    app = make_app(qwen3)
    async with app.run_test(size=(200, 50)) as pilot:
        screen = await open_check_screen(app, pilot)
        screen.query_one("#check-batch", Input).value = "1"
        await pilot.press("f7")
        await pilot.pause(0.3)
        assert str(screen.query_one("#check-output").render()).startswith("refused: batch '1': give a whole number")
        screen.query_one("#check-batch", Input).value = "3"
        screen.query_one("#check-seq-len", Input).value = "96"
        screen.query_one("#check-mode").value = "drop"
        await pilot.press("f7")
        await wait_until(pilot, lambda: screen.result is not None, timeout=120)
        assert screen.result["verdict"] == "reads_stale" and not screen.result["ok"]
        assert "verdict: reads_stale" in str(screen.query_one("#check-output").render())
