"""An A/B of one workload under two sides, interleaved in rounds in separate processes.

A side is a source tree of this project (the tree this module runs from, a directory, or a git revision
unpacked with `git archive` into a temporary directory) and a set of flag values. Each side runs in its own
process started in its own checkout (`python -c` with that checkout first on sys.path; `fresh=True`:
`python -m inspector ...` anew for every run), driving the side's own CLI (`bench --format json`,
`sweep --json`, `run SESSION`): the side's code measures, this module only reads what it printed, so an
older revision works as long as its CLI prints the same JSON.

Rounds: after `warmup` discarded runs per side, round r runs A then B when r is even and B then A when it
is odd (A B, B A, A B, ...), on the same device, one run at a time. A side that fails (a revision that does
not build, a workload it cannot run) stops the A/B: the report keeps every round measured so far, both
sides', and names the side and its one-line error.

Knows nothing of argument parsing or output formats (inspector.commands.ab, engine.ab_report).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engine import ab_rows, ab_stats
from engine.errors import UserError
from engine.limits import MAX_AB_ROUNDS, MAX_AB_WARMUP, require_at_most

REPOSITORY = Path(__file__).resolve().parents[1]
SCHEMA = 1
MARK = "\x1eMOEI-AB "  # prefixes the worker's protocol lines: a kernel compiler writing to fd 1 cannot forge one
START_TIMEOUT_S = 300.0  # importing torch and the side's CLI; a cold Triton cache compiles later, inside runs

# The worker: stdlib only until it imports the side's CLI from its own checkout (the current directory). Each
# request is one argv; the CLI's stdout and stderr are captured and sent back with its exit code.
WORKER = r"""
import contextlib, io, json, os, sys, traceback
sys.path.insert(0, os.getcwd())
MARK, out = %r, sys.stdout
def send(payload):
    out.write(MARK + json.dumps(payload) + "\n")
    out.flush()
try:
    from inspector.cli import main
except BaseException as error:
    send({"ready": False, "error": (type(error).__name__ + ": " + str(error)).splitlines()[0][:300]})
    sys.exit(3)
send({"ready": True})
for line in sys.stdin:
    argv = json.loads(line)["argv"]
    captured, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(errors):
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 2
        except BaseException:
            code = 3
            errors.write(traceback.format_exc())
    send({"rc": code, "stdout": captured.getvalue(), "stderr": errors.getvalue()[-6000:]})
