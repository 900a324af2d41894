"""`flashgen serve`: a model folder's engine (built as `flashgen generate` builds it,
runtime/decoder/loading.py), its loop thread and the routes, served by uvicorn on a socket bound before
the weights load (a port in use is one line, at once). Under tensor parallelism each rank builds its
part of the model; rank 0 serves and the others follow its rounds (runtime/server/engine_loop.py)."""
from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.chat_template import ChatTemplate
from flashgen.runtime.checkpoints.generation_config import generation_defaults
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.checkpoints.tokenizer import load_tokenizer
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.loading import load_engine
from flashgen.runtime.server.app import Service, create_app
from flashgen.runtime.server.engine_loop import EngineLoop, follow


@dataclass(frozen=True)
class ServeOptions:
    folder: Path
    host: str
    port: int
    name: str
    quant: str
    tp: int
    cache_blocks: int
    block_size: int
    max_queue: int
    prefix_cache: bool = True


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port) and listening, or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise FlashgenError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise FlashgenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def service(engine: Engine, tokenizer, folder: Path, name: str, max_queue: int) -> Service:
    """The routes' view of a started engine loop over `folder`'s model (no chat template: chat refused)."""
    try:
        chat = ChatTemplate.from_folder(folder)
    except FlashgenError:
        chat = None
    return Service(EngineLoop(engine, max_queue).start(), tokenizer, name, folder, generation_defaults(folder), chat)


def run(svc: Service, sock: socket.socket) -> None:
    """Serve `svc` on `sock` until interrupted, then stop its loop."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(f"flashgen serve: {svc.name} on http://{host}:{port}/v1 (engine {svc.loop.engine.model.quant}, "
          f"{svc.loop.engine.cache.manager.block_size * len(svc.loop.engine.cache.manager.free)} tokens of KV cache)",
          file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning", timeout_graceful_shutdown=5)).run(
            sockets=[sock])
    finally:
        svc.loop.stop()


def serve(device: torch.device, o: ServeOptions) -> None:
    """`flashgen serve` on `device`: the whole model, or this rank's part of it (rank 0 serves)."""
    config = ModelConfig.from_folder(o.folder)
    tok = load_tokenizer(o.folder, config.vocab_size)
    sock = listen(o.host, o.port) if o.tp == 1 or torch.distributed.get_rank() == 0 else None
    engine = load_engine(o.folder, config, device, o.cache_blocks, o.block_size, o.tp, o.quant, o.prefix_cache)
    if sock is None:
        follow(engine)
        return
    run(service(engine, tok, o.folder, o.name, o.max_queue), sock)
