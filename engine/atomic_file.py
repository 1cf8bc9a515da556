"""Writing a file so that a crash, a kill or a full disk leaves either the old file or the new one
under its name, never a torn one, and no temporary file behind.

On Linux the bytes go to an unnamed file (`O_TMPFILE`) in the target's directory: until it is
linked, a kill frees it with nothing to clean up. It is fsynced, linked under a hidden temporary
name and renamed over the target (`os.replace`, atomic within one filesystem); only a kill in the
microseconds between the link and the rename can leave a named temporary, and the next write of
the same target removes such leftovers. Where `O_TMPFILE` is missing (other systems, some
filesystems) the bytes go to the hidden named temporary directly. Temporary names end in
`TEMP_SUFFIX`, which git ignores.

Knows nothing of what is written; callers check the path first (inspector.output_paths).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Callable

TEMP_SUFFIX = ".sessionresults.tmp"  # ignored by git, so a killed save leaves nothing to commit
# A named temporary of the same target older than this is a leftover of a killed write, not a
# write in progress (a write holds its name for microseconds, or for its whole length without O_TMPFILE).
STALE_AFTER_S = 60.0

# Tests set this to slow a write down between chunks (to kill the process mid-write).
after_chunk: Callable[[int], None] | None = None
_CHUNK = 64 * 1024


def _temporary_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def leftover_temporaries(path: str | os.PathLike) -> list[Path]:
    """Named temporaries a killed write of `path` may have left beside it."""
    path = Path(path)
    try:
        return sorted(path.parent.glob(f".{_glob_escape(path.name)}.*{TEMP_SUFFIX}"))
    except OSError:
        return []


def _glob_escape(name: str) -> str:
    return "".join(f"[{character}]" if character in "*?[" else character for character in name)


def _remove_stale(path: Path) -> None:
    now = time.time()
    for leftover in leftover_temporaries(path):
        try:
            if now - leftover.lstat().st_mtime > STALE_AFTER_S:
                leftover.unlink()
        except OSError:
            pass


def _write_all(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, max(len(data), 1), _CHUNK):
        chunk = view[offset:offset + _CHUNK]
        while chunk:
            written = os.write(descriptor, chunk)
            chunk = chunk[written:]
        if after_chunk is not None:
            after_chunk(offset)
    os.fsync(descriptor)


_unnamed_works = True  # False once linking an unnamed file failed in this process: write named from then on


def _link_unnamed(descriptor: int, name: Path) -> None:
    """Give the unnamed file `descriptor` the name `name`: linkat through /proc/self/fd, else
    linkat(AT_EMPTY_PATH) (some kernels refuse the /proc route with EXDEV). OSError if neither works."""
    try:
        os.link(f"/proc/self/fd/{descriptor}", name, follow_symlinks=True)
        return
    except OSError as error:
        first = error
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, at_empty_path = -100, 0x1000
    if libc.linkat(descriptor, b"", at_fdcwd, os.fsencode(name), at_empty_path) != 0:
        raise first


def _open_unnamed(directory: Path, mode: int) -> int | None:
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not _unnamed_works:
        return None
    try:
        return os.open(directory, flag | os.O_WRONLY, mode)
    except OSError:  # the filesystem does not support it (EOPNOTSUPP, EISDIR on old kernels)
        return None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (see the module docstring); raises OSError on failure, and
    then `path` is as it was and no temporary is left. A symbolic link is written through: the file it leads to is
    replaced (its temporary beside it) and the link is kept, as a user who linked a results file into a store
    expects."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    directory = path.parent
    existing_mode = None
    try:
        existing_mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        pass
    mode = 0o666 if existing_mode is None else existing_mode  # 0o666 is narrowed by the umask
    _remove_stale(path)
    temporary = _temporary_name(path)
    global _unnamed_works
    descriptor = _open_unnamed(directory, mode)
    named = descriptor is None
    if named:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    linked = named
    try:
        try:
            _write_all(descriptor, data)
            if existing_mode is not None:
                os.fchmod(descriptor, existing_mode)
            if not named:
                try:
                    _link_unnamed(descriptor, temporary)
                except OSError:
                    _unnamed_works = False
                    os.close(descriptor)
                    descriptor = -1
                    atomic_write_bytes(path, data)  # named, this time
                    return
                linked = True
        finally:
            if descriptor >= 0:
                os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        if linked:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        raise
    try:  # make the rename itself durable; not every platform lets a directory be opened
        directory_descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory_descriptor)
    except OSError:
        pass
    finally:
        os.close(directory_descriptor)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
