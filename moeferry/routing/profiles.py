"""Generated routing: routes drawn as real models route, for benchmarks of weights nobody
trained (``--load-format dummy``), whose own routers choose almost uniformly.

A profile (`RoutingProfile`, registered in `PROFILES`) has three parts:

- popularity: Zipf over a layer's experts, p_e proportional to (rank_e + 1) ** -s, the ranks a
  random permutation per layer, the exponent s spread evenly over `zipf` across the layers
  (in a random layer order), so some layers are skewed and others flat;
- context: each row (a request) prefers its own experts, log-normally: log p_e plus
  `context` x N(0, 1) fixed per (row, layer, expert). Over many requests the popularity stays
  p's; within one request's tokens far fewer experts are used (a per-layer LRU of 64% of the
  experts hits 96% over a cold 256 tokens, so one request touches under 82 of 128);
- locality: each of the previous token's experts (same row, same layer) is kept with
  probability `keep`; the token's other slots are drawn without replacement.

`RouteGenerator` draws every layer's routes of a forward at once, on the routes' device, with
fixed shapes and no host sync, so it runs inside a captured decode graph (one kernel on a GPU:
kernels/generated_routes, whose contract is this draw):

    scores[l, t, e] = log p[l, e] + context * Normal(l, t, e) + Gumbel(step, l, t, e)
                    + BIG where e is one of row t's previous experts at layer l and its
                      keep draw passed
    routes[l, t]    = the top_k of scores[l, t] (Gumbel top-k: a draw without replacement),
                      ordered by their scores without the bonus, as a router orders them

The random numbers are a counter hash (`uniforms`) of (seed, step counter, layer, row, expert),
not torch's generator: the same seed gives the same routes on every strategy, every device (but
for scores within a rounding of each other) and whatever else draws random numbers in between.
The state is the routes themselves: `routes` [L, max_rows, K] is a static buffer, rewritten in
place by each forward, so row t's next token is drawn from row t's last one (a decode row
follows its request; a prefill's tokens are rows of their own, so a chunk's tokens are no more
local than separate requests).

The figures a profile is fitted to (SPEC section 6) are its `targets`; tests/routing holds the
generator to them. `oracle_prediction` (and `OraclePredictor`, its graph-ready form) is the
next-layer predictor a prefetcher gets under generated routes, which carry no hidden state:
each true id kept with a stated recall, the others replaced by wrong ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np
import torch

from moeferry.kernels.generated_routes import MASK32, draw_routes, hash32, oracle_predict, uniforms

_SCORE_BUDGET = 1 << 22  # elements of one chunk of scores; a long prefill is drawn a few layers at a time


@dataclass(frozen=True)
class ProfileTargets:
    """Published statistics of a model's decode routing (SPEC section 6), each with the
    tolerance the calibration test allows. `lru` maps a share of a layer's experts resident
    to the hit rate of a per-layer LRU cache of that many slots (cold, batch 1, `tokens`
    tokens, every route an access in order); `reuse` is the share of a token's experts that
    the previous token of the same layer used; `top16` the range of the share of a layer's
    selections its 16 most chosen experts take (for 128 experts)."""

    reuse: float
    lru: dict[float, float]
    top16: tuple[float, float] | None = None
    tokens: int = 256
    source: str = ""


@dataclass(frozen=True)
class RoutingProfile:
    """A routing model (see the module): Zipf exponents spread over `zipf` (min, max) across
    the layers, a per-slot `keep` probability from the previous token, and the spread
    `context` of each row's log-normal preference."""

    name: str
    zipf: tuple[float, float]
    keep: float
    context: float
    description: str
    targets: ProfileTargets | None = field(default=None, compare=False)


PROFILES: dict[str, RoutingProfile] = {}


def register(profile: RoutingProfile) -> RoutingProfile:
    PROFILES[profile.name] = profile
    return profile


def names() -> list[str]:
    return list(PROFILES)


def get_profile(name: str) -> RoutingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown routing profile {name!r}; choose from {', '.join(PROFILES)}") from None


