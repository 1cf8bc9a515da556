"""One module per headless subcommand: `add_parser(subparsers)` registers it (with
`set_defaults(run=run)`), `run(args) -> int` returns the exit code. A `UserError` raised from
`run` becomes a one-line message and exit 2 in `inspector.cli`."""

# Order is the order of `moe-inspector --help`.
COMMAND_MODULES = [
    "curve",
    "generate",
    "compare",
    "check_attention",
    "check_quant",
    "sweep",
    "run",
    "replay",
    "bench",
    "ab",
    "flags",
    "routing",
    "quantize",
]
