"""The routing trace file: every forward step's routed expert ids per MoE layer, exactly as the
MoE blocks handed them to their strategy (what the slot cache's `admit` sees, in admission
order), so a replay through the same admission reproduces the engine's.

Layout, little-endian:

    magic       8 bytes   b"MFROUTE\\n"
    length      uint32    bytes of the JSON header that follows
    header      UTF-8 JSON (TraceHeader): version, num_moe_layers L, num_experts E, top_k K,
                expert_bytes, id_dtype ("uint8" when E <= 256, else "uint16"), the model, its
                dtype, the strategy and device it was recorded under (decode in CUDA graphs or
                not), and its cache's slots and policy (offload only)
    steps, each one forward, in the order they ran:
      phase       uint8    0 decode, 1 prefill
      flags       uint8    bit 0 (demand): a prefill step whose routes the recording engine
                           admitted through its slot cache (offload's demand prefill); a
                           streamed prefill, and every prefill of gpu and uva, has it clear
      reserved    uint16   0
      num_tokens  uint32   the forward's live tokens (decode: its requests; prefill: its chunks')
      rows        uint32   token rows routed per layer: num_tokens, or more where a decode CUDA
                           graph padded the batch to its captured size (padding rows route too,
                           and the cache admits them)
      step_ms     float32  wall-clock milliseconds from the forward's start until the device
                           finished it (a decode step: its tokens sampled and read); NaN if not
                           timed
      ids         L x rows x K of id_dtype, layer-major, then token, then route

Invariants: every id is in [0, E); rows >= num_tokens >= 1; a file is never longer than its
writer's cap (`TraceWriter.max_bytes`); records are written whole and flushed one at a time, so
a file cut by a killed process reads up to its last whole step (`RoutingTrace.truncated`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import struct
from dataclasses import dataclass

import numpy as np

from moeferry.moe.stats import PHASES  # the admission's phases; a record stores the index, decode 0, prefill 1

logger = logging.getLogger(__name__)

MAGIC = b"MFROUTE\n"
VERSION = 1
DEFAULT_MAX_BYTES = 1 << 30  # the cap of --moe-record-routing: recording stops, with a warning, at 1 GiB
DEMAND = 1  # flags bit 0
_STEP = struct.Struct("<BBHIIf")
_LENGTH = struct.Struct("<I")


class TraceError(ValueError):
    """A file that is not a readable routing trace; the message names the file and what is wrong."""


def id_dtype_for(num_experts: int) -> str:
    """The narrowest unsigned type that holds every expert id."""
    if num_experts <= 256:
        return "uint8"
    if num_experts <= 65536:
        return "uint16"
    raise ValueError(f"a routing trace holds at most 65,536 experts per layer, got {num_experts}")


@dataclass(frozen=True)
class TraceHeader:
    """What a trace was recorded from: the routing's shape (layers, experts, top-k), the bytes
    one expert moves (over all its banks), and the run it came from, to say so when replayed."""

    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    model: str = ""
    dtype: str = ""
    strategy: str = ""
    device: str = ""
    cuda_graph: bool = False
    cache_slots: int | None = None
    cache_policy: str | None = None
    version: int = VERSION

    @property
    def id_dtype(self) -> str:
        return id_dtype_for(self.num_experts)

    def to_bytes(self) -> bytes:
        body = json.dumps({**dataclasses.asdict(self), "id_dtype": self.id_dtype}).encode()
        return MAGIC + _LENGTH.pack(len(body)) + body

    @classmethod
    def from_json(cls, raw) -> "TraceHeader":
        if not isinstance(raw, dict):
            raise ValueError("the header is not a JSON object")
        if raw.get("version") != VERSION:
            raise ValueError(f"format version {raw.get('version')!r}; this moeferry reads version {VERSION}")
        names = {f.name for f in dataclasses.fields(cls)}
        header = cls(**{k: v for k, v in raw.items() if k in names})
        for name in ("num_moe_layers", "num_experts", "top_k", "expert_bytes"):
            value = getattr(header, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"header field {name} must be a positive integer, got {value!r}")
        if not header.top_k <= header.num_experts or raw.get("id_dtype") != header.id_dtype:
            raise ValueError(f"top_k {header.top_k} of {header.num_experts} experts with ids as "
                             f"{raw.get('id_dtype')!r} is inconsistent")
        return header


@dataclass(frozen=True)
class TraceStep:
    """One forward: its phase, whether its prefill routes went through the recording engine's
    slot cache (`demand`), its live tokens, its wall-clock time and its ids [L, rows, K]."""

    phase: str
    demand: bool
    num_tokens: int
    step_ms: float
    ids: np.ndarray

    @property
    def rows(self) -> int:
        return self.ids.shape[1]

    @property
    def timed(self) -> bool:
        return not math.isnan(self.step_ms)


def encode_step(header: TraceHeader, step: TraceStep) -> bytes:
    """One step's record; ValueError if it breaks the format's invariants."""
    ids = np.asarray(step.ids)
    shape = (header.num_moe_layers, step.rows, header.top_k)
    if step.phase not in PHASES or ids.ndim != 3 or ids.shape != shape:
        raise ValueError(f"a {step.phase!r} step with ids {ids.shape}: want a phase of {PHASES} and ids {shape}")
    if not 1 <= step.num_tokens <= step.rows:
        raise ValueError(f"{step.num_tokens} live tokens over {step.rows} routed rows")
    if ids.size and not (0 <= ids.min() and ids.max() < header.num_experts):
        raise ValueError(f"expert ids outside [0, {header.num_experts}): {ids.min()} .. {ids.max()}")
    flags = DEMAND if step.demand else 0
    head = _STEP.pack(PHASES.index(step.phase), flags, 0, step.num_tokens, step.rows, step.step_ms)
    return head + ids.astype(header.id_dtype).tobytes()


class TraceWriter:
    """Writes a trace: the header when opened, then one whole record per `write`, flushed.

    Invariant: the file never exceeds `max_bytes`. The first step that would pass it ends the
    recording: it and every later step are dropped, and one warning says so."""

    def __init__(self, path: str, header: TraceHeader, max_bytes: int = DEFAULT_MAX_BYTES):
        head = header.to_bytes()
        if len(head) > max_bytes:
            raise ValueError(f"a cap of {max_bytes} bytes leaves no room for the trace's header")
        self.path, self.header, self.max_bytes = path, header, max_bytes
        self.file = open(path, "wb")  # noqa: SIM115 - open for the engine's life; closed by close()
        self.file.write(head)
        self.file.flush()
        self.size, self.steps, self.full = len(head), 0, False

    def write(self, step: TraceStep) -> bool:
        """Append one step; False (and nothing written) once the cap is reached."""
        if self.full:
            return False
        record = encode_step(self.header, step)
        if self.size + len(record) > self.max_bytes:
            self.full = True
            logger.warning("routing trace %s reached its cap of %.1f MiB after %d steps: recording stopped",
                           self.path, self.max_bytes / 2**20, self.steps)
            self.close()
            return False
        self.file.write(record)
        self.file.flush()
        self.size += len(record)
        self.steps += 1
        return True

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()


@dataclass
class RoutingTrace:
    """A trace read back: its header and steps (`truncated`: the file ended inside a record,
    which was dropped)."""

    header: TraceHeader
    steps: list[TraceStep]
    truncated: bool = False

    @classmethod
    def read(cls, path: str) -> "RoutingTrace":
        """The trace in `path`; TraceError naming the file if it is missing or not a trace."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise TraceError(f"cannot read routing trace {path!r}: {exc.strerror or exc}") from None
        try:
            header, offset = _read_header(data)
            steps, truncated = _read_steps(data, offset, header)
        except ValueError as exc:
            raise TraceError(f"{path} is not a routing trace: {exc}") from None
        if truncated:
            logger.warning("routing trace %s ends inside a step (the recording was cut): read its %d whole steps",
                           path, len(steps))
        return cls(header, steps, truncated)