UNIFORM = register(RoutingProfile(
    "uniform", (0.0, 0.0), 0.0, 0.0,
    "every token's top-k drawn uniformly without replacement, independent of the previous token "
    "(the worst case for a cache: hit rate = the share of experts resident)"))
QWEN3 = register(RoutingProfile(
    "qwen3", (0.85, 1.35), 0.15, 1.8,
    "generated, calibrated to Qwen3-30B-A3B's published decode routing (45% reuse from the previous "
    "token; per-layer LRU 37/74/89/96% at 6/19/38/64% resident; top 16 of 128 experts take 33-55%)",
    ProfileTargets(reuse=0.45, lru={0.06: 0.37, 0.19: 0.74, 0.38: 0.89, 0.64: 0.96}, top16=(0.33, 0.55),
                   source="kekzl/imp PRs #1359, #1374; a 48x128 activation table of Qwen3-30B-A3B-Base")))
MIXTRAL = register(RoutingProfile(
    "mixtral", (0.2, 0.8), 0.08, 0.5,
    "generated, calibrated to Mixtral-8x7B's published decode routing (37% reuse from the previous "
    "token; per-layer LRU 32/46/59/70/80% with 2-6 of 8 experts resident)",
    ProfileTargets(reuse=0.37, lru={2 / 8: 0.32, 3 / 8: 0.46, 4 / 8: 0.59, 5 / 8: 0.70, 6 / 8: 0.80},
                   source="Eliseev & Mazur 2023, Mixtral-8x7B offloading")))


# ---- the counter hash (kernels/generated_routes holds the hash and its uniforms) ----------------
def index_keys(seed: int, salt: int, shape: tuple[int, ...], offsets: tuple[int, ...],
               device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 keys in [0, 2^32) of `shape`: a hash of (`seed`, `salt`, each element's index
    along every dimension plus `offsets`). Fixed for a seed: static buffers may hold them."""
    key = torch.tensor(hash32((seed * 0x9E3779B1 + salt * 0x6A09E667) & MASK32), device=device)
    for dim, (size, offset) in enumerate(zip(shape, offsets)):
        index = torch.arange(offset, offset + size, device=device, dtype=torch.int64)
        key = hash32((key + index.view([size if d == dim else 1 for d in range(len(shape))]) * 0x5851F42D
                       + 0x14057B7E) & MASK32)
    return key


def first_key(seed: int, salt: int) -> int:
    """The key of a stream's first draw (`advance` gives the next ones)."""
    return hash32((seed * 0x3C6EF372 + salt * 0x1B873593 + 1) & MASK32)


def advance(key: torch.Tensor) -> None:
    """The next draw's key, in place (a linear congruential step: three small kernels, graph-safe)."""
    key.mul_(0x41C64E6D).add_(0x3039).bitwise_and_(MASK32)


def normal(u: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)


# ---- popularity -------------------------------------------------------------------------------
def layer_popularity(profile: RoutingProfile, num_layers: int, num_experts: int, seed: int) -> torch.Tensor:
    """[L, E] float64 expert probabilities of each layer (see the module): exponents spread
    evenly over profile.zipf in a random layer order, ranks a random permutation per layer."""
    rng = np.random.default_rng(seed)
    lo, hi = profile.zipf
    exponents = np.linspace(lo, hi, num_layers) if num_layers > 1 else np.array([(lo + hi) / 2])
    exponents = rng.permutation(exponents)
    ranks = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])
    pop = (ranks + 1.0) ** -exponents[:, None]
    return torch.from_numpy(pop / pop.sum(axis=1, keepdims=True))


_GUMBEL, _KEEP, _CONTEXT, _WRONG, _ORACLE_KEEP = range(5)  # salts: one independent stream each


