"""The TUI with a user's own checkpoint (`--model DIR`), each test a defect found by driving it as a new user
would: a config-only Qwen3-MoE (random weights) with a tokenizer.json trained here, on the CPU.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import flags as flag_registry
from engine.runtime import Engine
from inspector.widgets.output_pane import OutputPane, render_tokens, token_text, tokenizer_token_text

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the quick brown fox jumps over the lazy dog", "mixture of experts route every token"]
QWEN3_CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
                "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("ckpt")
    (directory / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(WORDS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), "cpu", 0, "random")


def plain(tokens, shown) -> str:
    return render_tokens(tokens, None, shown).plain


def test_a_checkpoints_tokens_are_shown_as_its_tokenizer_spells_them(engine):
    """The output panes showed every id as a byte: id 264 of a BPE vocabulary came out as `\\x108`."""
    ids = engine.tokenizer.encode("the quick brown fox")
    assert any(token >= 256 for token in ids)  # merged tokens: not bytes
    assert plain(ids, tokenizer_token_text(engine.tokenizer)) == "the quick brown fox"
    # an id the tokenizer lacks, and a control character, stay visible one token each
    shown = tokenizer_token_text(engine.tokenizer)
    assert shown(319) == ("<id 319>", "dim")
    newline = engine.tokenizer.encode("\n")
    assert plain(newline, shown) == "\\n" * len(newline)


def test_byte_tokens_past_the_bytes_are_ids_not_escapes():
    """A config-only directory with a larger vocabulary reads byte tokens; id 300 was shown as `\\x12c`."""
    assert token_text(300) == ("<id 300>", "dim")
    assert token_text(0x41) == ("A", "") and token_text(200) == ("\\xc8", "dim")


def test_the_main_screen_panes_use_the_engines_tokenizer(engine):
    """Through the app: both panes and the divergence line spell tokens with the checkpoint's tokenizer."""
    from inspector.app import InspectorApp

    async def scenario():
        app = InspectorApp(engine, flag_registry.resolve([], environ={}), timed=False)
        async with app.run_test(size=(120, 40)) as pilot:
            ids = engine.tokenizer.encode("the quick brown fox")
            for side in ("a", "b"):
                pane = app.main_screen.query_one(f"#pane-{side}", OutputPane)
                pane.extend(ids)
                await pilot.pause()
                assert plain(pane.tokens, pane.shown) == "the quick brown fox"

    asyncio.run(scenario())


DEEPSEEK_V2_CONFIG = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
                      "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 1,
                      "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                      "num_experts_per_tok": 2, "vocab_size": 320, "max_position_embeddings": 2048,
                      "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 12,
                      "q_lora_rank": None, "n_shared_experts": 2, "first_k_dense_replace": 0, "topk_method": "greedy"}


def test_the_attention_screen_says_what_the_models_attention_is(engine, tmp_path):
    """f3 on a Qwen3-MoE said "sinks, composite mask W=16, B=8" (neither is in the model) and offered a check
    the kernel refuses (head_dim 16); on DeepSeek it offered the sinks check for latent attention."""
    from types import SimpleNamespace

    from engine.hf_loader import read_config
    from inspector.screens.attention_check import model_attention, why_not_this_model

    assert model_attention(engine) == "no sinks, causal layers only"
    assert why_not_this_model(engine).startswith("head_dim 16: the fused attention kernel takes head_dim 64, 128")
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_CONFIG))
    deepseek = SimpleNamespace(config=read_config(tmp_path)[0])
    assert model_attention(deepseek).startswith("latent attention (MLA), no sinks")
    assert why_not_this_model(deepseek) is None  # f3 runs check-attention --mla's check there (test_attention_screen)
    demo = Engine.load("tiny", "cpu", 0)  # the presets: the sinks kernel's own shape, checked as before
    assert model_attention(demo).startswith("sinks, composite mask W=") and why_not_this_model(demo) is None
