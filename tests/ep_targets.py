"""Targets the expert-parallel tests spawn on every rank (engine.ep_launch.run): module-level functions that
pickle, in a module the spawned ranks import from the tests' directory. Each builds the same engine as the
one-device run it is compared with, keeps its rank's experts and returns rank 0's outputs."""

from __future__ import annotations

import dataclasses

import torch

from engine import expert_parallel
from engine.config import SharedExperts, from_name
from engine.flags import resolve
from engine.runtime import Engine

# Prompts of several lengths at once: a ragged prefill, mixed steps, token counts that no rank count divides
PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [64, 1, 2], [250, 11, 13, 18, 40]]


def small_moe_config():
    """A small random MoE beside tiny: 12 experts (divisible by 1, 2, 4; 3 per rank at 4), top-3, a shared
    expert (replicated, outside the exchange), hidden 48."""
    return dataclasses.replace(from_name("tiny"), name="ep-small", hidden=48, intermediate=24, n_experts=12,
                               top_k=3, shared_experts=SharedExperts(1, 16))


def build_engine(model: str, device: str = "cpu") -> Engine:
    config = from_name("tiny") if model == "tiny" else small_moe_config()
    return Engine(config, torch.device(device), seed=3)


def generate(engine: Engine, max_tokens: int, flags: list[str] = ()) -> dict:
    """Greedy tokens, every generated token's logits (on the host), the steps' MoE records and the executed arms'
    counters of one batch of PROMPTS."""
    run = engine.generate_batch(PROMPTS, max_tokens, resolve(list(flags), environ={}), keep_logits=True)
    return {"tokens": run.tokens, "logits": [torch.stack(rows).cpu() for rows in run.logits],
            "moe": [step["moe"] for step in run.steps], "provenance": engine.provenance(),
            "counters": run.counters["arms"]}


def generate_on_rank(group, payload: dict) -> dict:
    """Every model of payload["models"] on this rank (payload["device"]: cpu, or cuda for GPU `rank`), its experts
    sharded over the group, under payload["flags"] (FLAG=VALUE strings)."""
    from engine.ep_launch import rank_device

    results = {}
    for model in payload["models"]:
        engine = build_engine(model, rank_device(payload.get("device", "cpu"), group.rank))
        expert_parallel.shard(engine, group)
        results[model] = generate(engine, payload["max_tokens"], payload.get("flags", ()))
    return results


def write_after_collective(group, payload: dict) -> int:
    """Rank 0 writes payload["path"] only after a collective every rank joins: a dead peer leaves no file."""
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    if group.rank == 0:
        with open(payload["path"], "w") as handle:
            handle.write(str(value.item()))
    return 0


def refuse_on_rank_one(group, payload: dict) -> int:
    from engine.errors import UserError

    if group.rank == 1:
        raise UserError("rank 1: this input is refused")
    import torch.distributed as dist

    dist.barrier()
    return 0