class RouteGenerator:
    """Draws every layer's routes of one forward (see the module) into static device buffers.

    `routes` [L, max_rows, K] int64: row t of each layer's latest routes, also the state the
    next forward keeps from. `counter` [1] int64, the draw's key, advances once per forward. `generate(rows)`
    rewrites rows [0, rows) of every layer and returns that view; nothing a captured graph
    keeps is allocated, and nothing is read back to the host. For forwards of at most
    `decode_rows` rows (default min(max_rows, 256)) the fixed part of the scores and the hash
    keys are static buffers, so a decode step's draw is one kernel on a GPU
    (kernels/generated_routes) and the counter's advance; a wider forward (a prefill chunk,
    eager) computes them, the same values.

    Invariants: each row's K ids of a layer are distinct and in [0, E); the same seed and the
    same sequence of `generate` calls give the same routes on every strategy of a device (and
    on every device but where two float32 scores lie within a rounding of each other: events of
    probability ~0).
    """

    def __init__(self, profile: RoutingProfile, num_layers: int, num_experts: int, top_k: int, max_rows: int,
                 device: torch.device | str = "cpu", seed: int = 0, decode_rows: int | None = None):
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} of {num_experts} experts")
        self.profile, self.num_layers, self.num_experts, self.top_k = profile, num_layers, num_experts, top_k
        self.max_rows, self.seed, self.device = max_rows, seed & MASK32, device
        self.log_pop = layer_popularity(profile, num_layers, num_experts, seed).log().float().to(device)
        self.counter = torch.tensor([first_key(seed, _GUMBEL)], dtype=torch.int64, device=device)
        self.routes = torch.zeros((num_layers, max_rows, top_k), dtype=torch.int64, device=device)
        self.decode_rows = min(max_rows, 256) if decode_rows is None else min(max_rows, decode_rows)
        rows = self.decode_rows
        self._fixed_static = self._compute_fixed(0, num_layers, rows)
        self._gumbel_keys = index_keys(self.seed, _GUMBEL, (num_layers, rows, num_experts), (0, 0, 0), device)
        self._keep_keys = index_keys(self.seed, _KEEP, (num_layers, rows, top_k), (0, 0, 0), device)
        self._draw(max_rows, keep=False)  # a first token for every row, kept from nothing

    def generate(self, rows: int) -> torch.Tensor:
        """The next forward's routes of `rows` rows, every layer: a view [L, rows, K] of `routes`."""
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"a forward of {rows} rows exceeds the routing generator's {self.max_rows}")
        self._draw(rows, keep=self.profile.keep > 0)
        return self.routes[:, :rows]

    def _compute_fixed(self, a: int, b: int, rows: int) -> torch.Tensor:
        """log popularity plus each row's context preference, [b - a, rows, E] float32."""
        fixed = self.log_pop[a:b, None, :].expand(b - a, rows, self.num_experts)
        if not self.profile.context:
            return fixed.contiguous()
        keys = index_keys(self.seed, _CONTEXT, (b - a, rows, self.num_experts), (a, 0, 0), self.device)
        return fixed + self.profile.context * normal(uniforms(keys))

    def _parts(self, a: int, b: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fixed scores, Gumbel keys, keep keys) of layers [a, b) and rows [0, rows)."""
        if rows <= self.decode_rows:
            return (self._fixed_static[a:b, :rows], self._gumbel_keys[a:b, :rows], self._keep_keys[a:b, :rows])
        return (self._compute_fixed(a, b, rows),
                index_keys(self.seed, _GUMBEL, (b - a, rows, self.num_experts), (a, 0, 0), self.device),
                index_keys(self.seed, _KEEP, (b - a, rows, self.top_k), (a, 0, 0), self.device))

    def _draw(self, rows: int, keep: bool) -> None:
        layers, e = self.num_layers, self.num_experts
        chunk = max(1, min(layers, _SCORE_BUDGET // max(1, rows * e)))
        for a in range(0, layers, chunk):  # a new stream per forward: the counter is the draw's step key
            b = min(layers, a + chunk)
            fixed, gumbel_keys, keep_keys = self._parts(a, b, rows)
            draw_routes(fixed, gumbel_keys, keep_keys, self.counter, self.routes[a:b, :rows],
                        self.profile.keep if keep else 0.0)
        advance(self.counter)


def _check_oracle(num_experts: int, top_k: int, recall: float, width: int) -> None:
    if not top_k <= width <= num_experts - top_k:  # room for width wrong ids when every true one is dropped
        raise ValueError(f"an oracle of {width} predictions at top-{top_k} needs {top_k} to "
                         f"{num_experts - top_k} of them, over {num_experts} experts")
    if not 0.0 <= recall <= 1.0:
        raise ValueError(f"recall {recall} outside [0, 1]")


def oracle_prediction(true_ids: torch.Tensor, num_experts: int, recall: float, step: torch.Tensor,
                      width: int | None = None, seed: int = 0) -> torch.Tensor:
    """A predictor of stated recall for routes that carry no hidden state: true_ids [..., T, K]
    (distinct per row) -> predicted ids [..., T, width] (default K), distinct per row. Each true
    id is kept with probability `recall` (independently, so recall is `recall` in expectation);
    the other width - kept slots hold ids outside the row's true set, drawn uniformly: the
    false positives, as many as the true ids dropped when width == K. `step` (an int64 tensor
    in [0, 2^32)) keys the draw. Kept ids come first, in their order in true_ids. Eager: it
    builds its hash keys (`OraclePredictor` holds them in static buffers, for a graph)."""
    k = true_ids.shape[-1]
    width = k if width is None else width
    _check_oracle(num_experts, k, recall, width)
    lead = tuple(true_ids.shape[:-1])
    zeros = (0,) * (len(lead) + 1)
    wrong_keys = index_keys(seed, _WRONG, (*lead, num_experts), zeros, true_ids.device)
    keep_keys = index_keys(seed, _ORACLE_KEEP, (*lead, k), zeros, true_ids.device)
    rows = [t.reshape(1, -1, t.shape[-1]) for t in (wrong_keys, keep_keys, true_ids.long())]
    return oracle_predict(*rows[:2], step, rows[2], recall, width).reshape(*lead, width)


class OraclePredictor:
    """`oracle_prediction` of every layer of a forward at once, for a prefetcher inside a
    decode graph: `predict(routes)` with routes [L, T, K] (a RouteGenerator's) -> [L, T, width],
    a fresh draw each call (its key `counter` advanced in place). For T <= `static_rows` the
    hash keys are static buffers (one kernel a call on a GPU, and the counter's advance);
    wider calls build them (eager), the same values."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, recall: float, static_rows: int,
                 width: int | None = None, device: torch.device | str = "cpu", seed: int = 0):
        self.num_experts, self.top_k, self.recall, self.seed = num_experts, top_k, recall, seed
        self.width = top_k if width is None else width
        _check_oracle(num_experts, top_k, recall, self.width)
        self.counter = torch.tensor([first_key(seed, _WRONG)], dtype=torch.int64, device=device)
        self.static_rows = static_rows
        self._wrong = index_keys(seed, _WRONG, (num_layers, static_rows, num_experts), (0, 0, 0), device)
        self._keep = index_keys(seed, _ORACLE_KEEP, (num_layers, static_rows, top_k), (0, 0, 0), device)

    def predict(self, routes: torch.Tensor) -> torch.Tensor:
        """routes [L, T, K] -> predicted ids [L, T, width] (see oracle_prediction)."""
        t = routes.shape[1]
        if t > self.static_rows:
            ids = oracle_prediction(routes, self.num_experts, self.recall, self.counter, self.width, self.seed)
        else:
            ids = oracle_predict(self._wrong[:, :t], self._keep[:, :t], self.counter, routes, self.recall,
                                 self.width)
        advance(self.counter)
        return ids


# ---- what the targets measure ----------------------------------------------------------------
def lru_hit_rate(ids: np.ndarray, slots: int) -> float:
    """Hit rate of an LRU cache of `slots` experts fed one layer's routes ids [T, K] in order
    (every id an access; a miss evicts the least recently used), starting empty."""
    from collections import OrderedDict

    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for expert in ids.reshape(-1).tolist():
        if expert in cache:
            hits += 1
            cache.move_to_end(expert)
        else:
            cache[expert] = None
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits / ids.size


def reuse(ids: np.ndarray) -> float:
    """Share of a token's experts the previous token used: ids [T, K] of one layer, one row."""
    prev, cur = ids[:-1], ids[1:]
    return float((cur[:, :, None] == prev[:, None, :]).any(axis=2).mean())


def top_share(ids: np.ndarray, num_experts: int, top: int) -> float:
    """Share of a layer's selections (ids [T, K]) its `top` most chosen experts take."""
    counts = np.bincount(ids.reshape(-1), minlength=num_experts)
    return float(np.sort(counts)[::-1][:top].sum() / counts.sum())


def lru_slots(share: float, num_experts: int) -> int:
    """The slots of a per-layer LRU holding `share` of the layer's experts (at least one)."""
    return max(1, int(round(share * num_experts)))


@dataclass(frozen=True)
class Calibration:
    """A generated stream's statistics, averaged over layers (see ProfileTargets)."""

    reuse: float
    lru: dict[float, float]
    top16: tuple[float, float] | None


def calibrate(profile: RoutingProfile, num_layers: int, num_experts: int, top_k: int, tokens: int,
              seed: int = 0, shares=None) -> Calibration:
    """Generate one row's `tokens` decode tokens under `profile` and measure them: reuse, the
    per-layer LRU hit rate at each share of `shares` (default the profile's targets), and the
    range over layers of the top 16 experts' share of a long stream (None under 16 experts)."""
    shares = shares if shares is not None else (profile.targets.lru if profile.targets else (0.25, 0.5))
    gen = RouteGenerator(profile, num_layers, num_experts, top_k, max_rows=1, seed=seed)
    ids = torch.stack([gen.generate(1)[:, 0].clone() for _ in range(tokens)], dim=1).numpy()  # [L, T, K]
    lru = {s: float(np.mean([lru_hit_rate(ids[l], lru_slots(s, num_experts)) for l in range(num_layers)]))
           for s in shares}
    reused = float(np.mean([reuse(ids[l]) for l in range(num_layers)]))
    top16 = None
    if num_experts > 16:
        # popularity skew over many tokens: independent rows of one long forward
        wide = RouteGenerator(profile, num_layers, num_experts, top_k, max_rows=4096, seed=seed).generate(4096)
        shares16 = [top_share(wide[l].numpy(), num_experts, 16) for l in range(num_layers)]
        top16 = (min(shares16), max(shares16))
    return Calibration(reused, lru, top16)


def describe(c: Calibration) -> str:
    lru = ", ".join(f"{s:.0%}: {h:.2f}" for s, h in c.lru.items())
    top = "" if c.top16 is None else f"; top-16 share {c.top16[0]:.2f}-{c.top16[1]:.2f}"
    return f"reuse {c.reuse:.2f}; LRU hit {lru}{top}"



# ---- a generated trace, for `moeferry routing simulate` ---------------------------------------
QWEN3_30B_EXPERT_BYTES = 3 * 2048 * 768 * 2  # one Qwen3-30B-A3B expert in bf16: gate, up and down


def write_trace(path: str, profile: RoutingProfile, num_layers: int, num_experts: int, top_k: int, tokens: int,
                rows: int = 1, seed: int = 0, expert_bytes: int = QWEN3_30B_EXPERT_BYTES) -> int:
    """Write `tokens` decode steps of `rows` requests under `profile` as a routing trace
    (trace.py; untimed steps, the model named `generated:PROFILE`), as a recorded one
    replays; returns the steps written."""
    from moeferry.routing.trace import TraceHeader, TraceStep, TraceWriter

    header = TraceHeader(num_layers, num_experts, top_k, expert_bytes, model=f"generated:{profile.name}")
    gen = RouteGenerator(profile, num_layers, num_experts, top_k, max_rows=rows, seed=seed)
    writer = TraceWriter(path, header)
    try:
        for _ in range(tokens):
            if not writer.write(TraceStep("decode", False, rows, float("nan"), gen.generate(rows).numpy())):
                break
    finally:
        writer.close()
    return writer.steps
