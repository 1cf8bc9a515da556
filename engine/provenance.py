"""Which commit produced a result: MOEI_COMMIT when set (a copy of the tree without git history,
as a GPU machine may get it), else `git rev-parse HEAD` with a dirty marker. One place for every
results file, table footer and calibration entry."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]


def _git(*arguments: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPOSITORY), *arguments], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def commit_and_dirty() -> tuple[str | None, bool]:
    """(commit, has uncommitted changes to tracked files); (None, False) when unknown."""
    explicit = os.environ.get("MOEI_COMMIT", "").strip()
    if explicit:
        return explicit, False
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, False
    return commit, bool(_git("status", "--porcelain", "--untracked-files=no"))


def commit_label() -> str:
    """For footers: the commit, '+dirty' when tracked files differ from it, or 'unknown'."""
    commit, dirty = commit_and_dirty()
    return "unknown (set MOEI_COMMIT)" if commit is None else commit + ("+dirty" if dirty else "")
