"""Several ranks serving one model: --tensor-parallel-size N (docs/multi_gpu.md).

One process per rank, started here with torch.multiprocessing (spawn). Every rank builds the
same engine from the same options and runs the same steps on the same inputs: attention, dense
layers, KV cache, scheduler and sampler are replicated, and only the routed experts are split
(moe/shard.py: each MoE layer adds the ranks' route outputs with one all-reduce).

Rank 0 drives: requests reach only its engine (`DriverEngine`, which answers as an `Engine`
does, so the offline API and the server take it unchanged). Before each step it broadcasts
the step's events (requests added with their prompt ids, sampling params and seed; aborts) to
the followers, and every rank then runs `Engine.step()`; `run_on_every_rank` runs a function
on every rank's engine between steps (benchmarks' forced routes, graph recapture).
Identical inputs and identical logits (the all-reduce is exact) keep the ranks in lockstep.

Two process groups: the default one (NCCL on GPUs, gloo on the CPU) reduces the experts'
outputs under a timeout; a gloo group carries the events, with no practical timeout, since a
follower may wait there for as long as the server is idle.

Failure: a follower that raises sends its error up its pipe and exits. Rank 0 checks that
every follower lives before each broadcast and after a step that raised, and then raises
`RankFailed`, one line naming the rank and why; the others are stopped (`close`, also run at
exit), so no rank outlives the run. A collective waiting on a dead rank fails at once on gloo
(the peer's connection closes); on NCCL it fails at the group's timeout at worst.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeferry.config import EngineConfig, first_line
from moeferry.engine.engine import Engine, StepOutput, configure
from moeferry.errors import EngineFailed
from moeferry.moe.shard import ExpertShard
from moeferry.sampling import SamplingParams
from moeferry.scheduler.request import Request
from moeferry.threads import engine_threads

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600  # the experts' group: a rank waits this long for the slowest one
_EVENTS_TIMEOUT = datetime.timedelta(days=365)  # the events' group: followers wait while rank 0 idles
_POLL_S = 0.1


class RankFailed(EngineFailed):
    """A rank died or raised: the run cannot go on (every rank is stopped)."""


@dataclass
class _Follower:
    rank: int
    process: mp.Process
    conn: object  # rank 0's end of the follower's pipe: ("ready", None) or ("error", one line)
    error: str | None = None


def create_engine(ec: EngineConfig) -> Engine:
    """The engine `ec` asks for: one process, or under --tensor-parallel-size N the driver of
    N ranks, which answers as one engine does."""
    return Engine(ec) if ec.tensor_parallel_size == 1 else start_ranks(ec)


def start_ranks(ec: EngineConfig, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "DriverEngine":
    """Check the options, start the followers (ranks 1 .. N-1), join the process groups and
    build rank 0's engine; ConfigError before any process starts, RankFailed if a rank fails."""
    resolved, _, _ = configure(ec)
    follower_ec = resolved.replace(revision=None)  # `model` is now the snapshot's directory
    world, port = ec.tensor_parallel_size, _free_port()
    ctx = mp.get_context("spawn")
    followers = []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=_follow, args=(follower_ec, rank, world, port, timeout_s, theirs),
                              name=f"moeferry-rank{rank}", daemon=True)
        process.start()
        theirs.close()
        followers.append(_Follower(rank, process, ours))
    ranks = Ranks(followers)
    try:
        ranks.shard, ranks.events_group = ranks.wait(lambda: _join(resolved, 0, world, port, timeout_s),
                                                     "joining the process group")
        return DriverEngine(ec, ranks)
    except BaseException:
        ranks.close()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(ec: EngineConfig, rank: int, world: int, port: int, timeout_s: float):
    """Join both process groups as `rank`: (this rank's ExpertShard, the events' group)."""
    cuda = ec.torch_device.type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # (rank 0's thread: device 0, every thread's default)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", rank) if cuda else None)
    events_group = dist.new_group(backend="gloo", timeout=_EVENTS_TIMEOUT)
    return ExpertShard(rank, world), events_group


