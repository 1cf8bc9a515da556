"""Byte-level tokenizer for the `tiny` and `demo` presets: token id = byte value (0..255).

Knows nothing of models; decoding replaces invalid UTF-8 so a partial multi-byte character
streams as a replacement mark rather than an error.
"""

from __future__ import annotations

from engine.printable import require_text


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(require_text(text).encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_id for token_id in token_ids if 0 <= token_id < 256).decode("utf-8", errors="replace")
