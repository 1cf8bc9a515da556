"""A small input file read whole, in bounded time and memory: a regular file of at most `limit` bytes.

Opened without blocking, so a FIFO (which would wait for a writer forever) or a device (/dev/zero: endless) is
refused by what it is, before a byte is read; at most one byte past the limit is read, so an oversized file is
refused without being held. Knows nothing of what the bytes mean.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import UserError


def read_regular(path: str | os.PathLike, limit: int, where: str, fix: str) -> bytes:
    """The bytes of the regular file `path`; UserError `"{where}: ..."` naming the problem and `fix` for a file
    that is not regular (a device, a socket or a pipe) or holds more than `limit` bytes. OSError (a missing file
    included) is the caller's to phrase."""
    descriptor = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise UserError(f"{where}: not a regular file (a device, a socket or a pipe); {fix}")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{where}: more than {limit:,} bytes, more than this file may hold; {fix}")
    return data
