"""`moe-inspector curve`: the uniform-routing tile-fill curve and the exact amortization point, for a
routing shape given by hand or read from a model (`--model`: a preset or a checkpoint's config.json)."""

from __future__ import annotations

from engine.curve import CURVE_TOKENS, curve
from inspector.commands.common import add_json_argument, positive_int_list, print_json

DEFAULT_TOKENS = ",".join(map(str, CURVE_TOKENS))


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("curve", help="pairs per woken expert and m-tile fill against tokens")
    parser.add_argument("--k", type=int, default=None, help="experts per token (default 6, or the model's)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts E (default 256, or the model's)")
    parser.add_argument("--model", default=None,
                        help="read k, E and the expert groups from a preset or a checkpoint directory's config.json")
    parser.add_argument("--tile-m", type=int, default=16, help="grouped-GEMM m-tile rows (default 16)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"token counts (default {DEFAULT_TOKENS})")
    add_json_argument(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    result = curve(args.k, args.experts, args.tile_m, positive_int_list(args.tokens, "--tokens"), args.model)
    if args.json:
        print_json(result)
        return 0
    grouped = any("woken_groups" in row for row in result["rows"])
    shape = result.get("routing", f"top-{result['k']} of {result['experts']} experts")
    print((f"{result['model']}: " if "model" in result else "") + f"{shape}, TILE_M={result['tile_m']}: "
          f"m-tiles amortize from {result['min_tokens']} tokens (uniform routing"
          + ("; group-limited routing wakes the same experts on average" if grouped else "") + ")")
    print(f"{'n':>7} {'woken':>9} {'pairs/woken':>12} {'fill':>8}  amortizes" + ("  groups" if grouped else ""))
    for row in result["rows"]:
        print(f"{row['n']:>7} {row['woken']:>9.1f} {row['pairs_per_woken']:>12.2f} {100 * row['fill']:>7.1f}%  "
              + (f"{'yes' if row['amortizes'] else 'no':<9}  {row['woken_groups']:.1f}" if grouped
                 else ('yes' if row['amortizes'] else 'no')))
    return 0
