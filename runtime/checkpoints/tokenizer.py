"""A model folder's tokenizer.json, loaded or refused in one line: unreadable, or holding ids the
model's embedding does not have (their logits do not exist, their embeddings would be read past it).

tokenizer_config.json's add_bos_token and add_eos_token, where it gives either, decide which special
tokens frame a prompt, as transformers reads them: they replace whatever template tokenizer.json's
post-processor holds (exactly one BOS, none, and likewise EOS). Without this, a folder whose
tokenizer.json adds no BOS while its config asks for one (or the reverse) would prompt the model
differently here than in transformers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import json_object

FLAGS = (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token"))  # (flag, the token it adds)


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
    _frame(tok, folder / "tokenizer_config.json")
    return tok


def _frame(tok: Any, path: Path) -> None:
    """Make `tok` add exactly the BOS and EOS that `path` asks for (module docstring); a file that sets
    neither flag leaves tokenizer.json's post-processor as it is."""
    from tokenizers import processors

    c = json_object(path)
    if all(c.get(flag) is None for flag, _ in FLAGS):
        return
    bos, eos = (_added(tok, c, flag, key, path) for flag, key in FLAGS)
    tok.post_processor = processors.TemplateProcessing(  # (named by key: a token's text may hold ':' or ' ')
        single=[t["id"] for t in bos] + ["$A"] + [t["id"] for t in eos], special_tokens=bos + eos)


def _added(tok: Any, c: dict, flag: str, key: str, path: Path) -> list[dict[str, Any]]:
    """The template's special token that `flag` adds, the one `key` names (a string, or an added-token
    object's content); none where the flag is false or absent."""
    on = c.get(flag)
    if on is not None and not isinstance(on, bool):
        raise FlashgenError(f"{path}: {flag} must be true or false, got {on!r}")
    if not on:
        return []
    value = c.get(key)
    token = value.get("content") if isinstance(value, dict) else value
    if not isinstance(token, str):
        raise FlashgenError(f"{path}: {flag} is true, but {key} names no token (got {value!r})")
    i = tok.token_to_id(token)
    if i is None:
        raise FlashgenError(f"{path}: {key} {token!r} is not a token of tokenizer.json")
    return [{"id": key, "ids": [i], "tokens": [token]}]
