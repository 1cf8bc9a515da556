"""How much a request may ask of this machine, checked before anything is allocated.

Every size a user can give (a sequence length, a batch, a repetition count, a list of widths, an
expert count) is checked here against a limit, and the refusal states the limit and where it comes
from: memory sizes against the memory this process can have now (`available_bytes`: free device
memory on a GPU; on the CPU the kernel's MemAvailable, capped by a cgroup's limit), counts against
fixed ceilings chosen far above any real use (a repetition count of a million is a typo, not a
measurement plan). Estimates are of the tensors the request allocates at its peak, in closed form
from the model's sizes; they are lower bounds of the true peak, so a refusal is never wrong, and
`HEADROOM` keeps a request that fits only just from being tried.

Plain arithmetic over ints plus two probes of the machine; knows nothing of how the work is done.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import UserError

HEADROOM = 0.9  # at most this share of the available memory for one request
MAX_REPS = 1000  # timed repetitions of a bench row (llama-bench's default is 5)
MAX_LIST_VALUES = 256  # values in one list of widths, lengths or batch sizes
MAX_BENCH_ROWS = 256  # rows of one bench (every length at every batch size)
MAX_CURVE_EXPERTS = 1 << 20  # routed experts in the curve's arithmetic (real models: up to a few hundred)
MAX_CURVE_TOKENS = 1 << 40  # token counts in the curve's arithmetic
MAX_TILE_M = 1 << 12
MAX_CHECK_QUANT_TOKENS = 1 << 16  # token counts of one check-quant row (its references loop over the experts)
# An A/B's rounds and its statistics (engine.ab, engine.ab_stats): each round runs both sides once, and each row's
# bootstrap is pure Python, about 0.5 s a row at 100000 resamples of 8 rounds.
MAX_AB_ROUNDS = 10_000  # timed rounds of an A/B (the default is 8; a verdict needs 5)
MAX_AB_WARMUP = 1000  # discarded warm-up runs per side of an A/B (the default is 1)
MAX_AB_RESAMPLES = 100_000  # bootstrap resamples of an A/B row (the default is 2000)
# A seed is a torch generator's, recorded in sessions and results headers: a non-negative int64.
MAX_SEED = 2**63 - 1


def gib(size: int | float) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**28 else f"{size / 2**20:.1f} MiB"


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), when a limit is set."""
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / relative.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        return None


def available_bytes(device) -> int | None:
    """Free memory on `device` (a torch.device or its name) now: engine.model_source.free_bytes (the
    GPU's, or the host's MemAvailable), capped on the host by this process's cgroup limit; None when
    it cannot be asked."""
    import torch

    from engine.model_source import free_bytes

    device = device if isinstance(device, torch.device) else torch.device(str(device))
    try:
        free = free_bytes(device)
    except (RuntimeError, AssertionError, ValueError):
        return None
    if device.type != "cuda":
        room = _cgroup_room()
        if room is not None:
            free = room if free is None else min(free, room)
    return free


def require_fits(needed: int, device, what: str, fix: str) -> None:
    """UserError naming both sizes when `needed` bytes exceed HEADROOM of what `device` has free."""
    available = available_bytes(device)
    if available is None:
        return
    if needed > HEADROOM * available:
        place = "free on the GPU" if getattr(device, "type", str(device)).startswith("cuda") else "available"
        raise UserError(f"{what} needs about {gib(needed)}, and this machine has {gib(available)} {place} "
                        f"(a request may take {int(HEADROOM * 100)} % of it); {fix}")


def require_at_most(value: int, limit: int, what: str, why: str) -> None:
    if value > limit:
        shown = str(value) if value < 10**30 else f"a number of {len(str(value))} digits"
        raise UserError(f"{what} is {shown}, more than {limit} ({why})")


# -- estimates (bytes), lower bounds of the peak ------------------------------------------------

def element_bytes(dtype) -> int:
    return getattr(dtype, "itemsize", None) or {"float32": 4, "bfloat16": 2, "float16": 2}.get(
        str(dtype).replace("torch.", ""), 4)


def weight_bytes(config, dtype) -> int:
    """Every weight of `config` in `dtype` (engine.model_source.model_bytes: one formula for both checks)."""
    from engine.model_source import model_bytes

    return model_bytes(config, dtype)


def kv_cache_bytes(config, batch: int, positions: int, dtype) -> int:
    """Keys and values of every layer for `batch` sequences of `positions` tokens."""
    return 2 * config.n_layers * batch * positions * config.n_kv_heads * config.head_dim * element_bytes(dtype)