def _read_header(data: bytes) -> tuple[TraceHeader, int]:
    if not data.startswith(MAGIC):
        raise ValueError("it does not start with the trace's magic bytes")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise ValueError("the header is cut short")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    try:
        raw = json.loads(data[start:start + length].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"its header is not JSON: {exc}") from None
    try:
        return TraceHeader.from_json(raw), start + length
    except TypeError as exc:
        raise ValueError(f"its header is malformed: {exc}") from None


def _read_steps(data: bytes, offset: int, header: TraceHeader) -> tuple[list[TraceStep], bool]:
    steps, dtype = [], np.dtype(header.id_dtype)
    while offset < len(data):
        if offset + _STEP.size > len(data):
            return steps, True
        phase, flags, _, num_tokens, rows, step_ms = _STEP.unpack_from(data, offset)
        count = header.num_moe_layers * rows * header.top_k
        end = offset + _STEP.size + count * dtype.itemsize
        if end > len(data):
            return steps, True
        if phase >= len(PHASES) or not 1 <= num_tokens <= rows:
            raise ValueError(f"step {len(steps)} is malformed (phase {phase}, {num_tokens} tokens over {rows} rows)")
        ids = np.frombuffer(data, dtype, count, offset + _STEP.size).reshape(header.num_moe_layers, rows, header.top_k)
        steps.append(TraceStep(PHASES[phase], bool(flags & DEMAND), num_tokens, step_ms, ids))
        offset = end
    return steps, False