class Ranks:
    """Rank 0's hold on the followers: their processes and pipes, and the events' group."""

    def __init__(self, followers: list[_Follower]):
        self.followers = followers
        self.shard: ExpertShard | None = None
        self.events_group = None
        self.closed = False
        atexit.register(self.close)

    def check(self, grace_s: float = 0.0) -> None:
        """RankFailed (one line) if a follower has died or reported an error, watching for
        `grace_s` more seconds (after a collective failed: its peer may be still exiting)."""
        deadline = time.monotonic() + grace_s
        while True:
            self._check_now()
            if time.monotonic() >= deadline:
                return
            time.sleep(_POLL_S)

    def _check_now(self) -> None:
        for f in self.followers:
            self._read(f)
            if f.error is not None or not f.process.is_alive():
                raise RankFailed(f"rank {f.rank} of {len(self.followers) + 1} (pid {f.process.pid}) "
                                 f"{self._why(f)}: the run cannot go on, every rank is stopped")

    @staticmethod
    def _read(f: _Follower) -> str | None:
        """The follower's next message, if one is waiting (errors are kept on `f`)."""
        try:
            if not f.conn.poll():
                return None
            kind, text = f.conn.recv()
        except (EOFError, OSError):
            return None
        if kind == "error":
            f.error = text
        return kind

    @staticmethod
    def _why(f: _Follower) -> str:
        if f.error is not None:
            return f"raised {f.error}"
        f.process.join(timeout=1.0)
        code = f.process.exitcode
        if code is not None and code < 0:
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def wait(self, work, what: str):
        """`work()` run in a thread while the followers are watched: its result, or RankFailed
        as soon as one dies (rather than waiting out a timeout)."""
        result, error = [], []

        def run():
            try:
                result.append(work())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                error.append(exc)

        thread = threading.Thread(target=run, name=f"moeferry {what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive():
                self.check()
        if error:
            self.check()
            raise error[0]
        return result[0]

    def wait_ready(self) -> None:
        """Until every follower has built its engine (RankFailed if one fails first)."""
        waiting = set(range(len(self.followers)))
        while waiting:
            for i in sorted(waiting):
                if self._read(self.followers[i]) == "ready":
                    waiting.discard(i)
            self.check()
            if waiting:
                time.sleep(_POLL_S)

    def broadcast(self, events: list | None, step: bool = True) -> None:
        """Events to every follower, then a step unless `step` is False (None: stop)."""
        self.check()
        dist.broadcast_object_list([None if events is None else (events, step)], src=0, group=self.events_group)

    def close(self) -> None:
        """Stop every follower (asked first when all live, else terminated) and leave the groups."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        alive = all(f.process.is_alive() and f.error is None for f in self.followers)
        if alive and self.events_group is not None:
            try:
                dist.broadcast_object_list([None], src=0, group=self.events_group)
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.debug("could not ask the followers to stop", exc_info=True)
        for f in self.followers:
            f.process.join(timeout=10.0 if alive else 0.5)
            if f.process.is_alive():
                f.process.terminate()
                f.process.join(timeout=5.0)
            if f.process.is_alive():
                f.process.kill()
                f.process.join()
            f.conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group with a dead rank may not tear down cleanly
                logger.debug("could not destroy the process group", exc_info=True)


class DriverEngine(Engine):
    """Rank 0's engine: an `Engine` whose requests, aborts and steps the followers repeat
    (module docstring). `close()` stops the followers; after a step that raised, the ranks
    are out of step and every later step raises."""

    def __init__(self, ec: EngineConfig, ranks: Ranks):
        self.ranks = ranks
        self._events: list[tuple] = []
        self._broken: str | None = None
        super().__init__(ec, ranks.shard)
        ranks.wait_ready()

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        req = super().add_request(prompt, params)
        # the seed drawn for an unseeded request goes along: every rank samples the same token
        self._events.append(("add", req.rid, list(req.prompt_ids), dataclasses.replace(params, seed=req.seed)))
        return req

    def abort(self, req: Request) -> None:
        if not req.finished:
            self._events.append(("abort", req.rid))
        super().abort(req)

    def run_on_every_rank(self, fn, *args):
        """`fn(engine, *args)` on every rank's engine at once, with no step (`fn` is pickled: a
        module-level function; it may run collectives, such as recapturing the decode graphs);
        this rank's result."""
        events, self._events = [*self._events, ("call", fn, args)], []
        self.ranks.broadcast(events, step=False)
        return fn(self, *args)

    def step(self) -> list[StepOutput]:
        if self._broken is not None:
            raise RankFailed(f"the ranks stopped after an earlier failure: {self._broken}")
        events, self._events = self._events, []
        try:
            self.ranks.broadcast(events)
            return super().step()
        except BaseException as exc:
            self._broken = first_line(exc)
            try:
                self.ranks.check(grace_s=2.0)
            except RankFailed as failed:
                self._broken = str(failed)
                self.ranks.close()
                raise failed from exc
            self.ranks.close()
            raise

    def close(self) -> None:
        self.ranks.close()


def _follow(ec: EngineConfig, rank: int, world: int, port: int, timeout_s: float, conn) -> None:
    """A follower's process: join, build the engine, then repeat rank 0's events and steps
    until told to stop. Any error goes up the pipe in one line before the process exits."""
    try:
        shard, events_group = _join(ec, rank, world, port, timeout_s)
        engine = Engine(ec, shard)
        conn.send(("ready", None))
        with engine_threads():
            _repeat(engine, events_group)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this process ends
        try:
            conn.send(("error", f"{type(exc).__name__}: {first_line(exc)}"))
        finally:
            os._exit(1)


def _repeat(engine: Engine, events_group) -> None:
    requests: dict[int, Request] = {}  # rank 0's request id -> this rank's copy
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=events_group)
        if box[0] is None:
            return
        events, step = box[0]
        for event in events:
            if event[0] == "add":
                _, rid, prompt_ids, params = event
                requests[rid] = engine.add_request(prompt_ids, params)
            elif event[0] == "abort":
                req = requests.pop(event[1], None)
                if req is not None:
                    engine.abort(req)
            else:
                _, fn, args = event
                fn(engine, *args)
        if step:
            engine.step()
        for rid in [rid for rid, req in requests.items() if req.finished]:
            del requests[rid]