def attention_check_bytes(seq_len: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """check-attention's references: fp32 score-sized temporaries [heads, T, T + 1] (scores, the
    mask applied, the sink column concatenated, the softmax and its product: the peak measured at
    T = 3072 was 5.5 of them, so eight are counted), boolean masks [T, T], and q, k, v."""
    scores = 8 * heads * seq_len * (seq_len + 1) * 4
    masks = 4 * seq_len * seq_len
    inputs = seq_len * (2 * heads + 2 * kv_heads) * head_dim * 4 * 2
    return scores + masks + inputs


# -- checks of whole requests ---------------------------------------------------------------------

def check_list(values, what: str) -> None:
    if len(values) > MAX_LIST_VALUES:
        raise UserError(f"{what}: {len(values)} values, more than the {MAX_LIST_VALUES} one list of widths, "
                        f"lengths or batch sizes may hold")


def check_bench_request(config, device, dtype, specs, reps: int, where: str, weights_loaded: bool) -> None:
    """A bench's rows before any runs: the repetitions, the number of rows, and the memory of its
    largest row (the weights, unless already loaded, plus every sequence's cache)."""
    if reps > MAX_REPS:  # (below 1 is the harness's own refusal)
        raise UserError(f"{where}: reps {reps} is more than {MAX_REPS} (timed repetitions of each row, after a "
                        f"warm-up; 5 is llama-bench's default)")
    if len(specs) > MAX_BENCH_ROWS:
        raise UserError(f"{where}: {len(specs)} rows (every length at every batch size), more than the "
                        f"{MAX_BENCH_ROWS} one bench may hold; give fewer lengths or batch sizes")
    weights = 0 if weights_loaded else weight_bytes(config, dtype)
    if weights:  # weights that alone do not fit: fewer rows would not help, so say what would
        require_fits(weights, device, f"{where}: holding the model's {str(dtype).replace('torch.', '')} weights alone",
                     "fewer or shorter rows would not help: bench it where more memory is free (a GPU with more "
                     "memory), or a smaller model")
    largest = max(specs, key=lambda spec: spec.batch * (spec.prompt_len + spec.max_tokens), default=None)
    if largest is None:
        return
    cache = kv_cache_bytes(config, largest.batch, largest.prompt_len + largest.max_tokens, dtype)
    require_fits(weights + cache, device,
                 f"{where}: row {largest.name} ({largest.batch} sequences of {largest.prompt_len + largest.max_tokens} "
                 f"positions{'' if weights_loaded else ', with the weights'})",
                 "use a smaller batch or shorter rows")


def check_attention_request(seq_len: int, heads: int, kv_heads: int, head_dim: int, device, where: str) -> None:
    if min(seq_len, heads, kv_heads, head_dim) < 1:
        return  # the check's own validation names the bad value
    require_fits(attention_check_bytes(seq_len, heads, kv_heads, head_dim), device,
                 f"{where}: the reference attention at seq_len {seq_len} with {heads} heads "
                 f"({heads} x {seq_len} x {seq_len + 1} fp32 scores, eight alive)",
                 "lower seq_len or heads")


def check_curve_request(k: int, experts: int, tile_m: int, tokens, where: str) -> None:
    require_at_most(experts, MAX_CURVE_EXPERTS, f"{where}: experts", "routed experts of any model are far fewer")
    require_at_most(tile_m, MAX_TILE_M, f"{where}: tile_m", "m-tiles of a grouped GEMM are at most a few hundred rows")
    check_list(tokens, f"{where}: tokens")
    for value in tokens:
        require_at_most(value, MAX_CURVE_TOKENS, f"{where}: a token count", "the curve's arithmetic stops there")


def check_quant_request(config, tokens, device, where: str) -> None:
    """check-quant's token counts before anything is drawn: the list's length, each count, and the memory of the
    largest row (its inputs, the three [T, D] fp32 outputs and references, the routing, and per woken pair the
    references' [2F + F + D] fp32 temporaries, twice)."""
    check_list(tokens, where)
    for value in tokens:
        require_at_most(value, MAX_CHECK_QUANT_TOKENS, f"{where}: a token count",
                        "a magnitude check needs no more: the grouped arms fill their tiles far below")
    largest = max(tokens, default=0)
    per_token = (8 * config.hidden + 2 * config.n_experts
                 + 2 * config.top_k * (3 * config.intermediate + config.hidden)) * 4
    require_fits(largest * per_token, device, f"{where}: the check at {largest} tokens", "ask for fewer tokens")


def check_generation_request(config, device, dtype, positions: int, batch: int, where: str) -> None:
    """The cache one generation allocates (positions = prompt + generated tokens), before it does."""
    require_fits(kv_cache_bytes(config, batch, positions, dtype), device,
                 f"{where}: the cache of {batch} sequence(s) of {positions} positions", "ask for fewer tokens")
