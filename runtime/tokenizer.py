"""A model folder's tokenizer.json, loaded or refused in one line: unreadable, or holding ids the
model's embedding does not have (their logits do not exist, their embeddings would be read past it)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError


def load_tokenizer(folder: Path, vocab_size: int) -> Any:
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.exists():
        raise FlashgenError(f"{folder} has no tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exceptions)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashgenError(f"{path} is not a tokenizer file the tokenizers library reads: {first}") from None
    ids = tok.get_vocab(with_added_tokens=True)
    top = max(ids.values(), default=-1)
    if top >= vocab_size:
        name = next(t for t, i in ids.items() if i == top)
        raise FlashgenError(f"{path}: token {name!r} has id {top}, past the model's vocab_size of {vocab_size}")
    return tok
