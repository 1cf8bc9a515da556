"""`moe-inspector curve`: the uniform-routing tile-fill curve and the exact amortization point."""

from __future__ import annotations

from engine import dispatch
from engine.errors import UserError
from engine.limits import check_curve_request
from inspector.commands.common import add_json_argument, positive_int_list, print_json

DEFAULT_TOKENS = "1,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("curve", help="pairs per woken expert and m-tile fill against tokens")
    parser.add_argument("--k", type=int, default=6, help="experts per token (default 6)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts E (default 256)")
    parser.add_argument("--tile-m", type=int, default=16, help="grouped-GEMM m-tile rows (default 16)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"token counts (default {DEFAULT_TOKENS})")
    add_json_argument(parser)
    parser.set_defaults(run=run)


def curve(k: int, experts: int, tile_m: int, tokens: list[int]) -> dict:
    if experts < 1 or not 1 <= k <= experts:
        raise UserError(f"--k {k} --experts {experts}: need 1 <= k <= experts")
    if tile_m < 1:
        raise UserError(f"--tile-m {tile_m}: must be >= 1")
    return {"k": k, "experts": experts, "tile_m": tile_m, "min_tokens": dispatch.min_tokens(k, experts, tile_m),
            "rows": [dispatch.curve_row(n, k, experts, tile_m) for n in tokens]}


def run(args) -> int:
    tokens = positive_int_list(args.tokens, "--tokens")
    check_curve_request(args.k, args.experts, args.tile_m, tokens, "curve")
    result = curve(args.k, args.experts, args.tile_m, tokens)
    if args.json:
        print_json(result)
        return 0
    print(f"top-{result['k']} of {result['experts']} experts, TILE_M={result['tile_m']}: "
          f"m-tiles amortize from {result['min_tokens']} tokens (uniform routing)")
    print(f"{'n':>7} {'woken':>9} {'pairs/woken':>12} {'fill':>8}  amortizes")
    for row in result["rows"]:
        print(f"{row['n']:>7} {row['woken']:>9.1f} {row['pairs_per_woken']:>12.2f} {100 * row['fill']:>7.1f}%  "
              f"{'yes' if row['amortizes'] else 'no'}")
    return 0
