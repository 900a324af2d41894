"""`flashgen serve`'s routes, on starlette: OpenAI's /v1/completions and /v1/chat/completions (whole,
or streamed as server-sent events with `stream: true`), /v1/models, and /health.

A request is checked (runtime/server/schema.py), its prompt tokenized (a chat's messages rendered with
the folder's chat template first, runtime/checkpoints/chat_template.py), and handed to the engine's
thread (runtime/server/engine_loop.py); its tokens come back as they are generated, and are turned into
text piece by piece (runtime/server/detokenize.py). A stop string ends the text and aborts the request.
A client that leaves before the end aborts its request, so its KV cache blocks are freed at the next
step. Every refusal is OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed request or one the engine refuses (longer than the model's context or the whole cache), 429
while `--max-queue` requests wait, 503 once the engine has stopped, 500 for a fault of the server (the
server goes on serving).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flashgen.errors import FlashgenError, one_line
from flashgen.runtime.checkpoints.chat_template import ChatTemplate
from flashgen.runtime.checkpoints.generation_config import within_max_length
from flashgen.runtime.server.detokenize import TextStream
from flashgen.runtime.server.engine_loop import Accepted, EngineLoop, Finished, QueueFull, Refused, Ticket, Tokens
from flashgen.runtime.server.schema import Parsed, RequestError, check, parse

DISCONNECT_POLL_S = 1.0  # how often a whole (not streamed) response checks that its client is still there


@dataclass
class Service:
    """What the routes serve: the engine's loop and the model's tokenizer, name and settings."""
    loop: EngineLoop
    tokenizer: Any
    name: str
    folder: Path | None           # for its generation_config.json's max_length message; None: no folder
    defaults: dict[str, Any]      # generation_config.json's decoding (runtime/checkpoints/generation_config.py)
    chat: ChatTemplate | None   # the folder's chat template; None: the chat route is refused

    @property
    def config(self):
        return self.loop.engine.model.c


@dataclass
class Outcome:
    """A request's result so far: its text pieces joined, tokens counted, and how it ended."""
    prompt_tokens: int
    completion_tokens: int = 0
    finish: str | None = None
    error: str = ""

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(service: Service) -> Starlette:
    async def health(request: Request) -> Response:
        if service.loop.error:
            return error_response(RequestError(service.loop.error, status=503, kind="server_error"))
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": service.name, "object": "model", "created": 0, "owned_by": "flashgen",
             "max_model_len": service.config.max_position_embeddings}]})

    async def completions(request: Request) -> Response:
        return await _serve(service, request, "completion")

    async def chat(request: Request) -> Response:
        return await _serve(service, request, "chat")

    routes = [Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={Exception: _fault})


async def _fault(request: Request, exc: Exception) -> Response:
    """A fault of the server, not of the request: one line in OpenAI's body, and the server serves on."""
    return error_response(RequestError(f"internal error: {one_line(exc)}", status=500, kind="server_error"))


def _prompt_ids(service: Service, parsed: Parsed) -> list[int]:
    """The request's prompt as token ids: a chat rendered with the folder's template (whose text holds
    its special tokens), a text encoded as `generate` encodes it, or the ids given."""
    if parsed.messages is not None:
        if service.chat is None:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        try:
            text = service.chat.render(parsed.messages)
        except FlashgenError as e:
            raise RequestError(str(e), "messages") from None
        return service.tokenizer.encode(text, add_special_tokens=False).ids
    if isinstance(parsed.prompt, str):
        return service.tokenizer.encode(parsed.prompt).ids
    return list(parsed.prompt)


