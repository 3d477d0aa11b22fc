"""Big request bodies screened in a process of their own before the server parses them.

Python's JSON decoder holds the interpreter lock for the whole of a call: a body of 8 MB of
small objects (60,000 chat messages) takes it for ~0.4 s at a time, during which the event
loop and the engine thread wait, whatever pool the parse runs in. So a body past
`SCREEN_BYTES` is first decoded and validated as its request model in a worker process
(protocol.parse_request: the counts of messages and input items, every field's bounds); a
body refused there is answered with its 400 and never parsed here. A body that passes is parsed again
in the server (a legitimate body that large is rare; its second parse is the price).

The worker is one process started with `spawn` (the server holds threads and maybe CUDA, so
no fork), warmed when the server starts, shut down with it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from pydantic import BaseModel

from moeferry.server.protocol import APIError, decode_json, parse_request

SCREEN_BYTES = 512 << 10  # bodies past this are screened in the worker process first


def screen(body: bytes, model: type[BaseModel]) -> tuple | None:
    """In the worker: the APIError the body's decoding or validation as `model` raises, as
    (status, message, param, code), or None when it passes."""
    try:
        parse_request(model, decode_json(body))
    except APIError as exc:
        return exc.status, exc.message, exc.param, exc.code
    return None


def _ready() -> bool:
    return True


class BodyScreen:
    """One worker process screening big bodies (module docstring). `check` blocks its caller
    (a pool thread) while the worker works; the server's own threads keep the interpreter lock."""

    def __init__(self):
        self._executor: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker and let it import what it needs, in the background."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._executor.submit(_ready)

    def check(self, body: bytes, model: type[BaseModel]) -> None:
        """Raise the 400 the body's decoding or validation as `model` gives, if any."""
        self.start()
        refused = self._executor.submit(screen, body, model).result()
        if refused is not None:
            status, message, param, code = refused
            raise APIError(status, message, param=param, code=code)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
