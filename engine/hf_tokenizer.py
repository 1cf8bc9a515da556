"""A Hugging Face `tokenizer.json`, read through the `tokenizers` library, with `ByteTokenizer`'s
interface (`encode`, `decode`, `vocab_size`), for checkpoints loaded by engine.hf_loader.

`tokenizers` is imported only here, and only when a checkpoint directory is loaded: the presets
never need it (install it with the `hf` extra). Knows nothing of models or chat templates: a prompt
is encoded as plain text, with the special tokens the file's post-processor adds (as
`tokenizer(text)` does in transformers).
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import UserError
from engine.printable import require_text


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"{path}: reading tokenizer.json needs the `tokenizers` package: "
                            f"pip install 'moe-inspector[hf]' (or pip install tokenizers)") from None
        if path.exists():  # a link out of the checkpoint (to /etc/passwd, another model) is not opened
            from engine.checkpoint import require_inside

            require_inside(path.parent, path, "tokenizer.json")
        if not path.is_file():
            raise UserError(f"{path}: missing: a checkpoint directory needs its tokenizer.json (the fast-tokenizer "
                            f"file); save it beside config.json, e.g. with "
                            f"AutoTokenizer.from_pretrained(...).save_pretrained(directory)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
            raise UserError(f"{path}: not a tokenizer.json the tokenizers library can read "
                            f"({str(error).splitlines()[0][:200]}); download it again") from None
        self.path = path

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(require_text(text), add_special_tokens=True).ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of the ids, special tokens included (the inspector shows what the model emitted). An id
        the tokenizer does not know (a model's vocabulary is often padded past the tokenizer's) is
        shown as `<id N>` rather than dropped, as `tokenizers` would drop it silently."""
        pieces, run = [], []
        for token_id in token_ids:
            if self._tokenizer.id_to_token(token_id) is None:
                if run:
                    pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(f"<id {token_id}>")
            else:
                run.append(token_id)
        if run:
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return "".join(pieces)
