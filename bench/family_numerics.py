"""bf16 numerics of the Hugging Face families against transformers, per teacher-forced step.

For each family (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) a random checkpoint is built with transformers
(float32 safetensors) and loaded into the engine through engine.hf_loader's mapping (`load_weights`: no
tokenizer, token ids are fed directly). One random token sequence is teacher-forced through every run:
the prompt prefilled, then one forced token per step, each run with its own KV cache. Per step the
error is ||a - b||_2 / ||b||_2 over the vocabulary's logits, b an fp32 reference's.

Runs: transformers fp32 (the reference), transformers fp32 on the bf16 model's weights (the second
reference), transformers bf16 (`from_pretrained(dtype=torch.bfloat16)`, its default attention and
experts functions), the engine in bf16 on `--device` (`engine_logits`: engine.model.forward with an
engine.dispatcher.Dispatcher, step by step as the one runtime's eager step runs it; on a GPU its kernel
arms and, where the family is eligible, engine.decode_fused), and the engine in fp32 on the CPU (the
mapping's check).

The rule (the FlashAttention test rule): the engine's bf16 error is at most 2x transformers' own bf16
error, at the worst step and in the mean, against each reference, with routing forced to that
reference's experts (`Routing`: a free run's worst step is decided by which near-tied routing decision
a rounding flips). The free runs are printed with their flips, not judged. docs/numerics.md says why.

    python bench/family_numerics.py --device cuda --out numerics.json             # H200: about a minute
    python bench/family_numerics.py --device cuda --seeds 3 --out numerics.json   # three checkpoints a family
    python bench/family_numerics.py --device cpu --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 \
        --intermediate 64 --experts 8 --top-k 2 --vocab 256                        # a CPU look

Prints three rows per family and checkpoint (the two judged conditions, the free runs) and PASS/FAIL;
exits 1 if any family fails or errors. tests/test_family_numerics.py runs it on the CPU at small widths.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import platform
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402 - after the sys.path line above, like the engine imports

from engine.provenance import commit_label  # noqa: E402 - MOEI_COMMIT where the tree has no git, as every footer

FAMILY_NAMES = ("qwen3-moe", "mixtral", "olmoe", "gpt-oss")
# transformers' config class, model class and the family's own keys (`Shape.family_keys`)
_CLASSES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM"),
}
RATIO_LIMIT = 2.0


@dataclass(frozen=True)
class Shape:
    """The random checkpoint's size. The defaults are the GPU run's; the CPU test passes smaller ones."""

    layers: int = 3
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 512  # per expert
    experts: int = 16
    top_k: int = 4
    vocab: int = 4096
    window: int = 8  # Mixtral's and gpt-oss's sliding window: shorter than the prompt, so it acts
    prompt: int = 16  # tokens prefilled
    steps: int = 24  # logits compared: the prefill's and steps - 1 decode steps'

    def family_keys(self, family: str) -> dict:
        common = dict(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                      num_experts_per_tok=self.top_k, max_position_embeddings=4096, pad_token_id=None,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
        if family == "qwen3-moe":
            return dict(common, moe_intermediate_size=self.intermediate, intermediate_size=2 * self.intermediate,
                        num_experts=self.experts, norm_topk_prob=True)
        if family == "mixtral":
            return dict(common, intermediate_size=self.intermediate, num_local_experts=self.experts,
                        sliding_window=self.window)
        if family == "olmoe":
            return dict(common, intermediate_size=self.intermediate, num_experts=self.experts, norm_topk_prob=False)
        return dict(common, intermediate_size=self.intermediate, num_local_experts=self.experts,
                    sliding_window=self.window,
                    layer_types=["sliding_attention" if layer % 2 == 0 else "full_attention"
                                 for layer in range(self.layers)])


def randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' own init (std 0.02, unit norms, zero biases) gives near-uniform logits; draw every
    parameter at a scale where each term matters: norm weights off one, biases and sinks nonzero,
    matrices 1/sqrt(fan_in), the router a little sharper so routing is decisive but not one-hot."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.3 * noise)
            elif name.endswith(("bias", "sinks")):
                parameter.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and "GptOss" in type(model).__name__:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))  # gpt-oss stores [E, in, out]
            elif parameter.dim() == 3:  # [E, out, in]
                parameter.copy_(noise / math.sqrt(parameter.shape[2]))
            else:  # Linear [out, in]
                parameter.copy_(noise * (2.0 if name.endswith(("gate.weight", "router.weight")) else 1.0)
                                / math.sqrt(parameter.shape[-1]))


def build_checkpoint(family: str, shape: Shape, directory: Path, seed: int) -> None:
    """A random float32 checkpoint of `family` at `shape`, saved by transformers into `directory`."""
    import transformers

    config_class, model_class = _CLASSES[family]
    config = getattr(transformers, config_class)(**shape.family_keys(family))
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)


def load_transformers(directory: Path, dtype: torch.dtype, device: torch.device):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)  # its own defaults
    return model.to(device).eval()


def load_engine(directory: Path, device: torch.device, dtype: torch.dtype):
    """The engine on `device` with weights in `dtype`, through the loader's mapping, with no tokenizer.
    On a CPU the engine runs float32 (`Engine.dtype_for`); its torch forward computes in the weights'
    dtype, so a bf16 CPU engine is the Engine built with bf16 weights and its `dtype` (the KV cache's)
    set to match."""
    from engine.hf_loader import load_weights, read_config
    from engine.runtime import Engine

    config, family = read_config(Path(directory))
    weights = load_weights(directory, config, family, device, dtype, stream=io.StringIO())  # no progress bar
    engine = Engine(config, device, weights=weights, weights_source=f"{family} checkpoint {directory}")
    engine.dtype = dtype
    return engine


class Routing:
    """Records each run's expert choices and, when `forced`, makes a run take the reference's.

    MoE routing is discrete: near a tie of the k-th and (k+1)-th router logit, one rounding moves a token
    to another expert and its output by O(1), and through the KV cache every later step with it. Which
    bf16 run flips where is chance (a single random checkpoint's worst-step ratio between two faithful
    bf16 implementations ranged over 0.06x-16x on the CPU: docs/numerics.md), so the rule is judged with each bf16
    run taking the fp32 reference's experts, top-k replaced by a gather of those ids, every other
    operation the run's own: its router logits, its routing-weight formula and roundings, attention,
    norms and experts. The free runs are measured and reported too, with how many decisions flipped.

    `reference` [layer] -> [positions, k] expert ids in position order (prefill rows, then one a step);
    each run consumes them with a cursor per layer."""

    def __init__(self, reference: dict[int, torch.Tensor] | None = None) -> None:
        self.reference = reference
        self.cursor: dict[int, int] = {}
        self.recorded: dict[int, list[torch.Tensor]] = {}

    @property
    def forced(self) -> bool:
        return self.reference is not None

    def record(self, layer: int, ids: torch.Tensor) -> None:
        self.recorded.setdefault(layer, []).append(ids.reshape(-1, ids.shape[-1]).long().cpu())

    def ids(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(rows) for layer, rows in sorted(self.recorded.items())}

    def next_ids(self, layer: int, rows: int, device) -> torch.Tensor:
        start = self.cursor.get(layer, 0)
        ids = self.reference[layer][start:start + rows]
        if ids.shape[0] != rows:
            raise RuntimeError(f"layer {layer}: routing asked for rows {start}..{start + rows} of "
                               f"{self.reference[layer].shape[0]} recorded: the runs are not aligned")
        self.cursor[layer] = start + rows
        return ids.to(device)

    @contextlib.contextmanager
    def topk(self, layer: int):
        """Inside, torch.topk(x, k, dim=-1) returns (x.gather(-1, ids), ids) with the reference's next ids
        for x's rows when forced, and is torch.topk otherwise; what it returns is recorded either way."""
        original = torch.topk
        calls = []

        def topk(values, k, dim=-1, *args, **kwargs):
            if self.forced and values.dim() == 2 and dim in (-1, 1):
                ids = self.next_ids(layer, values.shape[0], values.device)
                result = torch.return_types.topk((values.gather(-1, ids), ids))
            else:
                result = original(values, k, dim, *args, **kwargs)
            calls.append(result.indices)
            return result

        torch.topk = topk
        try:
            yield calls
        finally:
            torch.topk = original
        if len(calls) != 1:
            raise RuntimeError(f"layer {layer}: the router called torch.topk {len(calls)} times, expected once: "
                               f"routing cannot be forced through this router")
        self.record(layer, calls[0])


def flips(ids: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> int:
    """Routing decisions (layer, position) whose set of k experts differs from the reference's."""
    return sum(int((torch.sort(ids[layer], dim=-1).values != torch.sort(reference[layer], dim=-1).values)
                   .any(dim=-1).sum()) for layer in reference)


def _routed_dispatcher(engine, routing: Routing):
    """An engine.runtime.Dispatcher whose MoE hook records the layer's expert ids and, when `routing` is
    forced, replaces them and their weights with engine.model.route's on the same h with the reference's
    ids (on a GPU's fused decode step too, whose router is a kernel computing the same function)."""
    from engine import flags
    from engine.model import route
    from engine.runtime import Dispatcher

    class RoutedDispatcher(Dispatcher):
        def moe(self, layer, h, w13, w2, topk_ids, topk_weights, experts=None, woken=None):
            if routing.forced:
                config, p = engine.config, f"layers.{layer}."
                with routing.topk(layer):
                    topk_ids, weights = route(h, engine.weights[p + "router"], config.top_k,
                                              engine.weights.get(p + "router_bias"), config.router,
                                              config.norm_topk_prob)
                topk_weights, woken = weights.to(h.dtype), None  # as engine.model._experts casts them
            else:
                routing.record(layer, topk_ids)
            return super().moe(layer, h, w13, w2, topk_ids, topk_weights, experts=experts, woken=woken)

    return RoutedDispatcher(engine, flags.resolve(environ={}), timed=False)


@torch.inference_mode()
def engine_logits(engine, tokens: list[int], prompt: int, steps: int, dispatcher) -> torch.Tensor:
    """Teacher-forced logits [steps, V] float32 on the CPU: the prompt tokens[:prompt] prefilled, then
    tokens[prompt + i] fed at step i + 1 whatever the engine would have picked. Each step is the one
    runtime's eager step of one sequence (engine.batch_runner.BatchRunner._eager / _next_tokens): a
    StepLayout per step, a decode step reading the whole cache row (as its CUDA graph does) and, on a GPU,
    writing its folds' outputs (StepOutputs), then the step's one sync. A graph's replay launches the
    same kernels."""
    from engine.decode_fused import StepOutputs
    from engine.model import KVCache, StepLayout, forward
    from engine.runtime import DECODE, PREFILL

    capacity, device = prompt + steps, engine.device
    cache = KVCache.allocate(engine.config, 1, capacity, device, engine.dtype)
    inputs, start, out = torch.tensor([tokens[:prompt]], device=device), 0, []
    for step in range(steps):
        decode = step > 0
        dispatcher.begin_step(step, DECODE if decode else PREFILL, inputs.shape[1])
        layout = StepLayout(torch.tensor([start], device=device), capacity if decode else start + inputs.shape[1])
        if device.type == "cuda" and decode:
            dispatcher.outputs = StepOutputs(torch.empty(1 + engine.config.n_layers, dtype=torch.int64, device=device))
        try:
            logits = forward(engine.config, engine.weights, inputs, layout, cache, dispatcher)  # [1, V]
        finally:
            dispatcher.outputs = None
        dispatcher.end_step(torch.argmax(logits[0]))
        start += inputs.shape[1]
        out.append(logits[0].float().cpu())
        inputs = torch.tensor([[tokens[prompt + step]]], device=device)
    return torch.stack(out)


def _routers(model) -> list[torch.nn.Module]:
    """transformers' router modules in layer order (Mixtral, Qwen3-MoE, OLMoE, gpt-oss: *TopKRouter)."""
    routers = [module for _, module in model.named_modules() if type(module).__name__.endswith("TopKRouter")]
    if len(routers) != model.config.num_hidden_layers:
        raise RuntimeError(f"{type(model).__name__}: found {len(routers)} *TopKRouter modules for "
                           f"{model.config.num_hidden_layers} layers: routing cannot be recorded or forced")
    return routers


@torch.inference_mode()
def transformers_logits(model, tokens: list[int], prompt: int, steps: int, routing: Routing) -> torch.Tensor:
    """The same teacher forcing through transformers with its KV cache: logits [steps, V] float32. Each
    router's forward runs inside `routing.topk`, so its choices are recorded (or forced)."""
    originals = []
    for layer, router in enumerate(_routers(model)):
        def forward(*args, _original=router.forward, _layer=layer, **kwargs):
            with routing.topk(_layer):
                return _original(*args, **kwargs)
        originals.append((router, router.forward))
        router.forward = forward
    try:
        device = next(model.parameters()).device
        inputs = torch.tensor([tokens[:prompt]], device=device)
        cache, out = None, []
        for step in range(steps):
            result = model(input_ids=inputs, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            out.append(result.logits[0, -1].float().cpu())
            inputs = torch.tensor([[tokens[prompt + step]]], device=device)
    finally:
        for router, original in originals:
            router.forward = original
    return torch.stack(out)


def step_errors(ours: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per step ||ours - reference||_2 / ||reference||_2 over the vocabulary."""
    return ((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).tolist()


@dataclass
class Errors:
    """One bf16 run's per-step errors against an fp32 reference, and its routing decisions that differ."""

    steps: list[float]
    flips: int

    @property
    def worst(self) -> float:
        return max(self.steps)

    @property
    def mean(self) -> float:
        return sum(self.steps) / len(self.steps)


@dataclass
class Comparison:
    """The engine's bf16 run and transformers' against the same fp32 reference, under one condition."""

    condition: str
    judged: bool
    engine: Errors
    transformers_bf16: Errors
    worst_ratio: float = field(init=False)
    mean_ratio: float = field(init=False)
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.worst_ratio = self.engine.worst / self.transformers_bf16.worst
        self.mean_ratio = self.engine.mean / self.transformers_bf16.mean
        self.passed = self.worst_ratio <= RATIO_LIMIT and self.mean_ratio <= RATIO_LIMIT

    def row(self, decisions: int) -> str:
        def run(errors: Errors) -> str:
            flips = f" ({errors.flips}/{decisions} flips)" if not self.judged else ""
            return f"worst {errors.worst:.4f} mean {errors.mean:.4f}{flips}"

        verdict = ("PASS" if self.passed else "FAIL") if self.judged else "not judged"
        return (f"{self.condition:26s} engine {run(self.engine)} | transformers bf16 {run(self.transformers_bf16)}"
                f" | ratio worst {self.worst_ratio:.2f}x mean {self.mean_ratio:.2f}x {verdict}")


# The conditions, in the order printed. The reference of the first and third is transformers in fp32 on the
# checkpoint's fp32 weights (the rule as stated); of the second, transformers in fp32 on the weights its bf16
# model holds (bf16, gpt-oss's norms fp32), which the engine holds too: the weights' rounding, common to both
# bf16 runs and most of their error against the first reference, is then out of the comparison, and what is
# left is the roundings of the computation.
FP32_WEIGHTS, BF16_WEIGHTS, FREE = "fp32 weights, forced", "bf16 weights, forced", "fp32 weights, free"


@dataclass
class FamilyResult:
    family: str
    comparisons: list[Comparison]
    decisions: int  # routing decisions per run (layers x positions)
    engine_fp32_error: float  # worst step of the engine in fp32 (CPU) against the fp32 reference: the mapping
    transformers_implementation: str  # the attention and experts functions transformers chose (its defaults)
    seconds: float
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = all(comparison.passed for comparison in self.comparisons if comparison.judged)

    def comparison(self, condition: str) -> Comparison:
        return next(comparison for comparison in self.comparisons if comparison.condition == condition)

    def row(self) -> str:
        lines = [f"{self.family}: {'PASS' if self.passed else 'FAIL'} (engine fp32 on the CPU: worst "
                 f"{self.engine_fp32_error:.1e}; transformers {self.transformers_implementation}; "
                 f"{self.seconds:.0f} s)"]
        lines += [f"  {comparison.row(self.decisions)}" for comparison in self.comparisons]
        return "\n".join(lines)


def measure(family: str, shape: Shape, device: torch.device, seed: int, directory: Path) -> FamilyResult:
    """Build `family`'s checkpoint in `directory`, run every teacher-forced run, compare."""
    began = time.perf_counter()
    build_checkpoint(family, shape, directory, seed)
    generator = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(0, shape.vocab, (shape.prompt + shape.steps,), generator=generator).tolist()
    run = (tokens, shape.prompt, shape.steps)

    def reference_run(model) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        routing = Routing()
        return transformers_logits(model, *run, routing), routing.ids()

    model = load_transformers(directory, torch.float32, device)
    references = {FP32_WEIGHTS: reference_run(model)}
    del model
    model = load_transformers(directory, torch.bfloat16, device)
    implementation = (f"attention {model.config._attn_implementation}, experts "
                      f"{getattr(model.config, '_experts_implementation', None) or 'eager'}")
    held = copy.deepcopy(model).float()  # the bf16 model's own weights, computed in fp32
    references[BF16_WEIGHTS] = reference_run(held)
    del held
    references[FREE] = references[FP32_WEIGHTS]

    def forcing(condition: str) -> Routing:
        return Routing(None if condition == FREE else references[condition][1])

    def errors(logits: torch.Tensor, condition: str, routing: Routing) -> Errors:
        logits_reference, ids_reference = references[condition]
        flipped = 0 if routing.forced else flips(routing.ids(), ids_reference)
        return Errors(step_errors(logits, logits_reference), flipped)

    transformers_runs = {}
    for condition in references:
        routing = forcing(condition)
        transformers_runs[condition] = errors(transformers_logits(model, *run, routing), condition, routing)
    del model
    engine = load_engine(directory, device, torch.bfloat16)
    engine_runs = {}
    for condition in references:
        routing = forcing(condition)
        engine_runs[condition] = errors(engine_logits(engine, *run, _routed_dispatcher(engine, routing)), condition,
                                        routing)
    del engine
    # The mapping's check runs on the CPU, where the engine's float32 path is its default (on a GPU the
    # engine runs bf16 and its kernel arms are not all built for float32).
    engine = load_engine(directory, torch.device("cpu"), torch.float32)
    engine_fp32 = engine_logits(engine, *run, _routed_dispatcher(engine, Routing()))
    del engine
    comparisons = [Comparison(condition, condition != FREE, engine_runs[condition], transformers_runs[condition])
                   for condition in references]
    decisions = sum(ids.shape[0] for ids in references[FP32_WEIGHTS][1].values())
    return FamilyResult(family, comparisons, decisions, max(step_errors(engine_fp32, references[FP32_WEIGHTS][0])),
                        implementation, time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default=",".join(FAMILY_NAMES))
    parser.add_argument("--seed", type=int, default=0, help="the first checkpoint's seed")
    parser.add_argument("--seeds", type=int, default=1, help="checkpoints per family (seeds seed, seed+1, ...)")
    parser.add_argument("--out", type=Path, help="write the per-step errors and verdicts here as JSON")
    defaults = Shape()
    for name in asdict(defaults):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = parser.parse_args(argv)
    shape = Shape(**{name: getattr(args, name) for name in asdict(defaults)})
    families = [name.strip() for name in args.families.split(",") if name.strip()]
    unknown = sorted(set(families) - set(FAMILY_NAMES))
    if unknown or args.seeds < 1 or shape.steps < 1 or shape.prompt < 1:
        parser.error(f"unknown families {unknown} (choose from {', '.join(FAMILY_NAMES)}), or --seeds, --steps or "
                     f"--prompt below 1")
    device = torch.device(args.device)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values' rename, announced for 5.40
    print(f"# family numerics at {commit_label()}: {shape}, device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
          f"torch {torch.__version__}, transformers {transformers.__version__}; rule: engine bf16 error <= "
          f"{RATIO_LIMIT:g}x transformers bf16 error (worst step and mean), both against transformers fp32, "
          f"with routing forced to the fp32 run's experts", flush=True)
    results, failures = [], []
    with tempfile.TemporaryDirectory(prefix="family-numerics-") as scratch:
        for index, family in enumerate(families):
            for repeat in range(args.seeds):
                seed = args.seed + index * 1000 + repeat
                try:
                    result = measure(family, shape, device, seed, Path(scratch) / f"{family}-{seed}")
                except Exception as error:  # one family's failure must not cost the others' figures
                    print(f"{family:10s} seed {seed}: ERROR {type(error).__name__}: {error}", flush=True)
                    failures.append({"family": family, "seed": seed, "error": f"{type(error).__name__}: {error}"})
                    continue
                print(f"{result.row()}\n  (seed {seed})", flush=True)
                results.append((seed, result))
                shutil.rmtree(Path(scratch) / f"{family}-{seed}", ignore_errors=True)
    failed = sorted({result.family for _, result in results if not result.passed}
                    | {failure["family"] for failure in failures})
    print(f"# {'FAIL: ' + ', '.join(failed) if failed else 'PASS: every family'}")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "commit": commit_label(), "shape": asdict(shape), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "ratio_limit": RATIO_LIMIT,
            "results": [dict(asdict(result), seed=seed) for seed, result in results], "errors": failures,
            "failed": failed}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
