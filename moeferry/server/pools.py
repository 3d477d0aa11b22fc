"""Bounded worker pools for the front end's work whose cost grows with a request's input
(tokenizing, chat templating, compiling a grammar), so that one client's big input never runs
on the event loop nor queues without bound in front of the others.

Each kind of work has a pool of its own: a grammar compile never waits behind a tokenization.
The workers are daemon threads, so a job still running when the server stops (a compile
cannot be interrupted) never holds the process alive.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from moeferry.server.protocol import APIError

RETRY_AFTER_S = 1  # what a refused client is told to wait


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    abandoned: bool = field(default=False)  # its caller left: skip it if it has not started


class WorkPool:
    """`workers` daemon threads running jobs in order, at most `workers + queue_limit` admitted
    at once.

    Invariants: a job past the limit, or after `close`, is refused at once with a 503 (and
    Retry-After) without queueing; an admitted job holds its place until its function has
    returned, even when its caller stopped waiting (timeout, disconnect), so functions that
    cannot be interrupted still bound the pool's backlog; a job whose caller left before it
    started never runs; `run` returns the function's result or raises its exception.
    Event-loop side only, except the workers.
    """

    def __init__(self, name: str, workers: int, queue_limit: int):
        if workers < 1 or queue_limit < 0:
            raise ValueError(f"{name} pool: workers >= 1 and queue_limit >= 0, got {workers} and {queue_limit}")
        self.name, self.limit = name, workers + queue_limit
        self.admitted = 0
        self.closed = False
        self._waiting: set[_Job] = set()  # jobs whose caller still waits
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"moeferry-{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    async def run(self, fn: Callable[..., Any], *args, timeout: float | None = None) -> Any:
        """`fn(*args)` on a worker; asyncio.TimeoutError after `timeout` seconds (the function
        may still be running: it keeps its place until it returns)."""
        if self.closed:
            raise _shutting_down()
        if self.admitted >= self.limit:
            raise APIError(503, f"the server is busy ({self.name}: {self.admitted} requests in progress); retry "
                                f"shortly", code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), loop)
        self.admitted += 1
        self._waiting.add(job)
        self._jobs.put(job)
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        finally:
            job.abandoned = True  # a job not started yet is skipped; its place is released by the worker
            self._waiting.discard(job)

    def close(self) -> None:
        """Refuse new jobs and answer every waiting caller with the shutdown 503 now; queued
        jobs are not run, running ones are left to finish (their threads are daemons)."""
        self.closed = True
        for job in list(self._waiting):
            if not job.future.done():
                job.future.set_exception(_shutting_down())
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.abandoned or self.closed:
                self._settle(job, None, _shutting_down())
                continue
            try:
                result, error = job.fn(*job.args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                result, error = None, exc
            self._settle(job, result, error)
        while True:  # closed: what is still queued is answered, not run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._settle(job, None, _shutting_down())

    def _settle(self, job: _Job, result, error) -> None:
        try:
            job.loop.call_soon_threadsafe(self._done, job, result, error)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _done(self, job: _Job, result, error) -> None:
        self.admitted -= 1
        if job.future.done():
            return
        if job.abandoned:
            job.future.cancel()  # nobody reads it: no "exception never retrieved"
        elif error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")
