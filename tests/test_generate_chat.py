"""`flashgen generate --chat` on the CPU: the folder's chat template renders, and encodes, exactly as
transformers' `apply_chat_template` (a ChatML template as SmolLM2's, a Llama-3-style one with a BOS,
`tojson` and `trim`), with one BOS; a prompt file reaches the model byte for byte; a folder without a
template, or a template that fails, is one line."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from flashgen.cli import main

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
            "<|im_end|>"]
BOS = 97  # <|begin_of_text|>, after the 97 characters

# ChatML as SmolLM2 writes it (a default system turn where none is given), laid out over lines so that
# trim_blocks and lstrip_blocks decide the text
CHATML = """{% for message in messages %}
    {% if loop.first and messages[0]['role'] != 'system' %}
<|im_start|>system
You are a tiny assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# Llama-3's layout: the BOS from bos_token, headers, trimmed turns, a JSON line (transformers' tojson
# keeps "é <&>" as it is, jinja's own would escape it), raise_exception on a role it does not take
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Environment: " + {"date": date_string, "note": "é <&>"} | tojson + "\\n\\n" }}
{{- system }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception("after the system turn, roles are user and assistant") }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
EOT = {"__type": "AddedToken", "content": "<|eot_id|>", "special": True, "lstrip": False, "rstrip": False,
       "normalized": False, "single_word": False}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama whose tokenizer reads each printable ASCII character, "\n" and "é" as a token
    of its own, whitespace kept (so a final newline is a token), and the two templates' special tokens;
    its post-processor puts <|begin_of_text|> in front. (Within the 128 ids of test_generate_cli's model:
    the same kernels.)"""
    from tokenizers import Tokenizer, models, processors
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from generate_warm_start import tiny_folder
    folder = tiny_folder(tmp_path_factory.mktemp("chat-llama"))
    chars = [chr(c) for c in range(32, 127)] + ["\n", "é"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", BOS)])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _folder(base: Path, tmp_path: Path, config: dict, jinja: str | None = None) -> Path:
    """A copy of `base` with this tokenizer_config.json (and chat_template.jinja)."""
    import shutil
    m = tmp_path / "m"
    shutil.copytree(base, m)
    (m / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (m / "chat_template.jinja").write_text(jinja)
    return m


LAYOUTS = {  # where the template is: (tokenizer_config.json, chat_template.jinja)
    "chatml in tokenizer_config": ({"eos_token": "<|im_end|>", "chat_template": CHATML}, None),
    "llama3 in chat_template.jinja": ({"bos_token": "<|begin_of_text|>", "eos_token": EOT,
                                       "chat_template": "{{ raise_exception('the file wins') }}"}, LLAMA3),
    "llama3 as the default of named": ({"bos_token": "<|begin_of_text|>", "eos_token": EOT, "chat_template": [
        {"name": "tool_use", "template": "{{ raise_exception('not the default') }}"},
        {"name": "default", "template": LLAMA3}]}, None),
}


@pytest.fixture
def added(monkeypatch):
    """The prompt of every request `flashgen generate` adds to its engine."""
    from flashgen.runtime.decoder.engine import Engine
    seen, add = [], Engine.add

    def recorded(self, prompt, params):
        seen.append(prompt)
        return add(self, prompt, params)
    monkeypatch.setattr(Engine, "add", recorded)
    return seen


@pytest.mark.parametrize("system", [None, " Be  brief. "])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chat_prompt_is_what_transformers_renders_and_encodes(base, tmp_path, added, capsys, layout, system):
    """The text and the token ids `generate --chat` prompts with equal apply_chat_template's (add_generation_prompt):
    the template's own BOS once, not a second one from the tokenizer's post-processor."""
    from flashgen.runtime.checkpoints.chat_template import ChatTemplate, chat_messages
    m = _folder(base, tmp_path, *LAYOUTS[layout])
    user = "Say é <&> twice.\n"
    messages = chat_messages(user, system)
    hf = transformers.AutoTokenizer.from_pretrained(m)
    want_text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want_ids = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ChatTemplate.from_folder(m).render(messages) == want_text
    argv = ["generate", "--model", str(m), "--prompt", user, "--chat", "--max-new-tokens", "1"]
    assert main(argv + (["--system", system] if system is not None else [])) == 0, capsys.readouterr().err
    assert added == [want_ids]
    assert want_ids.count(BOS) == (0 if layout.startswith("chatml") else 1)


def test_prompt_file_is_byte_exact(base, tmp_path, added):
    """A prompt rendered by apply_chat_template and saved ends in the newline the answer starts after;
    --prompt-file dropped it, so the model wrote that newline first and its answer differed from
    transformers'."""
    m = _folder(base, tmp_path, *LAYOUTS["chatml in tokenizer_config"])
    hf = transformers.AutoTokenizer.from_pretrained(m)
    text = hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode())
    assert main(["generate", "--model", str(m), "--prompt-file", str(path), "--max-new-tokens", "1"]) == 0
    assert added == [hf(text)["input_ids"]] and added[0][-1] == hf.convert_tokens_to_ids("\n")


