"""Terminal input that is not UTF-8 becomes U+FFFD instead of ending the TUI.

Textual's Linux driver decodes stdin with a strict UTF-8 decoder in its input thread: one byte
that is not UTF-8 (a paste from a Latin-1 file, a stray \\xff) raises UnicodeDecodeError there,
the input thread dies and the app exits with code 0, losing the session in progress. The driver
asks `codecs.getincrementaldecoder` for its decoder by name, through its module's own binding;
`tolerate_invalid_utf8` rebinds that name to one whose UTF-8 decoder replaces invalid bytes
(errors="replace"), so the byte arrives as the replacement character, visible in the prompt.
Other encodings are untouched. Idempotent; a no-op where the driver is absent or laid out
differently (the TUI then behaves as textual does).
"""

from __future__ import annotations

import codecs
import functools


def _replacing_decoder(encoding: str):
    factory = codecs.getincrementaldecoder(encoding)
    if codecs.lookup(encoding).name == "utf-8":
        return functools.partial(factory, errors="replace")
    return factory


def tolerate_invalid_utf8() -> bool:
    """Install the tolerant decoder into textual's Linux driver; True when it was (or already is)."""
    try:
        from textual.drivers import linux_driver
    except ImportError:
        return False
    if getattr(linux_driver, "getincrementaldecoder", None) is _replacing_decoder:
        return True
    if not hasattr(linux_driver, "getincrementaldecoder"):
        return False
    linux_driver.getincrementaldecoder = _replacing_decoder
    return True
