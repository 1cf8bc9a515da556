"""The decode kernels' launch policies that only a GPU run can time: streamed weights' L2 hint
(kernels.streaming), the one-row fold's block (kernels.gemv_norm), attention decode's short-walk tiles."""

import torch

from engine import flags
from kernels import settings, streaming
from kernels.attention_decode import CONFIGS, SHORT_WALK_CONFIG, SHORT_WALK_KEYS, _config
from kernels.gemv_norm import row_block as _row_block
from kernels.reference import MaskSpec

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def test_streamed_weights_are_evicted_first_on_a_gpu_unless_switched_off():
    assert streaming.weight_eviction(CUDA) == "evict_first"
    assert streaming.weight_eviction(torch.device("cpu")) == ""  # the interpreter: no hint
    off = flags.launch_settings(flags.resolve(["stream_weights=off"], environ={}))
    assert streaming.weight_eviction(CUDA, off) == ""
    with settings.using(off):
        assert streaming.weight_eviction(CUDA) == ""
    assert streaming.weight_eviction(CUDA) == "evict_first"


def test_one_row_folds_take_two_outputs_and_the_whole_k_per_program_on_a_gpu():
    assert _row_block(1, 4096, CUDA) == (2, 4096)
    assert _row_block(1, 3000, CUDA) == (2, 4096)  # K padded to a power of two
    assert _row_block(1, 8192, CUDA) is None  # 16384 elements: too many registers
    assert _row_block(2, 4096, CUDA) is None  # two rows: kernels.gemv's blocks
    assert _row_block(1, 4096, torch.device("cpu")) is None  # the interpreter's few wide programs


def test_short_gqa_walks_at_head_dim_512_take_16_key_tiles():
    composite = MaskSpec("composite", window=1024, block=64)
    assert _config(512, composite, 160, 1, rows=8) == SHORT_WALK_CONFIG  # 160 + 3 block starts
    assert _config(512, MaskSpec("causal"), SHORT_WALK_KEYS, 1, rows=8) == SHORT_WALK_CONFIG
    assert _config(512, MaskSpec("causal"), SHORT_WALK_KEYS + 1, 1, rows=8) == CONFIGS[512]
    assert _config(512, composite, 160, 1, rows=1) == CONFIGS[512]  # one row per group: as before
    assert _config(128, composite, 160, 1, rows=8) == CONFIGS[128]