@pytest.mark.parametrize("config, jinja, flags, message", [
    ({}, None, [], "--chat: {m} has no chat template (no chat_template.jinja, no chat_template in "
                   "tokenizer_config.json); give the prompt as the model expects it, without --chat"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, None, [],
     '{m}/tokenizer_config.json: chat_template names no "default" template (it has tool_use)'),
    ({"chat_template": 7}, None, [], "{m}/tokenizer_config.json: chat_template must be a string or a list of "
                                     "{{name, template}} strings"),
    ({}, LLAMA3.replace("{%- endfor %}", ""), [], "{m}/chat_template.jinja: the chat template does not parse "
                                                   "(line 23: Unexpected end of template."),
    ({"chat_template": "{% if messages[0].role == 'system' %}{{ raise_exception('no system turn here') }}{% endif %}"},
     None, ["--system", "s"],
     "{m}/tokenizer_config.json: chat_template: the chat template failed: no system turn here"),
    ({"chat_template": "{{ messages[0].content.strip() }}{{ ''.__class__.__mro__ }}"}, None, [],
     "{m}/tokenizer_config.json: chat_template: the chat template failed: access to attribute '__class__' of 'str' "
     "object is unsafe."),
    ({"bos_token": 5, "chat_template": CHATML}, None, [],
     "{m}/tokenizer_config.json: bos_token must be a string or an object with a \"content\" string, got 5"),
])
def test_a_chat_that_cannot_render_is_one_line_before_the_weights_load(base, tmp_path, capsys, monkeypatch, config,
                                                                       jinja, flags, message):
    from flashgen.runtime.checkpoints import weights
    monkeypatch.setattr(weights, "load_weights", lambda *a, **k: pytest.fail("the weights were loaded"))
    m = _folder(base, tmp_path, config, jinja)
    assert main(["generate", "--model", str(m), "--prompt", "hi", "--chat", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flashgen: error: {message.format(m=m)}"), err


def test_system_goes_with_chat(base, capsys):
    assert main(["generate", "--model", str(base), "--prompt", "hi", "--system", "s"]) == 2
    assert capsys.readouterr().err == "flashgen: error: --system is the chat's system turn: give it with --chat\n"


def _json_run(folder: Path, capsys, *flags: str) -> dict:
    assert main(["generate", "--model", str(folder), "--prompt", "Hi", "--output", "json", *flags]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one object, nothing streamed before it
    return json.loads(out)


def test_output_json_and_the_line_after_the_text_say_how_it_ended(base, tmp_path, capsys, added):
    """--output json: the text, ids, stop reason, counts and timings as one object; the streamed text is
    followed on stderr by the same stop reason, count and rates (neither existed: a raw prompt that ended
    at EOS at once printed an empty line and nothing else)."""
    got = _json_run(base, capsys, "--max-new-tokens", "4")
    ids = got["token_ids"]
    assert (got["stop_reason"], got["stop_token_id"], got["generated_tokens"]) == ("length", None, 4)
    assert len(ids) == 4 and got["prompt_tokens"] == len(added[0]) == 3  # <|begin_of_text|> H i
    assert 0 < got["time_to_first_token_s"] <= got["total_s"]
    assert got["decode_tokens_per_s"] == pytest.approx(3 / (got["total_s"] - got["time_to_first_token_s"]))
    assert main(["generate", "--model", str(base), "--prompt", "Hi", "--max-new-tokens", "4"]) == 0
    streamed = capsys.readouterr()
    assert streamed.out == got["text"] + "\n"
    assert re.fullmatch(rf"loading {base} \(0\.\d\d GB as float32\) on cpu\.\.\.\n"  # (the status line first)
                        r"stopped at length \(max_new_tokens\) after 4 tokens; time to first token \d+\.\d{3} s, "
                        r"decode \d+\.\d tokens/s\n", streamed.err), streamed.err

    eos = ids[2]  # the model's EOS in generation_config.json: it stops where that token first comes
    m = _folder(base, tmp_path, {})
    (m / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    stopped = _json_run(m, capsys, "--max-new-tokens", "4")
    n = ids.index(eos) + 1
    assert (stopped["stop_reason"], stopped["stop_token_id"], stopped["token_ids"]) == ("eos", eos, ids[:n])
    assert main(["generate", "--model", str(m), "--prompt", "Hi", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().err.splitlines()[1].startswith(f"stopped at eos (token {eos}) after {n} tokens; ")


def test_eos_at_once_points_to_the_chat_template(base, tmp_path, capsys):
    """An instruct model given a raw prompt ends at once; where the folder has a chat template, the line
    after the (empty) text says --chat applies it, and with one new token there is no decode rate."""
    first = _json_run(base, capsys, "--max-new-tokens", "1")["token_ids"][0]
    m = _folder(base, tmp_path, {"chat_template": CHATML})
    (m / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    assert main(["generate", "--model", str(m), "--prompt", "Hi"]) == 0
    assert re.fullmatch(rf"stopped at eos \(token {first}\) after 1 tokens; time to first token \d+\.\d{{3}} s, no "
                        r"decode step; the folder has a chat template: --chat puts the prompt in it",
                        capsys.readouterr().err.splitlines()[1])


def test_another_stop_token_is_named_as_one():
    """A stop token a caller gives that is not the model's EOS (the engine takes any) is "stop"."""
    from flashgen.runtime.decoder.engine import Request
    from flashgen.runtime.decoder.outcome import Outcome
    from flashgen.runtime.decoder.sampling import SamplingParams
    req = Request(0, [1, 2], SamplingParams(max_new_tokens=8, stop_tokens=(5, 9)), output=[3, 5])
    o = Outcome.of(req, (9,), 0.5, 1.5)
    assert (o.reason, o.stop_token, o.decode_tokens_per_s) == ("stop", 5, 1.0)
    assert o.line() == "stopped at stop token 5 after 2 tokens; time to first token 0.500 s, decode 1.0 tokens/s"
    assert Outcome.of(Request(0, [1], req.params, output=[4, 9]), (9,), 0.5, 1.5).reason == "eos"