""" % MARK


class SideFailed(Exception):
    """A side could not start or a run of it failed; `line` is the one line to print."""

    def __init__(self, side: str, line: str) -> None:
        super().__init__(f"side {side}: {line}")
        self.side, self.line = side, line


# --------------------------------------------------------------------------------------------------
# Sides and their source trees
# --------------------------------------------------------------------------------------------------

def _git(repository: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repository), *arguments], capture_output=True, text=True, timeout=60)


@dataclass
class Tree:
    """A checkout a side runs from: `path`, and what identifies its code (`identity`: a commit for a clean
    checkout or a revision, else the path itself) and for people (`label`)."""

    path: Path
    identity: str
    label: str
    temporary: Path | None = None  # a directory this A/B made and removes

    def cleanup(self) -> None:
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)
            self.temporary = None


def current_tree() -> Tree:
    return tree_at(REPOSITORY, "this tree")


def tree_at(path: str | os.PathLike, label: str | None = None, option: str = "--a-tree/--b-tree") -> Tree:
    """A directory holding a checkout of this project (its `inspector/cli.py`), used as it is; `option` names
    the option that gave it in a refusal. A blank path is refused (Path("") is the current directory)."""
    if not str(path).strip():
        raise UserError(f"{option} {str(path)!r}: an empty path; give the root of a source tree, or drop {option} "
                        "to run this tree")
    where = Path(path).expanduser().resolve()
    if not (where / "inspector" / "cli.py").is_file():
        raise UserError(f"{option} {path}: not a checkout of moe-inspector (no inspector/cli.py there); "
                        "give the root of a source tree")
    identity = str(where)
    try:
        head = _git(where, "rev-parse", "HEAD")
        if head.returncode == 0 and _git(where, "rev-parse", "--show-toplevel").stdout.strip() == str(where):
            dirty = _git(where, "status", "--porcelain", "--untracked-files=no").stdout.strip()
            identity = str(where) if dirty else head.stdout.strip()
            label = f"{label or where} ({head.stdout.strip()[:10]}{'+dirty' if dirty else ''})"
    except (OSError, subprocess.SubprocessError):
        pass
    return Tree(where, identity, label or str(where))


def tree_of_revision(revision: str, repository: Path = REPOSITORY, option: str = "--a-rev/--b-rev") -> Tree:
    """The tree of `revision` in `repository`, unpacked with `git archive` into a temporary directory; `option`
    names the option that gave it in a refusal."""
    if not revision.strip():  # git would read "^{commit}" as HEAD's
        raise UserError(f"{option} {revision!r}: an empty revision; give a commit, branch or tag of this repository, "
                        f"or drop {option} to run this tree")
    try:
        found = _git(repository, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except (OSError, subprocess.SubprocessError) as error:
        raise UserError(f"{option} {revision}: git could not run here ({error}); give a tree PATH instead") from None
    if found.returncode != 0 or not found.stdout.strip():
        raise UserError(f"{option} {revision!r}: no such revision in {repository} (git rev-parse found none); "
                        "give a commit, branch or tag of this repository")
    commit = found.stdout.strip()
    directory = Path(tempfile.mkdtemp(prefix=f"moei-ab-{commit[:10]}-"))
    archive = directory / "tree.tar"
    with open(archive, "wb") as handle:
        done = subprocess.run(["git", "-C", str(repository), "archive", "--format=tar", commit], stdout=handle,
                              stderr=subprocess.PIPE, timeout=300)
    if done.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise UserError(f"{option} {revision}: git archive failed: {done.stderr.decode(errors='replace')[:200]}")
    root = directory / "tree"
    with tarfile.open(archive) as bundle:
        try:
            bundle.extractall(root, filter="data")
        except TypeError:  # a Python without extraction filters; git's own archive holds no hostile paths
            bundle.extractall(root)
    archive.unlink()
    return Tree(root, commit, f"{revision} ({commit[:10]})", temporary=directory)


@dataclass
class Side:
    name: str  # "A" or "B"
    tree: Tree
    overrides: dict  # flag values this side sets beyond the common ones (validated)
    flags: dict  # every flag's resolved value on this side (as this tree's registry resolves them)
    assignments: list[str] = field(default_factory=list)  # the `--set FLAG=VALUE` this side's runs pass

    def to_json(self) -> dict:
        return {"name": self.name, "tree": self.tree.label, "code": self.tree.identity, "path": str(self.tree.path),
                "overrides": self.overrides, "flags": self.flags, "set": self.assignments}


def side_flag_values(side: Side) -> dict:
    """The flag values a side's runs set (`assignments`: both sides' --set and its own), as resolved values: a
    session's copy holds them in its [flags], where the common --set would otherwise be lost."""
    names = [assignment.partition("=")[0].strip() for assignment in side.assignments]
    return {name: side.flags[name] for name in names}


def same_sides(a: Side, b: Side) -> bool:
    return a.tree.identity == b.tree.identity and a.flags == b.flags


# --------------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------------

