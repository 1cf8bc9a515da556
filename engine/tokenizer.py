"""Byte-level tokenizer for the `tiny` and `demo` presets: token id = byte value (0..255).

Knows nothing of models; decoding writes each byte that is not part of valid UTF-8 as `\\xNN`, as the TUI's
panes show it (a random model's bytes are mostly such), rather than as an error or a U+FFFD that hides the byte.
"""

from __future__ import annotations

from engine.printable import require_text


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(require_text(text).encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(token_id for token_id in token_ids if 0 <= token_id < 256)
        return data.decode("utf-8", errors="backslashreplace")
