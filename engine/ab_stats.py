"""The statistics of an A/B: per row, each side's median and spread over its rounds, the ratio B/A with a
seeded bootstrap interval, and a verdict. Plain functions over plain floats (no torch, no numpy), so the
rule is tested on stub timings and reads the same everywhere.

Every value is a time (lower is better: µs per token, µs per call), one per round and side. A round runs
A and B back to back in alternating order (A B, B A, A B, ...), so the pairs share the device's state at
that moment; the interval resamples whole rounds (pairs), which keeps a drift that both sides saw (clocks,
the host's other load) out of the ratio.

    ratio     median(B) / median(A): above 1, B takes longer
    interval  the 2.5 % and 97.5 % percentiles of the same ratio over RESAMPLES bootstrap resamples of
              the rounds (with replacement, pairs kept together), from a random.Random(seed)
    verdict   (the rule, in this order; docs/ab.md)
              - fewer than `min_rounds` rounds:                      insufficient data (too few rounds)
              - the interval inside [1 - tolerance, 1 + tolerance]:  no change
              - the interval entirely above 1:                       slower
              - the interval entirely below 1:                       faster
              - otherwise (it holds 1 and reaches past the band):    insufficient data (too noisy)

Knows nothing of processes, workloads or reports (engine.ab_rows and inspector.commands.ab).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from engine.limits import MAX_AB_RESAMPLES

RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by < 0.1 % between seeds at 10 rounds
CONFIDENCE = 0.95
TOLERANCE = 0.02  # the no-change band: |B/A - 1| <= 2 %, about the spread of one process's row over its reps
MIN_ROUNDS = 5  # with fewer pairs a 95 % interval of a median is the range of the values, which decides little
SEED = 0

FASTER, SLOWER, NO_CHANGE, INSUFFICIENT = "faster", "slower", "no change", "insufficient data"
VERDICTS = (FASTER, SLOWER, NO_CHANGE, INSUFFICIENT)


@dataclass(frozen=True)
class Rule:
    """How a verdict is reached; recorded in every report."""

    tolerance: float = TOLERANCE
    confidence: float = CONFIDENCE
    resamples: int = RESAMPLES
    min_rounds: int = MIN_ROUNDS
    seed: int = SEED

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tolerance) and 0 < self.tolerance < 1):
            raise ValueError(f"tolerance {self.tolerance}: give a fraction in (0, 1), e.g. 0.02 for 2 %")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence {self.confidence}: give a fraction in (0, 1)")
        if not 100 <= self.resamples <= MAX_AB_RESAMPLES:  # each is a pass over the rounds in pure Python
            raise ValueError(f"resamples {self.resamples}: give from 100 to {MAX_AB_RESAMPLES}")
        if self.min_rounds < 2:
            raise ValueError(f"min_rounds {self.min_rounds}: give at least 2")

    def to_json(self) -> dict:
        return {"tolerance": self.tolerance, "confidence": self.confidence, "resamples": self.resamples,
                "min_rounds": self.min_rounds, "seed": self.seed, "statistic": "median(B) / median(A)",
                "interval": "percentile bootstrap over rounds, A and B of a round resampled together"}


def spread(values: list[float]) -> dict:
    """A side's values: median, min, max, and the median absolute deviation relative to the median."""
    middle = statistics.median(values)
    deviation = statistics.median(abs(value - middle) for value in values)
    return {"median": middle, "min": min(values), "max": max(values),
            "mad_rel": deviation / middle if middle else math.nan, "values": list(values)}


def _percentile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bootstrap_interval(a: list[float], b: list[float], rule: Rule = Rule()) -> tuple[float, float]:
    """The `rule.confidence` percentile interval of median(B)/median(A), resampling round indices."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number (>= 1) of rounds on each side, got {len(a)} and {len(b)}")
    generator = random.Random(rule.seed)
    rounds = len(a)
    ratios = []
    for _ in range(rule.resamples):
        picks = [generator.randrange(rounds) for _ in range(rounds)]
        ratios.append(statistics.median(b[i] for i in picks) / statistics.median(a[i] for i in picks))
    ratios.sort()
    tail = (1 - rule.confidence) / 2
    return _percentile(ratios, tail), _percentile(ratios, 1 - tail)


@dataclass(frozen=True)
class Comparison:
    rounds: int
    a: dict  # spread(A)
    b: dict
    ratio: float
    interval: tuple[float, float] | None
    verdict: str
    why: str

    def to_json(self) -> dict:
        return {"rounds": self.rounds, "a": self.a, "b": self.b, "ratio": self.ratio,
                "interval": None if self.interval is None else list(self.interval),
                "verdict": self.verdict, "why": self.why}


def compare(a: list[float], b: list[float], rule: Rule = Rule()) -> Comparison:
    """One row's verdict from its per-round times (lower is better) on each side, paired by round."""
    if len(a) != len(b):
        raise ValueError(f"rounds must pair: {len(a)} values for A, {len(b)} for B")
    if not a:
        raise ValueError("no rounds to compare")
    for value in (*a, *b):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"a time of {value} is not a measurement (finite and > 0)")
    ratio = statistics.median(b) / statistics.median(a)
    if len(a) < rule.min_rounds:
        return Comparison(len(a), spread(a), spread(b), ratio, None, INSUFFICIENT,
                          f"{len(a)} rounds, fewer than the {rule.min_rounds} a verdict needs")
    low, high = bootstrap_interval(a, b, rule)
    band = f"±{100 * rule.tolerance:g} %"
    span = f"[{low:.4f}, {high:.4f}]"
    if 1 - rule.tolerance <= low and high <= 1 + rule.tolerance:
        verdict, why = NO_CHANGE, f"the interval {span} lies inside {band}"
    elif low > 1:
        verdict, why = SLOWER, f"the interval {span} lies above 1: B takes {100 * (ratio - 1):.1f} % longer"
    elif high < 1:
        verdict, why = FASTER, f"the interval {span} lies below 1: B takes {100 * (1 - ratio):.1f} % less time"
    else:
        verdict, why = INSUFFICIENT, f"the interval {span} holds 1 and reaches past {band}: too noisy to decide"
    return Comparison(len(a), spread(a), spread(b), ratio, (low, high), verdict, why)


def regression_beyond(comparison: Comparison | dict, percent: float) -> bool:
    """Whether a row fails `--fail-on-regression PERCENT`: a `slower` verdict whose ratio exceeds
    1 + PERCENT / 100 (the point estimate; the interval already lies above 1)."""
    data = comparison.to_json() if isinstance(comparison, Comparison) else comparison
    return data.get("verdict") == SLOWER and data["ratio"] > 1 + percent / 100