class Worker:
    """One long-lived process of a side, started in its checkout, running one CLI argv per request."""

    def __init__(self, side: Side, python: str = sys.executable) -> None:
        self.side = side
        environment = dict(os.environ)
        environment.pop("PYTHONPATH", None)  # the side's checkout, not this one, comes first
        self.process = subprocess.Popen([python, "-c", WORKER], cwd=side.tree.path, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=environment, bufsize=1)
        self.ready = False  # its hello is read at its first run: both sides' processes start at once

    def _wait_ready(self) -> None:
        hello = self._receive(START_TIMEOUT_S)
        if not hello.get("ready"):
            raise SideFailed(self.side.name, f"{self.side.tree.label} does not start: {hello.get('error', 'no answer')}")
        self.ready = True

    def _receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        stdout = self.process.stdout
        while True:
            line = stdout.readline()
            if not line:
                error = (self.process.stderr.read() or "").strip().splitlines()
                self.process.wait(timeout=10)
                raise SideFailed(self.side.name, f"{self.side.tree.label}: its process exited "
                                 f"({self.process.returncode}): {error[-1][:300] if error else 'no message'}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            if time.monotonic() > deadline:
                raise SideFailed(self.side.name, f"{self.side.tree.label}: no answer in {timeout:.0f} s")

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        if not self.ready:
            self._wait_ready()
        self.process.stdin.write(json.dumps({"argv": argv}) + "\n")
        self.process.stdin.flush()
        answer = self._receive(float("inf"))
        return answer["rc"], answer["stdout"], answer["stderr"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class FreshProcesses:
    """`python -m inspector ARGV` in the side's checkout, a new process for every run."""

    def __init__(self, side: Side, python: str = sys.executable) -> None:
        self.side, self.python = side, python

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        environment = dict(os.environ)
        environment.pop("PYTHONPATH", None)
        done = subprocess.run([self.python, "-m", "inspector", *argv], cwd=self.side.tree.path, capture_output=True,
                              text=True, env=environment)
        return done.returncode, done.stdout, done.stderr

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# Workloads: the argv a side runs and the samples its output holds
# --------------------------------------------------------------------------------------------------

@dataclass
class Workload:
    """What each run of a side executes. kind: bench, sweep or session; `argv(side, scratch)` the side's
    CLI call; `samples(side, rc, stdout, scratch)` its rows."""

    kind: str
    describe: str
    arguments: list[str]  # the workload's own options, the same on both sides
    clock: str = "device"
    session: Path | None = None
    arms_by_tokens: dict = field(default_factory=dict)  # sweep: side name -> {n: arm}

    def argv(self, side: Side, scratch: Path) -> list[str]:
        sets = [item for assignment in side.assignments for item in ("--set", assignment)]
        if self.kind == "bench":
            return ["bench", "--format", "json", *self.arguments, *sets]
        if self.kind == "sweep":
            arms = self.arms_by_tokens.get(side.name)
            chosen = ["--arms", ",".join(sorted(set(arms.values())))] if arms else []
            tile_m = ["--tile-m", str(side.flags["tile_m"])] if "tile_m" in side.flags else []
            # its own calibration file: an A/B never rewrites the one `moe_gate=measured` reads
            return ["sweep", "--json", *self.arguments, *chosen, *tile_m,
                    "--calibration", str(scratch / f"calibration-{side.name}.json")]
        session = scratch / f"session-{side.name}.toml"
        return ["run", str(session), "--results", str(scratch / f"results-{side.name}.jsonl"),
                "--report", str(scratch / f"report-{side.name}.md"), *self.arguments]

    def samples(self, side: Side, stdout: str, scratch: Path) -> dict[str, ab_rows.Sample]:
        if self.kind == "session":
            lines = [json.loads(line) for line in (scratch / f"results-{side.name}.jsonl").read_text().splitlines()
                     if line.strip()]
            return ab_rows.session_samples([line for line in lines if line.get("kind") == "step"])
        payload = _json_in(stdout)
        if self.kind == "bench":
            return ab_rows.bench_samples(payload, self.clock)
        return ab_rows.sweep_samples(payload, self.arms_by_tokens.get(side.name))


def _json_in(stdout: str) -> dict:
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON object in its output")
    return json.loads(stdout[start:])


def session_copy(session: Path, flags: dict, target: Path) -> None:
    """`session` with `flags` set in its [flags] table, written to `target` (tomllib in, tomli_w out), its relative
    paths made absolute: the copy runs from a scratch directory, each side from its own tree."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    import tomli_w

    try:
        document = tomllib.loads(session.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise UserError(f"--session {session}: cannot read it as TOML ({error}); check the file") from None
    document.setdefault("flags", {}).update(flags)
    _absolute_paths(document, session.resolve().parent)
    target.write_text(tomli_w.dumps(document), encoding="utf-8")


# The session keys that name a path, taken from the session file's directory (inspector.session_steps,
# inspector.session_routing): the copy lives in a scratch directory, so they are written out in full.
SESSION_PATH_KEYS = ("b_model", "original", "routing")


def _absolute_paths(document: dict, directory: Path) -> None:
    """Rewrite `document`'s relative model and file paths against `directory` (presets and `source` kept)."""
    from engine.config import PRESETS

    def absolute(value):
        if not isinstance(value, str) or value in PRESETS or value == "source" or not value.strip():
            return value
        path = Path(value).expanduser()
        return value if path.is_absolute() else str(directory / path)

    engine = document.get("engine")
    if isinstance(engine, dict) and "model" in engine:
        engine["model"] = absolute(engine["model"])
    steps = document.get("step")
    for step in steps if isinstance(steps, list) else []:
        for key in SESSION_PATH_KEYS:
            if isinstance(step, dict) and key in step:
                step[key] = absolute(step[key])


# --------------------------------------------------------------------------------------------------
# The rounds
# --------------------------------------------------------------------------------------------------

def round_order(index: int) -> tuple[str, str]:
    """A B in even rounds, B A in odd ones."""
    return ("A", "B") if index % 2 == 0 else ("B", "A")


@dataclass
class Outcome:
    sides: dict[str, Side]
    workload: Workload
    rule: ab_stats.Rule
    rounds_asked: int
    warmup: int
    runs: list[dict] = field(default_factory=list)  # every timed run: round, side, seconds, samples
    failure: dict | None = None  # {"side", "line"}
    started_at: str = ""
    seconds: float = 0.0
    allow_different_tokens: bool = False
    mode: str = "one process per side"

    def rows(self) -> list[dict]:
        """Every row's comparison over the rounds both sides completed, or its refusal."""
        complete = sorted({run["round"] for run in self.runs if run["side"] == "A"}
                          & {run["round"] for run in self.runs if run["side"] == "B"})
        by = {(run["round"], run["side"]): run["samples"] for run in self.runs}
        names = list(dict.fromkeys(name for run in self.runs for name in run["samples"]))
        claims = {name: ab_rows.claimed_arms(side.flags) for name, side in self.sides.items()}
        if self.workload.kind == "sweep":  # a sweep row claims the arm this side asked for at its n
            claims = {name: {"moe": None, "attention": None} for name in self.sides}
        rows = []
        for name in names:
            a = [by[(index, "A")].get(name) for index in complete]
            b = [by[(index, "B")].get(name) for index in complete]
            entry: dict = {"row": name, "rounds": len(complete)}
            present = [sample for sample in (*a, *b) if sample is not None] or \
                [run["samples"][name] for run in self.runs if name in run["samples"]]
            entry["unit"] = present[0].unit if present else ""
            entry["state"] = present[0].state if present else ""
            entry["arms"] = {side: _arm_summary(samples) for side, samples in (("A", a), ("B", b))}
            entry["notes"] = sorted({note for sample in present for note in sample.notes})
            if self.mode == "one process per side" and any(note.startswith(ab_rows.HOST_BOUND_NOTE)
                                                           for note in entry["notes"]):
                entry["notes"].append("a host-bound side's speed varies between processes and this A/B ran one "
                                      "process per side: --fresh runs each round in a fresh process")
            if not complete:
                entry.update(refused="no round completed on both sides", verdict=None)
                entry["values"] = {side: [run["samples"][name].value for run in self.runs
                                          if run["side"] == side and name in run["samples"]] for side in ("A", "B")}
                rows.append(entry)
                continue
            why, notes = ab_rows.refusal(name, a, b, claims["A"], claims["B"], self.allow_different_tokens)
            entry["notes"] += notes
            entry["values"] = {"A": [s.value if s else None for s in a], "B": [s.value if s else None for s in b]}
            if why:
                entry.update(refused=why, verdict=None)
            else:
                entry.update(refused=None, **ab_stats.compare([s.value for s in a], [s.value for s in b],
                                                              self.rule).to_json())
            rows.append(entry)
        return rows

    def to_json(self) -> dict:
        return {"kind": "ab", "schema": SCHEMA, "started_at": self.started_at, "seconds": round(self.seconds, 1),
                "workload": {"kind": self.workload.kind, "describe": self.workload.describe,
                             "arguments": self.workload.arguments, "clock": self.workload.clock},
                "sides": {name: side.to_json() for name, side in self.sides.items()},
                "rounds_asked": self.rounds_asked, "warmup": self.warmup, "processes": self.mode,
                "order": [list(round_order(index)) for index in range(self.rounds_asked)],
                "rule": self.rule.to_json(), "allow_different_tokens": self.allow_different_tokens,
                "runs": [{"round": run["round"], "side": run["side"], "seconds": run["seconds"]} for run in self.runs],
                "rows": self.rows(), "failure": self.failure}


def _arm_summary(samples: list) -> dict:
    total: dict = {}
    for sample in samples:
        if sample is None:
            continue
        for arm, count in sample.arms.items():
            total[arm] = total.get(arm, 0) + count
    return {arm: count for arm, count in total.items() if count}


Launcher = Callable[[Side], object]  # -> an object with run(argv) -> (rc, stdout, stderr) and close()


def run_ab(sides: dict[str, Side], workload: Workload, rounds: int, warmup: int = 1,
           rule: ab_stats.Rule = ab_stats.Rule(), launcher: Launcher | None = None, fresh: bool = False,
           allow_different_tokens: bool = False, progress: Callable[[str], None] | None = None) -> Outcome:
    """Every round (after `warmup` discarded runs per side); stops at the first side that fails, keeping what
    was measured. Both sides' processes start at once; a side that does not start fails at its first run, so
    the other side's runs before it stay in the report."""
    import datetime

    if rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {rounds}")
    require_at_most(rounds, MAX_AB_ROUNDS, "--rounds", "timed rounds, each running both sides once; the default is 8")
    if warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    require_at_most(warmup, MAX_AB_WARMUP, "--warmup", "discarded runs per side; the default is 1")
    if same_sides(sides["A"], sides["B"]):
        raise UserError("the two sides are the same (same code, same flag values): nothing to compare; change "
                        "--a/--b, or give --a-tree/--a-rev/--b-tree/--b-rev of different code")
    launcher = launcher or (FreshProcesses if fresh else Worker)
    outcome = Outcome(sides, workload, rule, rounds, warmup, allow_different_tokens=allow_different_tokens,
                      mode="a fresh process per run" if fresh else "one process per side",
                      started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    began = time.perf_counter()
    processes: dict[str, object] = {}
    scratch = Path(tempfile.mkdtemp(prefix="moei-ab-run-"))
    try:
        for name, side in sides.items():
            if workload.kind == "session":
                session_copy(workload.session, side_flag_values(side), scratch / f"session-{name}.toml")

        failed_start: dict[str, SideFailed] = {}
        for name, side in sides.items():  # every side's process starts now (their imports overlap) ...
            try:
                processes[name] = launcher(side)
            except SideFailed as failure:  # ... and a side that cannot start fails at its first run, in order
                failed_start[name] = failure

        def one_run(name: str) -> tuple[dict, float]:
            side = sides[name]
            if name in failed_start:
                raise failed_start[name]
            started = time.perf_counter()
            code, stdout, stderr = processes[name].run(workload.argv(side, scratch))
            seconds = time.perf_counter() - started
            if code != 0:
                raise SideFailed(name, f"{side.tree.label}: `{workload.kind}` exited {code}: {_last_line(stderr, stdout)}")
            try:
                samples = workload.samples(side, stdout, scratch)
            except (ValueError, KeyError, OSError, TypeError) as error:
                raise SideFailed(name, f"{side.tree.label}: its `{workload.kind}` output is not the JSON this A/B "
                                       f"reads ({type(error).__name__}: {error})") from None
            return samples, seconds

        try:
            for index in range(warmup):
                for name in round_order(index):
                    one_run(name)
                    if progress is not None:
                        progress(f"warm-up {index + 1} {name}")
            for index in range(rounds):
                for name in round_order(index):
                    samples, seconds = one_run(name)
                    outcome.runs.append({"round": index, "side": name, "seconds": round(seconds, 2),
                                         "samples": samples})
                    if progress is not None:
                        progress(f"round {index + 1} {name}")
        except SideFailed as failure:
            outcome.failure = {"side": failure.side, "line": failure.line}
    finally:
        for process in processes.values():
            process.close()
        shutil.rmtree(scratch, ignore_errors=True)
        outcome.seconds = time.perf_counter() - began
    return outcome


def _last_line(stderr: str, stdout: str) -> str:
    for text in (stderr, stdout):
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if lines:
            return lines[-1][:300]
    return "no message"
