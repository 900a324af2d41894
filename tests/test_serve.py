"""`flashgen serve` on the CPU, on loopback, driven by the official openai client: completions and chat,
whole and streamed, give `generate`'s greedy text; 32 concurrent streams are batched together and each
equals its prompt's text alone; a client leaving mid-stream aborts its request and the others go on;
malformed requests are 400s (429 past the queue) with OpenAI's error body, and the server serves on;
no KV cache block is left held. Text arrives in whole characters and stops at a stop string."""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flashgen.runtime.checkpoints.chat_template import ChatTemplate
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.checkpoints.tokenizer import load_tokenizer
from flashgen.runtime.decoder.loading import load_engine
from flashgen.runtime.decoder.sampling import SamplingParams
from flashgen.runtime.server.detokenize import TextStream
from flashgen.runtime.server.main import listen, service

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("transformers")

NAME = "tiny"
BLOCKS = 96
NEW = 5
TEMPLATE = ("{% for m in messages %}w{{ 10 + loop.index }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w99{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny Llama of test_generate_cli (words w0..w127 are tokens 0..127), with a chat template."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from generate_warm_start import tiny_folder
    path = tiny_folder(tmp_path_factory.mktemp("tiny-serve"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


@contextmanager
def running(svc) -> Iterator[str]:
    """`svc`'s routes served by uvicorn in a thread of this process, on a free loopback port: its URL."""
    from flashgen.runtime.server.app import create_app

    sock = listen("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join()
        svc.loop.stop()


@pytest.fixture(scope="module")
def server(folder):
    """The server in a thread of this process (its engine built as `generate` builds it), on a free port."""
    config = ModelConfig.from_folder(folder)
    svc = service(load_engine(folder, config, torch.device("cpu"), BLOCKS, 16), load_tokenizer(folder, config.vocab_size),
                  folder, NAME, max_queue=64)
    with running(svc) as url:
        yield url, svc


@pytest.fixture(scope="module")
def reference(folder):
    """Each prompt's greedy text alone, from an engine built as `flashgen generate` builds it."""
    config = ModelConfig.from_folder(folder)
    tok = load_tokenizer(folder, config.vocab_size)
    engine = load_engine(folder, config, torch.device("cpu"), 32, 16)

    def text(prompt: str | list[int], n: int = NEW) -> str:
        ids = tok.encode(prompt).ids if isinstance(prompt, str) else prompt
        return tok.decode(engine.generate([ids], SamplingParams(max_new_tokens=n))[0].output)
    return text


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def idle(svc) -> None:
    """Wait until the engine holds no request; then every block is free again or idle in the prefix
    cache (none leaked)."""
    e = svc.loop.engine
    deadline = time.monotonic() + 30
    while (e.waiting or e.running or e.pending or svc.loop.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    m = e.cache.manager
    assert not e.waiting and not e.running and not m.tables and not m.refs
    assert sorted(m.free + list(m.cached)) == list(range(BLOCKS))


def test_completions_and_chat_whole_and_streamed(server, reference, folder, capsys):
    url, svc = server
    c = client(url)
    prompt = "w1 w5 w9 w20 w33"
    expected = reference(prompt)
    from flashgen.cli import main  # the reference is what `flashgen generate` prints
    assert main(["generate", "--model", str(folder), "--prompt", prompt, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == expected + "\n"

    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, NEW, 5 + NEW)
    chunks = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == NEW and not chunks[-1].choices

    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w40 w41 w42"}]
    rendered = ChatTemplate.from_folder(folder).render(messages)
    assert rendered == "w11 w7 w8 w12 w40 w41 w42 w99"
    expected = reference(rendered)
    r = c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 8
    chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"

    # a stop string ends the text before it, and the request
    cut = expected.split()[2]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0, stop=[cut])
    assert r.choices[0].message.content == expected[:expected.index(cut)] and r.choices[0].finish_reason == "stop"
    assert [m.id for m in c.models.list().data] == [NAME]
    with urllib.request.urlopen(url + "/health") as h:
        assert h.status == 200
    idle(svc)


def test_32_concurrent_streams_each_equal_generate(server, reference):
    url, svc = server
    prompts = [" ".join(f"w{(7 * i + 3 * j) % 128}" for j in range(2 + i % 4)) for i in range(32)]  # (few lengths:
    # each new row count costs the CPU's kernels a build)
    c = client(url)
    most = []
    step = svc.loop.engine.step

    def counting_step():
        most.append(len(svc.loop.engine.running) + len(svc.loop.engine.waiting))
        step()

    svc.loop.engine.step = counting_step
    try:
        def stream(p: str) -> str:
            return "".join(ch.choices[0].text for ch in c.completions.create(
                model=NAME, prompt=p, max_tokens=NEW, temperature=0, stream=True))
        with ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(stream, prompts))
    finally:
        del svc.loop.engine.step
    assert texts == [reference(p) for p in prompts]
    assert max(most) > 1  # the requests were batched together, not served one after the other
    idle(svc)


def test_a_client_leaving_mid_stream_aborts_its_request(server, reference):
    url, svc = server
    e = svc.loop.engine
    aborted, step, abort = [], e.step, e.abort
    e.step = lambda: (time.sleep(0.005), step())  # (so the long request is still running when its client leaves)
    e.abort = lambda rid: aborted.append(rid) or abort(rid)
    try:
        c = client(url)
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(lambda: "".join(ch.choices[0].text for ch in c.completions.create(
                model=NAME, prompt="w3 w4", max_tokens=40, temperature=0, stream=True)))
            long = c.completions.create(model=NAME, prompt="w1 w2", max_tokens=200, temperature=0, stream=True)
            first = next(iter(long))
            assert first.choices[0].text
            long.close()
            assert other.result() == reference("w3 w4", 40)
        deadline = time.monotonic() + 10
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(aborted) == 1
    finally:
        del e.step, e.abort
    idle(svc)


def post(url: str, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


GOOD = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
MALFORMED = [  # (body, path, the param named)
    (b"{not json", "/v1/completions", None),
    (b"[1, 2]", "/v1/completions", None),
    ({**GOOD, "model": "gpt-4"}, "/v1/completions", "model"),
    ({**GOOD, "temperature": -1}, "/v1/completions", "temperature"),
    ({**GOOD, "temperature": "hot"}, "/v1/completions", "temperature"),
    ({**GOOD, "top_p": 1.5}, "/v1/completions", "top_p"),
    ({**GOOD, "top_p": 0}, "/v1/completions", "top_p"),
    ({**GOOD, "max_tokens": 0}, "/v1/completions", "max_tokens"),
    ({**GOOD, "max_tokens": 2.5}, "/v1/completions", "max_tokens"),
    ({**GOOD, "prompt": ""}, "/v1/completions", "prompt"),
    ({**GOOD, "prompt": [1, 500]}, "/v1/completions", "prompt"),
    ({**GOOD, "prompt": " ".join(["w1"] * 250), "max_tokens": 10}, "/v1/completions", "max_tokens"),
    ({**GOOD, "n": 2}, "/v1/completions", "n"),
    ({**GOOD, "logprobs": 3}, "/v1/completions", "logprobs"),
    ({**GOOD, "frequency_penalty": 0.5}, "/v1/completions", "frequency_penalty"),
    ({**GOOD, "stream": "yes"}, "/v1/completions", "stream"),
    ({**GOOD, "seed": -4}, "/v1/completions", "seed"),
    ({**GOOD, "beams": 4}, "/v1/completions", "beams"),
    ({**CHAT, "messages": []}, "/v1/chat/completions", "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "w1"}]}, "/v1/chat/completions", "messages"),
    ({**CHAT, "max_completion_tokens": -1, "max_tokens": None}, "/v1/chat/completions", "max_completion_tokens"),
]


def test_malformed_requests_are_400_with_openai_error_bodies(server):
    url, svc = server
    for body, path, param in MALFORMED:
        status, reply = post(url, body, path)
        assert status == 400, (body, reply)
        assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
        err = reply["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert err["message"] and "\n" not in err["message"]
    status, reply = post(url, GOOD)
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    idle(svc)


def test_past_max_queue_requests_are_429_and_the_rest_served(server, monkeypatch):
    url, svc = server
    e, gate, step = svc.loop.engine, threading.Event(), svc.loop.engine.step
    monkeypatch.setattr(svc.loop, "max_queue", 2)
    e.step = lambda: (gate.wait(), step())
    try:
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(post, url, GOOD) for _ in range(2)]
            deadline = time.monotonic() + 10
            while svc.loop.waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            status, reply = post(url, GOOD)
            assert status == 429 and reply["error"]["code"] == "queue_full", reply
            gate.set()
            assert [f.result()[0] for f in queued] == [200, 200]
    finally:
        gate.set()
        del e.step
    idle(svc)


def byte_tokenizer():
    """Every UTF-8 byte its own token (a byte-level BPE without merges): one character may span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_text_comes_in_whole_characters_and_stops_at_a_stop_string():
    tok = byte_tokenizer()
    text = "héllo wörld, 😀 €5 and more"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode())
    pieces = []
    stream = TextStream(tok)
    for i in ids:
        pieces.append(stream.add([i]))
    pieces.append(stream.finish())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(bool(p) for p in pieces) > 10  # it streamed, not all at the end

    stream, out = TextStream(tok, ("ld, 😀", "zzz")), []
    for i in ids:
        out.append(stream.add([i]))
    out.append(stream.finish())
    assert "".join(out) == "héllo wör" and stream.stopped


def test_the_shipped_records_reader_serves_every_thread():
    """The engine steps in its own thread, after the main thread loaded a model (and dispatched with
    the shipped records, an in-memory database built once per process): that thread reads it too."""
    from flashgen.db.database import MEMORY, Database

    db = Database(MEMORY)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(db.count()))
    thread.start()
    thread.join()
    assert seen == [0]


def test_serve_refuses_a_port_in_use_in_one_line_before_loading(folder, capsys, monkeypatch):
    from flashgen import cli
    from flashgen.runtime.checkpoints import generation_config
    from flashgen.runtime.decoder import loading

    assert cli.DEFAULT_NEW_TOKENS == generation_config.DEFAULT_NEW_TOKENS  # (the help's, named before torch loads)
    monkeypatch.setattr(loading, "load_weights", lambda *a: pytest.fail("weights were loaded"))
    taken = listen("127.0.0.1", 0)
    port = taken.getsockname()[1]
    assert cli.main(["serve", "--model", str(folder), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flashgen: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1
    taken.close()


def test_serve_builds_its_engine_in_the_quant_mode_and_cache_setting_given(folder, monkeypatch):
    """`flashgen serve --quant MODE --no-prefix-cache` builds the engine `load_engine` builds for those
    (the decoder's linears in MODE, no prefix cache); the server's text in w8a8 is that engine's greedy
    text, computed by w8a8's linears (the CPU names the mode that computed in its fallbacks)."""
    from flashgen import cli
    from flashgen.runtime.server import main as server_main

    seen = []
    monkeypatch.setattr(server_main, "serve", lambda device, o: seen.append(o))
    assert cli.main(["serve", "--model", str(folder), "--port", "0", "--quant", "w8a8", "--no-prefix-cache"]) == 0
    assert len(seen) == 1 and seen[0].quant == "w8a8" and seen[0].prefix_cache is False
    config = ModelConfig.from_folder(folder)
    tok = load_tokenizer(folder, config.vocab_size)
    engine = load_engine(folder, config, torch.device("cpu"), 32, 16, quant=seen[0].quant,
                         prefix_cache=seen[0].prefix_cache)
    assert engine.model.quant == "w8a8" and not engine.prefix_cache
    prompts = ["w1 w2 w3", "w7 w8", "w40 w41 w42 w43"]
    params = SamplingParams(max_new_tokens=8)
    want = [tok.decode(r.output) for r in engine.generate([tok.encode(p).ids for p in prompts], params)]
    engine.model.fallbacks.clear()
    with running(service(engine, tok, folder, NAME, max_queue=8)) as url:
        c = client(url)
        got = [c.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts]
    assert got == want
    assert any(f.startswith("w8a8 linear") for f in engine.model.fallbacks)  # (the served requests ran w8a8's linears)


def test_serve_over_two_ranks_answers_as_one_process(folder, reference):
    """`flashgen serve --tp 2` on the CPU (two gloo ranks): rank 0 serves, the other follows each round's
    adds; completions one at a time and two at once are one process's greedy text; a Ctrl-C to the
    process group ends the launcher and both ranks."""
    import os
    import queue
    import re
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "flashgen.cli", "serve", "--model", str(folder), "--port", "0",
                             "--tp", "2", "--cache-blocks", "32"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        seen, url = [], None
        while url is None:
            seen.append(lines.get(timeout=300))
            url = next((m.group(1) for m in [re.search(r" on (http://\S+)/v1 ", seen[-1])] if m), None)
        c = client(url)
        name = c.models.list().data[0].id
        prompts = ["w1 w2 w3", "w7 w8"]

        def complete(p: str) -> str:
            return c.completions.create(model=name, prompt=p, max_tokens=NEW, temperature=0).choices[0].text
        one_by_one = [complete(p) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(complete, prompts))
        assert one_by_one == together == [reference(p) for p in prompts]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) is not None
        deadline = time.monotonic() + 30
        while _live_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _live_in_group(proc.pid)  # (no rank left running)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _live_in_group(pgid: int) -> list[int]:
    """The processes of group `pgid` still running (a zombie waiting to be reaped is not), from /proc."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live
