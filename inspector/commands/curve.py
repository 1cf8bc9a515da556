"""`moe-inspector curve`: the uniform-routing tile-fill curve and the exact amortization point."""

from __future__ import annotations

from engine import dispatch
from engine.errors import UserError
import csv
import io

from inspector.commands.common import positive_int_list
from inspector.commands.output import add_format_arguments, output_format, print_json
from inspector.describe import fill_text

DEFAULT_TOKENS = "1,8,9,16,32,64,128,256,512,683,1024,2048,4096,8192"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("curve", help="pairs per woken expert and m-tile fill against tokens")
    parser.add_argument("--k", type=int, default=6, help="experts per token (default 6)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts E (default 256)")
    parser.add_argument("--tile-m", type=int, default=16, help="grouped-GEMM m-tile rows (default 16)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"token counts (default {DEFAULT_TOKENS})")
    add_format_arguments(parser, ("text", "json", "csv"), "text")
    parser.set_defaults(run=run)


def curve(k: int, experts: int, tile_m: int, tokens: list[int]) -> dict:
    if experts < 1 or not 1 <= k <= experts:
        raise UserError(f"--k {k} --experts {experts}: need 1 <= k <= experts")
    if tile_m < 1:
        raise UserError(f"--tile-m {tile_m}: must be >= 1")
    return {"k": k, "experts": experts, "tile_m": tile_m, "min_tokens": dispatch.min_tokens(k, experts, tile_m),
            "rows": [dispatch.curve_row(n, k, experts, tile_m) for n in tokens]}


def run(args) -> int:
    fmt = output_format(args)
    result = curve(args.k, args.experts, args.tile_m, positive_int_list(args.tokens, "--tokens"))
    if fmt == "json":
        print_json(result)
        return 0
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["n", "woken", "pairs_per_woken", "fill", "amortizes"],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(result["rows"])
        print(buffer.getvalue(), end="")
        return 0
    print(f"top-{result['k']} of {result['experts']} experts, TILE_M={result['tile_m']}: "
          f"m-tiles amortize from {result['min_tokens']} tokens (uniform routing)")
    print(f"{'n':>7} {'woken':>9} {'pairs/woken':>12} {'m-tile fill':>14}  amortizes")
    for row in result["rows"]:
        print(f"{row['n']:>7} {row['woken']:>9.1f} {row['pairs_per_woken']:>12.2f} "
              f"{fill_text(row['pairs_per_woken'], result['tile_m']):>14}  {'yes' if row['amortizes'] else 'no'}")
    print(f"m-tile fill: pairs per woken expert over TILE_M={result['tile_m']}; past one tile, the full tiles "
          "each woken expert fills")
    return 0
