"""`moe-inspector curve`: the uniform-routing tile-fill curve and the exact amortization point, for a
routing shape given by hand or read from a model (`--model`: a preset or a checkpoint's config.json)."""

from __future__ import annotations

import csv
import io

from engine.curve import CURVE_TOKENS, curve
from inspector.commands.common import positive_int_list
from inspector.commands.output import add_format_arguments, output_format, print_json
from inspector.describe import fill_text

DEFAULT_TOKENS = ",".join(map(str, CURVE_TOKENS))


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("curve", help="pairs per woken expert and m-tile fill against tokens")
    parser.add_argument("--k", type=int, default=None, help="experts per token (default 6, or the model's)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts E (default 256, or the model's)")
    parser.add_argument("--model", default=None,
                        help="read k, E and the expert groups from a preset or a checkpoint directory's config.json")
    parser.add_argument("--tile-m", type=int, default=16, help="grouped-GEMM m-tile rows (default 16)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"token counts (default {DEFAULT_TOKENS})")
    add_format_arguments(parser, ("text", "json", "csv"), "text")
    parser.set_defaults(run=run)


def run(args) -> int:
    fmt = output_format(args)
    result = curve(args.k, args.experts, args.tile_m, positive_int_list(args.tokens, "--tokens"), args.model)
    if fmt == "json":
        print_json(result)
        return 0
    grouped = any("woken_groups" in row for row in result["rows"])
    if fmt == "csv":
        buffer = io.StringIO()
        columns = ["n", "woken", "pairs_per_woken", "fill", "amortizes"] + (["woken_groups"] if grouped else [])
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
        print(buffer.getvalue(), end="")
        return 0
    shape = result.get("routing", f"top-{result['k']} of {result['experts']} experts")
    print((f"{result['model']}: " if "model" in result else "") + f"{shape}, TILE_M={result['tile_m']}: "
          f"m-tiles amortize from {result['min_tokens']} tokens (uniform routing"
          + ("; group-limited routing wakes the same experts on average" if grouped else "") + ")")
    print(f"{'n':>7} {'woken':>9} {'pairs/woken':>12} {'m-tile fill':>14}  amortizes" + ("  groups" if grouped else ""))
    for row in result["rows"]:
        print(f"{row['n']:>7} {row['woken']:>9.1f} {row['pairs_per_woken']:>12.2f} "
              f"{fill_text(row['pairs_per_woken'], result['tile_m']):>14}  "
              + (f"{'yes' if row['amortizes'] else 'no':<9}  {row['woken_groups']:.1f}" if grouped
                 else ('yes' if row['amortizes'] else 'no')))
    print(f"m-tile fill: pairs per woken expert over TILE_M={result['tile_m']}; past one tile, the full tiles "
          "each woken expert fills")
    return 0