async def _admit(service: Service, request: Request, kind: str) -> tuple[Parsed, Ticket, Outcome]:
    """The request checked, tokenized and handed to the engine, once the engine has accepted it."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not JSON: {one_line(e)}") from None
    c = service.config
    parsed = parse(body, kind, service.name, service.defaults, c.eos_token_ids)
    ids = _prompt_ids(service, parsed)
    check(ids, parsed, c.vocab_size)
    where = (service.folder or Path(".")) / "generation_config.json"
    try:
        n = within_max_length(parsed.params.max_new_tokens, parsed.cap, len(ids), where)
    except FlashgenError as e:
        raise RequestError(str(e), parsed.length_field) from None
    ticket = Ticket(ids, replace(parsed.params, max_new_tokens=n), asyncio.get_running_loop())
    try:
        service.loop.submit(ticket)
    except QueueFull as e:
        raise RequestError(str(e), status=429, kind="rate_limit_error", code="queue_full") from None
    except FlashgenError as e:
        raise RequestError(str(e), status=503, kind="server_error") from None
    first = await ticket.events.get()
    if isinstance(first, Refused):
        raise RequestError(first.reason, parsed.length_field, "context_length_exceeded")
    if isinstance(first, Finished):  # the engine stopped
        raise RequestError(first.error, status=503, kind="server_error")
    assert isinstance(first, Accepted)
    return parsed, ticket, Outcome(len(ids))


async def _pieces(service: Service, ticket: Ticket, parsed: Parsed, out: Outcome) -> AsyncIterator[str]:
    """The request's text as it comes, ending at its last token or its first stop string (which
    aborts the request); `out` says how it ended."""
    text = TextStream(service.tokenizer, parsed.stop)
    while out.finish is None:
        event = await ticket.events.get()
        if isinstance(event, Tokens):
            out.completion_tokens += len(event.ids)
            piece = text.add(event.ids)
            if text.stopped:
                service.loop.abort(ticket)
                out.finish = "stop"
        else:
            assert isinstance(event, Finished)
            piece = text.finish()
            out.finish, out.error = event.reason, event.error
        if piece:
            yield piece


async def _serve(service: Service, request: Request, kind: str) -> Response:
    try:
        parsed, ticket, out = await _admit(service, request, kind)
    except RequestError as e:
        return error_response(e)
    rid, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": service.name}
    if parsed.stream:
        return StreamingResponse(_stream(service, ticket, parsed, out, kind, head), media_type="text/event-stream")
    pieces: list[str] = []
    try:
        stream = _pieces(service, ticket, parsed, out)
        while True:
            step = asyncio.ensure_future(anext(stream))
            while not step.done():
                await asyncio.wait([step], timeout=DISCONNECT_POLL_S)
                if not step.done() and await request.is_disconnected():
                    step.cancel()
                    return Response(status_code=499)
            try:
                pieces.append(step.result())
            except StopAsyncIteration:
                break
    finally:
        if out.finish is None:
            service.loop.abort(ticket)
    if out.finish == "error":
        return error_response(RequestError(out.error, status=500, kind="server_error"))
    text = "".join(pieces)
    choice = {"index": 0, "logprobs": None, "finish_reason": out.finish}
    choice.update({"message": {"role": "assistant", "content": text}} if kind == "chat" else {"text": text})
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return JSONResponse({**head, "object": obj, "choices": [choice], "usage": out.usage()})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(service: Service, ticket: Ticket, parsed: Parsed, out: Outcome, kind: str,
                  head: dict[str, Any]) -> AsyncIterator[str]:
    """The request's chunks as server-sent events, as OpenAI sends them: for chat a first chunk with the
    role, then one per text piece, one with the finish reason, the usage where asked, and [DONE]. A
    client that leaves ends this generator early, and its request is aborted."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> str:
        if kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {} if piece is None else {"content": piece}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return _sse({**head, "object": obj, "choices": [choice], **({"usage": None} if parsed.include_usage else {})})

    try:
        if kind == "chat":
            yield chunk(None, first=True)
        async for piece in _pieces(service, ticket, parsed, out):
            yield chunk(piece)
        if out.finish == "error":
            yield _sse(RequestError(out.error, kind="server_error").body())
        else:
            yield chunk(None, out.finish)
        if parsed.include_usage:
            yield _sse({**head, "object": obj, "choices": [], "usage": out.usage()})
        yield "data: [DONE]\n\n"
    finally:
        if out.finish is None:
            service.loop.abort(ticket)
