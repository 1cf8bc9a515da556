"""The uniform-routing tile-fill curve of a routing shape, given by hand or read from a model: what
`moe-inspector curve`, a session's curve step and the TUI's tile-fill screen show.

`curve(k, experts, tile_m, tokens, model)` -> {"k", "experts", "tile_m", "min_tokens", "rows": [one
engine.dispatch.curve_row per token count]}, plus the model's name and routing (expert groups, shared
experts) when read from one. Plain arithmetic over engine.dispatch's closed forms; a bad shape is a
UserError naming it. Does not draw anything or read a calibration.
"""

from __future__ import annotations

from engine import dispatch
from engine.errors import UserError
from engine.limits import check_curve_request

# The token counts a curve shows when none are asked for.
CURVE_TOKENS = (1, 8, 9, 16, 32, 64, 128, 256, 512, 683, 1024, 2048, 4096, 8192)


def routing_from(model: str | None, k: int | None, experts: int | None) -> tuple[dispatch.RoutingShape, str | None]:
    """The routing shape to draw and the model it came from (None: by hand, 6 of 256 by default)."""
    if model is None:
        k, experts = 6 if k is None else k, 256 if experts is None else experts
        if experts < 1 or not 1 <= k <= experts:
            raise UserError(f"--k {k} --experts {experts}: need 1 <= k <= experts")
        return dispatch.RoutingShape(k, experts), None
    if k is not None or experts is not None:
        raise UserError("--model reads k and E from the model: give --model or --k/--experts, not both")
    from engine.model_source import model_config  # a directory's config.json goes through engine.hf_loader

    config = model_config(model)
    return dispatch.routing_shape(config), config.name


def curve(k: int | None, experts: int | None, tile_m: int, tokens: list[int] | tuple[int, ...] = CURVE_TOKENS,
          model: str | None = None) -> dict:
    routing, name = routing_from(model, k, experts)
    from engine.flags import TILE_M_CHOICES  # the gate's tiles: a fill of any other size decides nothing

    if tile_m not in TILE_M_CHOICES:
        raise UserError(f"--tile-m {tile_m}: the grouped GEMM's m-tiles are {', '.join(map(str, TILE_M_CHOICES))}")
    check_curve_request(routing.k, routing.n_experts, tile_m, tokens, "curve")
    result = {"k": routing.k, "experts": routing.n_experts, "tile_m": tile_m,
              "min_tokens": dispatch.min_tokens(routing.k, routing.n_experts, tile_m),
              "rows": [dispatch.curve_row(n, routing.k, routing.n_experts, tile_m, routing) for n in tokens]}
    if name is not None:
        result.update(model=name, routing=routing.describe(), n_group=routing.n_group, topk_group=routing.topk_group,
                      shared_experts=routing.shared)
    return result
