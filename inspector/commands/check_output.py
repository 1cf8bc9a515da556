"""What the attention checks' commands share about their output: strict JSON of a check's result, and the exit
code its verdict gives (check-attention, --mla, --decode; check-quant reads the JSON part)."""

from __future__ import annotations

import json
import math


def print_result(result: dict, fmt: str, format_text) -> int:
    """Any check's result as JSON or `format_text`'s text; its exit code: 0 ok, 1 the kernel sits elsewhere, 2 the
    check does not discriminate at these sizes."""
    print(json.dumps(_json_safe(result), indent=2) if fmt == "json" else format_text(result))
    if result["ok"]:
        return 0
    return 2 if not result["discrimination"]["fires"] else 1


def _json_safe(value):
    """Strict JSON: non-finite floats become strings ("NaN", "+inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value
