"""A model folder's chat template, rendered as transformers renders it: a conversation as the one prompt
text the model was tuned on.

The template is the folder's chat_template.jinja, else tokenizer_config.json's `chat_template` (a
string, or a list of named templates of which "default" is taken). It runs in jinja2's immutable
sandbox with trimmed blocks and loop controls, `tojson` keeping non-ASCII text, `raise_exception` and
`strftime_now`, and the config's special tokens (bos_token, eos_token, ...) as variables, as
transformers gives them. The rendered text already holds the special tokens the template writes, so it
is tokenized without adding any (`add_special_tokens=False`).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError, one_line
from flashgen.runtime.checkpoints.model_config import json_object

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def tokenizer_config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json with the template of chat_template.jinja, where the folder has one, in its
    `chat_template`: what `render_chat` takes."""
    config = json_object(folder / "tokenizer_config.json")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            config = {**config, "chat_template": jinja.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as e:
            raise FlashgenError(f"{jinja} is unreadable: {e}") from None
    return config


def template_of(config: dict[str, Any]) -> str:
    """The config's chat template, or one line saying the model has none."""
    t = config.get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    if not isinstance(t, str) or not t.strip():
        raise FlashgenError("the model folder has no chat template (chat_template.jinja, or tokenizer_config.json's "
                            "chat_template): give it a plain prompt instead")
    return t


def _raise(message: str) -> None:
    raise FlashgenError(f"the chat template refused the conversation: {message}")


@lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise FlashgenError(f"the chat template does not parse: {one_line(e)}") from None


def render_chat(source: Path | dict[str, Any], messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> str:
    """`messages` ({"role", "content"} each) as the prompt text of the chat template of `source`: a
    model folder, or its tokenizer config as `tokenizer_config` reads it; with `add_generation_prompt`,
    ending where the assistant's answer begins."""
    config = tokenizer_config(source) if isinstance(source, Path) else source
    tokens = {k: v.get("content") if isinstance(v, dict) else v for k in SPECIAL if (v := config.get(k)) is not None}
    try:
        return _compiled(template_of(config)).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                     **tokens)
    except FlashgenError:
        raise
    except Exception as e:  # noqa: BLE001 (a template's own bug: jinja2 errors, or a Python one inside it)
        raise FlashgenError(f"the chat template failed: {one_line(e)}") from None
