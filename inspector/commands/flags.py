"""`moe-inspector flags`: every flag of the registry (engine.flags.SPECS), so a flag added there
appears here by itself: its values, default, environment variable and meaning, and its value
now (from --set, the environment or the default) with where that came from.

Precedence: command line (--set) > session > environment (MOEI_<FLAG>) > default.
"""

from __future__ import annotations

from engine import flags as flag_registry
from engine.flags import SPECS, environment_name, format_value
from inspector.commands.output import add_format_arguments, output_format, print_json

PRECEDENCE = "command line (--set) > session [flags] > environment (MOEI_<FLAG>) > default"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("flags", help="every flag: its values, default, environment variable and meaning")
    parser.add_argument("--set", dest="set_flags", action="append", default=[], metavar="FLAG=VALUE",
                        help="show the flags as these assignments would leave them (repeatable)")
    add_format_arguments(parser, ("text", "json", "md"), "text", "md: a markdown table")
    parser.set_defaults(run=run)


def describe_flags(resolved: flag_registry.ResolvedFlags) -> list[dict]:
    return [{"name": name, "kind": spec.kind, "values": spec.allowed,
             "choices": list(spec.choices) if spec.kind != "int" else None,
             "default": spec.default, "environment": environment_name(name), "meaning": spec.help,
             "value": resolved[name], "source": resolved.sources[name]} for name, spec in SPECS.items()]


def run(args) -> int:
    fmt = output_format(args)
    resolved = flag_registry.resolve(args.set_flags)
    entries = describe_flags(resolved)
    if fmt == "json":
        print_json({"precedence": PRECEDENCE, "flags": entries})
        return 0
    if fmt == "md":
        print("| flag | now (from) | values (default) | environment | meaning |")
        print("|---|---|---|---|---|")
        for entry in entries:
            default = format_value(entry["name"], entry["default"])
            now = format_value(entry["name"], entry["value"])
            print(f"| `{entry['name']}` | {now} ({entry['source']}) | {entry['values']} ({default}) | "
                  f"`{entry['environment']}` | {entry['meaning']} |")
        return 0
    width = max(len(name) for name in SPECS) + 2
    pad = " " * width
    for entry in entries:
        name = entry["name"]
        now = format_value(name, entry["value"])
        print(f"{name:<{width}}{entry['values']}")
        print(f"{pad}default {format_value(name, entry['default'])} · {entry['environment']} · "
              f"now {now} ({entry['source']})")
        print(f"{pad}{entry['meaning']}")
    print(f"\nprecedence: {PRECEDENCE}; a bad --set or session value exits 2 naming the allowed values, a bad "
          "environment value warns and keeps the default")
    return 0
