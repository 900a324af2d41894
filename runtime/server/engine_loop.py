"""The engine of a server, stepped in one thread of its own: requests reach it between steps
(continuous batching), and each request's new tokens go to the asyncio queue of the one waiting for them.

The engine (runtime/decoder/engine.py) is not thread-safe, so nothing but this thread touches it. The
server's handlers hand over `Ticket`s and aborts through an inbox under a lock; the thread drains the
inbox, adds and aborts, steps once, and posts each ticket's events to its queue with
`loop.call_soon_threadsafe`: `Accepted`, then `Tokens` as they come, then `Finished` (the request is out
of the engine, its blocks freed); or `Refused` alone, where the engine refused the request at `add`.
Between steps with nothing to do it sleeps on the lock's condition.

The waiting queue is bounded: `submit` refuses (`QueueFull`) a request while `max_queue` others wait,
in the inbox or in the engine's queue (admitted ones run and are not counted). A step that raises (under
tensor parallelism, a failed rank stops the group) ends the loop: every open ticket is finished with the
reason, later submissions are refused with it, and `error` says it.

Under tensor parallelism (`engine.model.tp` > 1) this runs in rank 0 and `follow` in every other rank:
each round's adds and aborts are broadcast before the step, so every rank's engine gets the same
requests in the same order, and steps as rank 0's does (runtime/decoder/engine.py, module docstring). An
idle rank 0 sends an empty round every `HEARTBEAT_S` seconds, within the group's timeout; `stop` sends
the round that ends the followers.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from flashgen.errors import FlashgenError, one_line
from flashgen.runtime.decoder.engine import Engine, Request
from flashgen.runtime.decoder.sampling import SamplingParams

HEARTBEAT_S = 5.0  # an idle rank 0's empty rounds, well within the group's timeout (ranks.DEFAULT_TIMEOUT_S)


class QueueFull(FlashgenError):
    """`max_queue` requests wait already."""


@dataclass(frozen=True)
class Accepted:
    pass


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Tokens:
    ids: list[int]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (a stop token), "length" (max_new_tokens), "abort", or "error"
    error: str = ""


Event = Accepted | Refused | Tokens | Finished


@dataclass(eq=False)
class Ticket:
    """One request on its way through the loop, and where its events go."""
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    rid: int | None = None  # the engine's id, once added (engine thread)
    sent: int = 0           # output tokens posted so far (engine thread)

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop has closed: nobody waits for it any more
            pass


def finish_reason(req: Request) -> Finished:
    if req.error == "aborted":
        return Finished("abort")
    if req.error:
        return Finished("error", req.error)
    return Finished("stop" if req.output and req.output[-1] in req.params.stop_tokens else "length")


class EngineLoop:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.error = ""  # why the loop ended, where a step raised
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, Ticket]] = []  # ("add" | "abort", ticket), in order
        self._adds = 0                # adds in the inbox
        self._engine_waiting = 0      # the engine's waiting requests after the last round
        self._stopping = False
        self._tickets: dict[int, Ticket] = {}  # engine id -> ticket (engine thread)
        self._thread = threading.Thread(target=self._run, name="flashgen-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread after its current round (and, under tensor parallelism, the followers)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def waiting(self) -> int:
        """Requests not yet running: in the inbox, or waiting in the engine after the last round."""
        with self._cond:
            return self._adds + self._engine_waiting

    def submit(self, ticket: Ticket) -> None:
        """Hand `ticket` to the engine thread; QueueFull past `max_queue` waiting, FlashgenError once the
        loop has ended."""
        with self._cond:
            if self.error or self._stopping:
                raise FlashgenError(self.error or "the server is stopping")
            if self._adds + self._engine_waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting already (--max-queue); retry later")
            self._inbox.append(("add", ticket))
            self._adds += 1
            self._cond.notify()

    def abort(self, ticket: Ticket) -> None:
        """Abort `ticket`'s request, freeing its blocks (a no-op where it has finished)."""
        with self._cond:
            self._inbox.append(("abort", ticket))
            self._cond.notify()

    def _busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or e.pending)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not (self._inbox or self._busy() or self._stopping):
                        self._cond.wait(HEARTBEAT_S)
                    if self._stopping:
                        break
                    commands, self._inbox, self._adds = self._inbox, [], 0
                self._round(commands)
                self._publish_waiting()
        except BaseException as e:  # noqa: BLE001 (every open ticket hears why, and later ones are refused)
            with self._cond:
                self.error = f"the engine stopped: {one_line(e)}"
                commands, self._inbox = self._inbox, []
            for t in [*self._tickets.values(), *(t for kind, t in commands if kind == "add")]:
                t.post(Finished("error", self.error))
            self._tickets.clear()
            return
        if self.engine.model.tp > 1:
            _share(None, self.engine)  # the followers end

    def _round(self, commands: list[tuple[str, Ticket]]) -> None:
        """Add and abort as the inbox says, step once where there is work, post what came out."""
        e = self.engine
        if e.model.tp > 1:
            _share([(kind, (t.prompt, t.params) if kind == "add" else t.rid) for kind, t in commands], e)
        for kind, t in commands:
            if kind == "abort":
                if t.rid is not None:
                    e.abort(t.rid)
                continue
            try:
                t.rid = e.add(t.prompt, t.params)
            except FlashgenError as err:
                t.post(Refused(str(err)))
                continue
            if t.rid in e.finished:  # well-formed, and more than this engine can serve
                t.post(Refused(e.finished.pop(t.rid).error))
                continue
            self._tickets[t.rid] = t
            t.post(Accepted())
        self._publish_waiting()
        if self._busy():
            e.step()
        for req in e.running:
            self._post_tokens(req)
        for req in e.pop_finished():
            self._post_tokens(req)
            if (t := self._tickets.pop(req.id, None)) is not None:
                t.post(finish_reason(req))

    def _publish_waiting(self) -> None:
        """The engine's waiting requests, for `submit`'s bound: after the adds and after the step."""
        with self._cond:
            self._engine_waiting = len(self.engine.waiting)

    def _post_tokens(self, req: Request) -> None:
        t = self._tickets.get(req.id)
        if t is not None and len(req.output) > t.sent:
            t.post(Tokens(req.output[t.sent:]))
            t.sent = len(req.output)


def _share(commands: list | None, engine: Engine) -> list | None:
    """Rank 0's round (None: the last) on every rank of the engine's group."""
    from flashgen.runtime.decoder.tensor_parallel import _collective

    model = engine.model
    box = [commands]
    src = 0 if model.group is None else dist.get_global_rank(model.group, 0)
    _collective("broadcast of the server's requests",
                lambda: dist.broadcast_object_list(box, src, group=model.group, device=model.device), model.rank)
    return box[0]


def follow(engine: Engine) -> None:
    """A rank other than 0 of a served model: each of rank 0's rounds applied to this rank's engine,
    until the last (module docstring). An add rank 0's engine refused is refused here alike."""
    while (commands := _share(None, engine)) is not None:
        for kind, what in commands:
            if kind == "abort":
                if what is not None:
                    engine.abort(what)
            else:
                try:
                    engine.add(*what)
                except FlashgenError:
                    pass
        if engine.waiting or engine.running or engine.pending:
            engine.step()
        engine.pop_finished()
