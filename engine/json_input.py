"""JSON from files a user did not write: config.json, a safetensors header, an index, a calibration
file, a results line. One function, `parse_json`, that never raises anything but `UserError`.

What it refuses, each with one line naming the file: invalid UTF-8, text that is not JSON, nesting
deep enough to exhaust Python's recursion limit, integers of more than
`MAX_INT_DIGITS` digits (Python refuses to convert them, and no field this package reads is that
large), and NaN or infinite numbers (`NaN`, `Infinity`, `1e999`): every file this package writes
stores non-finite values as strings, so a non-finite number is a corrupt or hostile file. Deep
nesting is refused by the decoder itself at the interpreter's recursion limit (a RecursionError
raised at once, caught here); the values' types are the caller's to check. Knows nothing of what
the JSON means.
"""

from __future__ import annotations

import json
import math
import sys

from engine.errors import UserError

MAX_INT_DIGITS = 30  # 10**30 is past any count, offset or size this package reads


class _Refused(ValueError):
    pass


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is not finite")
    return value


def _constant(name: str):
    raise _Refused(f"{name} is not a number JSON allows")


def parse_json(data: bytes | str, where: str, what: str = "the file", fix: str = "") -> object:
    """The decoded value of `data`; UserError ("{where}: {what} is not valid JSON (why); {fix}") otherwise."""
    ending = f"; {fix}" if fix else ""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UserError(f"{where}: {what} is not UTF-8 text (byte {error.start}){ending}") from None
    try:
        return json.loads(data, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except _Refused as error:
        raise UserError(f"{where}: {what} is not valid JSON here ({error}){ending}") from None
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit, at once
        raise UserError(f"{where}: {what} nests arrays or objects deeper than Python's recursion limit "
                        f"({sys.getrecursionlimit()} levels){ending}") from None
    except ValueError as error:  # JSONDecodeError and int-conversion limits
        raise UserError(f"{where}: {what} is not valid JSON ({str(error)[:160]}){ending}") from None
