"""A prompt read from a file (`--prompt-file`, and the TUI's prompt loader): the file's text exactly,
newlines and final newline included, or one line saying why not.

Bounded: a file over MAX_BYTES is refused before it is read whole (a prompt longer than any
context is an error anyway, and the message says so sooner). Knows nothing of tokenizers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.bounded_read import read_regular
from engine.errors import UserError

MAX_BYTES = 8 * 1024 * 1024  # far above any context this tool runs (4096 byte tokens on demo), far below RAM


def read_prompt_file(path: str, option: str = "--prompt-file") -> str:
    """The text of `path` ("-": standard input), decoded as UTF-8; UserError for a missing, unreadable,
    oversized, empty or non-UTF-8 file."""
    where = f"{option} {path}"
    if path == "-":
        data = sys.stdin.buffer.read(MAX_BYTES + 1)
        where = f"{option} - (standard input)"
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            raise UserError(f"{where}: is a directory; name the text file that holds the prompt")
        try:
            size = file.stat().st_size
            if size > MAX_BYTES and file.is_file():
                raise UserError(f"{where}: {size:,} bytes, more than the {MAX_BYTES:,} a prompt file may hold; "
                                "give a shorter file")
            data = read_regular(file, MAX_BYTES, where, "give a text file, or pipe the prompt to --prompt-file -")
        except FileNotFoundError:
            raise UserError(f"{where}: no such file; check the path (relative to {os.getcwd()})") from None
        except OSError as error:
            raise UserError(f"{where}: cannot read it ({error.strerror}); check its permissions") from None
    if len(data) > MAX_BYTES:
        raise UserError(f"{where}: more than the {MAX_BYTES:,} bytes a prompt file may hold; give a shorter file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where}: not UTF-8 text (byte {error.start} is 0x{data[error.start]:02x}); save it as "
                        "UTF-8") from None
    if not text:
        raise UserError(f"{where}: the file is empty; put the prompt in it")
    return text
