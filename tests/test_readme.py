"""The documents against the code: the README's flags table is the registry's, its commands table names
every command, docs/ARCHITECTURE.md's "where each decision lives" names files and functions that exist,
and nothing in the docs cites a file outside the repository or a tracker's issue number."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from engine import flags
from inspector.commands import COMMAND_MODULES

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
             ROOT / "bench" / "RESULTS.md"]


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _table_rows(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[1:]]


def test_the_flags_table_is_the_registry():
    rows = _table_rows(_section((ROOT / "README.md").read_text(encoding="utf-8"), "Flags"))
    names = [row[0].strip("`") for row in rows]
    assert names == list(flags.SPECS), "README's flags table: one row per flag, in the registry's order"
    for row in rows:
        name, default = row[0].strip("`"), row[1].strip("`")
        assert default == flags.format_value(name, flags.SPECS[name].default), name


def test_the_commands_table_names_every_command():
    rows = _table_rows(_section((ROOT / "README.md").read_text(encoding="utf-8"), "Commands"))
    commands = {row[0].strip("`").split()[0] for row in rows}
    assert commands == {module.replace("_", "-") for module in COMMAND_MODULES}


def _defined(path: Path) -> set[str]:
    """Top-level functions, classes and constants of a module, and Class.method for methods."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
            names.update(f"{node.name}.{item.target.id}" for item in node.body  # dataclass fields
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(element, ast.Name):
                        names.add(element.id)
    return names


def test_every_decision_in_the_architecture_is_one_hop_away():
    """Each row of the table: `path`: `name`, ... where the file exists and defines each name (a method as
    Class.method, or a bare method name that some class in the file defines)."""
    rows = _table_rows(_section((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"),
                                "Where each decision lives"))
    assert len(rows) > 20
    checked = 0
    for row in rows:
        cell = row[1]
        places = list(re.finditer(r"`([\w/]+\.py)`:", cell))
        for place, following in zip(places, places[1:] + [None]):
            path_text = place.group(1)
            names_text = cell[place.end():following.start() if following else len(cell)]
            path = ROOT / path_text
            assert path.exists(), path_text
            defined = _defined(path)
            methods = {name.split(".", 1)[1] for name in defined if "." in name}
            for name in re.findall(r"`([\w.]+)`", names_text):
                if name.endswith(".py") or "/" in name:
                    continue
                assert name in defined or name in methods, f"{path_text}: {name}"
                checked += 1
    assert checked > 40


def test_the_documents_cite_nothing_outside_the_repository():
    outside = re.compile(r"DESIGN\.md|STYLE\.md|seeds/|\bissues? #?\d+|\blease\b|\blent (?:VM|GPU|machine)", re.I)
    for path in DOCUMENTS:
        found = outside.findall(path.read_text(encoding="utf-8"))
        assert not found, f"{path.relative_to(ROOT)}: {found}"


def test_the_demo_samples_are_what_generate_prints(capsys):
    """README's samples of the shipped demo showed `\\n` where generate prints `\\x0a`: each `$ moe-inspector
    generate --prompt ...` sample (the demo, no --model) is run and its `text:` line compared as printed."""
    import shlex

    from inspector.cli import main

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    samples = re.findall(r"^\$ moe-inspector (generate --prompt .*)\n(text: .*)$", text, re.M)
    assert len(samples) == 2
    for command, shown in samples:
        assert main(shlex.split(command) + ["--device", "cpu", "--no-progress"]) == 0
        printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("text: ")]
        assert printed == [shown], command
