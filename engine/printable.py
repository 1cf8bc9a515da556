"""Text from a file or a command line, made safe to print: control and format characters escaped,
length bounded.

A session name, a tensor name in a safetensors header or a results line can hold escape sequences
(`\\x1b[2J` clears the screen), bidirectional overrides, newlines that break a one-line message, or a
megabyte of text. `printable` turns each such character into its Python escape and cuts the text to
a length, so what reaches a terminal or a report is what the file says, readable, and one line.
Knows nothing of where the text goes.
"""

from __future__ import annotations

import unicodedata

from engine.errors import UserError

# Cc: C0/C1 controls (ESC, BEL, CR, NUL, DEL); Cf: format characters (bidi overrides, zero-width
# joiners); Cs: lone surrogates (from undecodable bytes); Zl/Zp: line and paragraph separators.
UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
DEFAULT_LIMIT = 200


def is_printable_char(character: str) -> bool:
    return unicodedata.category(character) not in UNPRINTABLE_CATEGORIES


def unprintable_characters(text: str, allowed: str = "") -> list[str]:
    """The distinct characters of `text` that `printable` would escape (minus `allowed`), in order."""
    seen: dict[str, None] = {}
    for character in text:
        if character not in allowed and not is_printable_char(character):
            seen.setdefault(character)
    return list(seen)


def escape_char(character: str) -> str:
    code = ord(character)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object, limit: int | None = DEFAULT_LIMIT) -> str:
    """`value` as text with every unprintable character escaped (`\\x1b`, `\\u202e`) and, past
    `limit` characters, cut with `…` and the full length. Printable text comes back unchanged."""
    text = value if isinstance(value, str) else str(value)
    cut = limit is not None and len(text) > limit
    shown = text[:limit] if cut else text
    if any(not is_printable_char(character) for character in shown):
        shown = "".join(character if is_printable_char(character) else escape_char(character) for character in shown)
    return shown + (f"… ({len(text)} characters)" if cut else "")


def require_text(text: str, what: str = "the prompt") -> str:
    """`text` when it is valid Unicode text, else UserError: a command-line argument with bytes that
    are not UTF-8 arrives holding lone surrogates (Python's surrogateescape), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        byte = ord(text[error.start]) - 0xDC00 if 0xDC80 <= ord(text[error.start]) <= 0xDCFF else None
        shown = f"the byte 0x{byte:02x}" if byte is not None else printable(text[error.start])
        raise UserError(f"{what} holds {shown} at character {error.start}, which is not UTF-8 text; pass the "
                        f"prompt as UTF-8 (check the terminal's or the file's encoding)") from None
    return text


def one_line(message: str) -> str:
    """A message for one terminal line: every unprintable character escaped, no length limit."""
    return printable(message, limit=None)


def path_error(error: OSError) -> str:
    """One line for an OSError about a path: the path (shortened, escaped) and the system's reason."""
    name = printable(str(error.filename), limit=120)
    reason = error.strerror or type(error).__name__
    return one_line(f"{name}: {reason.lower() if reason[:1].isupper() and reason[1:2].islower() else reason}; "
                    f"check the path")
