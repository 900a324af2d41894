"""A model folder's chat template, rendered as transformers' `apply_chat_template` renders it, so that an
instruct model is prompted here exactly as it was trained and as transformers would prompt it.

Where the template comes from, as transformers loads it: `chat_template.jinja` in the folder, else
tokenizer_config.json's `chat_template` (a string, or a list of {name, template} of which the one named
"default" is used). How it renders: jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`,
loop controls (`break`, `continue`), `{% generation %}` blocks rendered as their body, a `tojson` that
keeps non-ASCII and `<>&` as they are, `raise_exception(message)` and `strftime_now(format)`, and the
variables `messages`, `tools` and `documents` (None), `add_generation_prompt` and each special token the
tokenizer config names (`bos_token`, `eos_token`, ...; special_tokens_map.json fills those it lacks),
as text. The rendered text holds the template's own BOS where the model wants one, so it is encoded
without the tokenizer's special tokens (`add_special_tokens=False`, as transformers encodes it): a
second BOS would otherwise come in front.

A template that does not parse, or fails as it renders (its `raise_exception`, an undefined value
used), is one line naming its file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import json_object

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja text
    where: str  # the file (and key) it came from, for errors
    tokens: dict[str, str]  # the special tokens it is rendered with, by name

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        """The folder's template, or None where it has none (module docstring: where it comes from)."""
        config_path = folder / "tokenizer_config.json"
        config = json_object(config_path)
        tokens = _special_tokens(config, config_path, json_object(folder / "special_tokens_map.json"))
        path = folder / TEMPLATE_FILE
        if path.exists():
            return cls(_read(path), str(path), tokens)
        value = config.get("chat_template")
        if value is None:
            return None
        where = f"{config_path}: chat_template"
        if isinstance(value, str):
            return cls(value, where, tokens)
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)} \
            if isinstance(value, list) else {}
        if not named or len(named) != len(value) or not all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in named.items()):
            raise FlashgenError(f"{where} must be a string or a list of {{name, template}} strings")
        if "default" not in named:
            raise FlashgenError(f"{where} names no \"default\" template (it has {', '.join(sorted(named))})")
        return cls(named["default"], f"{where} \"default\"", tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it; with `add_generation_prompt`, ending where the
        assistant's answer begins."""
        import jinja2

        try:
            template = _environment().from_string(self.source)
            return template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.tokens)
        except jinja2.TemplateSyntaxError as e:
            raise FlashgenError(f"{self.where}: the chat template does not parse (line {e.lineno}: "
                                f"{_first_line(e)})") from None
        except jinja2.TemplateError as e:
            raise FlashgenError(f"{self.where}: the chat template failed: {_first_line(e)}") from None


def has_template(folder: Path) -> bool:
    """Whether the folder holds a chat template (not checked: `ChatTemplate.from_folder` does that)."""
    return (folder / TEMPLATE_FILE).exists() or "chat_template" in json_object(folder / "tokenizer_config.json")


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn, after a system turn where `system` is given."""
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]


def _first_line(e: Exception) -> str:
    text = str(getattr(e, "message", None) or e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FlashgenError(f"{path} is unreadable: {e}") from None


def _special_tokens(config: dict, path: Path, fallback: dict) -> dict[str, str]:
    """Each special token `config` names (a string, or an added-token object's content), else the one
    `fallback` names; None and absent ones are left out, as transformers leaves them."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key, fallback.get(key))
        token = value.get("content") if isinstance(value, dict) else value
        if value is None:
            continue
        if not isinstance(token, str):
            raise FlashgenError(f"{path}: {key} must be a string or an object with a \"content\" string, "
                                f"got {json.dumps(value)[:60]}")
        out[key] = token
    return out


def _environment() -> Any:
    """The sandboxed jinja2 environment chat templates are written for (module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
        generating from a prompt, it is its body."""
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` whose attributes cannot start with '_' (none of Python's internals)."""
        def __setitem__(self, name: str, value: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")
            super().__setitem__(name, value)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env
