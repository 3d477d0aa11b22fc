"""The engine thread: owns the Engine, steps it while there is work, and hands each request's
output to the asyncio front end without ever blocking it.

    front end (asyncio)                       engine thread
    submit() ---- ("add", handle) ---->  commands (queue.Queue) --> Engine.add_request
    abort()  ---- ("abort", handle) -->                          --> Engine.abort
    call()   ---- ("call", fn, fut) -->                          --> fn(engine)
    handle.queue <-- loop.call_soon_threadsafe(batch of Deltas) <-- Engine.step()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from moeferry.engine.engine import Engine, StepOutput
from moeferry.errors import EngineFailed
from moeferry.sampling import InvalidRequest, SamplingParams
from moeferry.server.protocol import APIError
from moeferry.threads import engine_threads

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0
SHUTDOWN = "shutdown"  # the finish_reason of a request the server's shutdown cut short
ERROR = "error"  # the finish_reason of a request that failed inside the engine


@dataclass(frozen=True)
class Delta:
    """What one request produced since its last Delta. `finish_reason` is set on the last one:
    "stop" or "length" (OpenAI's), or SHUTDOWN or ERROR with `error` the answer a client
    waiting for the whole body gets (503 or 500)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: APIError | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token, when the request asked
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list | None = None  # the Request's, on the Delta of its first token, when asked for


@dataclass(eq=False)
class RequestHandle:
    """The front end's view of one request.

    Invariants: `accepted` resolves once (None, or an APIError when the engine refused the
    request); after acceptance `queue` receives Deltas in order and exactly one of them has a
    finish_reason, the last. `request` is touched by the engine thread only.
    """

    prompt_ids: list[int]
    params: SamplingParams
    accepted: asyncio.Future
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # front end only: the last Delta was read, or the request aborted
    request: Any = None  # engine thread only: the engine's Request once added
    submitted: float = field(default_factory=time.monotonic)  # time-to-first-token counts from here
    last_token_time: float | None = None  # engine thread only


class EngineLoop:
    """Runs one Engine in a dedicated thread.

    Invariants: after `start`, only the engine thread touches the Engine; the front end talks
    to it only through the thread-safe `commands` queue and hears back only through
    `loop.call_soon_threadsafe`; every accepted request gets exactly one final Delta (finished,
    aborted, or failed), including when the loop stops; the thread sleeps on the queue when
    there is no work. `metrics` (optional) observes token timings; `activity` (optional) is
    called after every iteration with the engine, to log periodically.
    """

    def __init__(self, engine: Engine, metrics=None, activity: Callable[[Engine], None] | None = None):
        self.engine, self.metrics, self.activity = engine, metrics, activity
        self.commands: queue.Queue = queue.Queue()
        self.live: dict[int, RequestHandle] = {}  # engine thread only: rid -> handle
        self.accepting = True
        self.failure: str | None = None  # why the engine ended (EngineFailed), if it did
        self.on_failure: Callable[[], None] | None = None  # told once it has (the server stops)
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- front end (event loop thread) --------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="moeferry-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; returns once the engine accepted it (raises APIError otherwise)."""
        if not self.accepting or not self.alive:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        handle = RequestHandle(prompt_ids, params, asyncio.get_running_loop().create_future())
        self.commands.put(("add", handle))
        try:
            await handle.accepted
        except asyncio.CancelledError:
            self.abort(handle)
            raise
        return handle

    async def stream(self, handle: RequestHandle):
        """Yield the request's Deltas up to the last one; if the consumer stops early (client
        disconnect, cancellation), the request is aborted and its KV pages freed."""
        try:
            while not handle.finished:
                delta = await handle.queue.get()
                handle.finished = delta.finish_reason is not None
                yield delta
        finally:
            self.abort(handle)

    def abort(self, handle: RequestHandle) -> None:
        """Abort a request the front end no longer wants (a no-op once it has finished)."""
        if not handle.finished:
            handle.finished = True
            self.commands.put(("abort", handle))

    async def call(self, fn: Callable[[Engine], Any], timeout: float = 10.0) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        if not self.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        future = asyncio.get_running_loop().create_future()
        self.commands.put(("call", fn, future))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine did not answer within {timeout:g} s", code="engine_busy") from None

    def finish_all(self) -> None:
        """Stop taking requests and end every live one with finish_reason SHUTDOWN."""
        self.accepting = False
        self.commands.put(("finish_all",))

    def stop(self, timeout: float = 30.0) -> None:
        self.accepting = False
        if self._thread is not None:
            self.commands.put(("stop",))
            self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.debug("engine thread started")
        with engine_threads():
            self._serve()
        logger.debug("engine thread stopped")

    def _serve(self) -> None:
        running = True
        while running:
            running = self._drain_commands(block=not self.engine.has_work)
            if running and self.engine.has_work:
                running = self._step()
            if self.activity is not None:
                self.activity(self.engine)
        self._end_all(SHUTDOWN, _shutdown_error())

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when `block`); False after "stop"."""
        try:
            cmd = self.commands.get(timeout=_IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._apply(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            self._call(cmd[1], cmd[2])
        elif kind == "finish_all":
            self._end_all(SHUTDOWN, _shutdown_error())

    def _add(self, handle: RequestHandle) -> None:
        if not self.accepting:
            self._post(handle.accepted.set_exception, APIError(503, "the server is shutting down"))
            return
        try:
            handle.request = self.engine.add_request(handle.prompt_ids, handle.params)
        except InvalidRequest as exc:
            self._post(handle.accepted.set_exception, APIError(400, str(exc), param=exc.param))
            return
        except Exception:  # noqa: BLE001 - a bug here must cost one request, not the engine thread
            logger.exception("could not add a request")
            self._post(handle.accepted.set_exception, APIError(500, "internal error adding the request"))
            return
        self.live[handle.request.rid] = handle
        self._post(handle.accepted.set_result, None)

    def _abort(self, handle: RequestHandle) -> None:
        if handle.request is not None and self.live.pop(handle.request.rid, None) is not None:
            self.engine.abort(handle.request)
            logger.info("request %d aborted by the client", handle.request.rid)

    def _call(self, fn, future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            self._post(future.set_exception, exc)
        else:
            self._post(future.set_result, result)

    def _step(self) -> bool:
        """One engine step, its tokens delivered; False once the engine has failed for good."""
        try:
            outputs = self.engine.step()
        except EngineFailed as exc:
            logger.error("the engine failed: %s", exc)
            self.accepting, self.failure = False, str(exc)
            self._end_all(ERROR, APIError(503, f"the engine failed: {exc}", code="engine_failed"))
            if self.on_failure is not None:
                self.on_failure()
            return False
        except Exception:  # noqa: BLE001 - one bad step must not take the server down
            logger.exception("engine step failed: failing every live request")
            self._end_all(ERROR, APIError(500, "internal error in the engine step; see the server log"))
            return True
        now = time.monotonic()
        batch = [(h, self._delta(h, out, now)) for out in outputs if (h := self.live.get(out.request.rid))]
        for handle, delta in batch:
            if delta.finish_reason is not None:
                self.live.pop(handle.request.rid, None)
        self._deliver(batch)
        return True

    def _delta(self, handle: RequestHandle, out: StepOutput, now: float) -> Delta:
        req = out.request
        if self.metrics is not None:
            if handle.last_token_time is None:
                self.metrics.observe_first_token(now - handle.submitted)
            else:
                self.metrics.observe_next_token(now - handle.last_token_time)
        handle.last_token_time = now
        error = APIError(500, out.error) if out.error is not None else None
        return Delta(out.new_text, list(out.new_token_ids), req.finish_reason if out.finished else None,
                     len(req.prompt_ids), len(req.output_ids), error, list(out.logprobs), req.num_cached_tokens,
                     out.prompt_logprobs)

    def _end_all(self, reason: str, error: APIError) -> None:
        batch = []
        for handle in list(self.live.values()):
            req = handle.request
            try:
                self.engine.abort(req)
            except Exception:  # noqa: BLE001 - the engine may be in a broken state after a failed step
                logger.exception("could not free request %d", req.rid)
            batch.append((handle, Delta("", [], reason, len(req.prompt_ids), len(req.output_ids), error,
                                        cached_tokens=req.num_cached_tokens)))
        self.live.clear()
        self._deliver(batch)

    def _deliver(self, batch: list[tuple[RequestHandle, Delta]]) -> None:
        if batch:
            self._post(_put_all, batch)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(_safe_call, fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down: this request was cut short", code="shutting_down")


def _put_all(batch: list[tuple[RequestHandle, Delta]]) -> None:
    for handle, delta in batch:
        handle.queue.put_nowait(delta)


def _safe_call(fn, *args) -> None:
    try:
        fn(*args)
    except asyncio.InvalidStateError:  # the waiter was cancelled (client gone) before the answer came
        pass
