"""Engine: the step loop that joins the scheduler, the model runner and the sampler.

`add_request` checks and queues a request; `step` runs one scheduler step (prefill chunks and
one decode token for every running request) and returns the requests that produced output.
Not thread-safe: one thread drives it (the server runs it in its own thread).

Async scheduling: while every running request decodes and nothing waits to be admitted, a
step launches the next decode step before it reads the tokens of the one in flight (the device
copies them into the new step's inputs), then reads and emits those: the host's work between
steps (reading, detokenising, stop strings, staging) runs while the device computes. A request
whose token in flight is its max_tokens-th is left out of the next step; one that ends on a
token only the host can judge (an end token, a stop string) or is aborted has one more step
computed for it, whose token is dropped. Its KV pages and sampler slot are freed at once, which
is safe because everything after on the device is ordered behind that step. Any other step
(an admission or a prefill, token masks, log-probs, a pool short of pages) first reads the step
in flight, then runs as planned.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from moeferry.config import EngineConfig, ModelConfig
from moeferry.engine.runner import DecodeLaunch, ModelRunner
from moeferry.engine.sampler import TokenLogprobs
from moeferry.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, GenerationDefaults, InvalidRequest, SamplingParams
from moeferry.scheduler.request import Request, Status
from moeferry.scheduler.scheduler import Scheduler
from moeferry.tokenizer.tokenizer import IncrementalDetokenizer, load_tokenizer, use_chat_template

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one request got in one step: new token ids, new text, and whether it finished
    (`error` says why, when it failed: its finish_reason is then "error"); `logprobs`, one
    per new token, when the request asked for them; `prompt_logprobs` (Request's) with the
    first token of a request that asked for them."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    finished: bool
    error: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list | None = None


def log_finished(req: Request) -> None:
    """One INFO line for a request that ended (however it ended): its id, token counts, finish
    reason, time to first token (from when the engine accepted it) and decode speed (the tokens
    after the first over the time since the first; "-" when there is no such span)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    now, first, n = time.monotonic(), req.first_token_time, len(req.output_ids)
    ttft = "-" if first is None else f"{(first - req.arrival) * 1e3:.1f} ms"
    speed = f"{(n - 1) / (now - first):.1f} tok/s" if first is not None and n > 1 and now > first else "-"
    logger.info("request %d finished: %d prompt tokens, %d output tokens, finish_reason %s, TTFT %s, decode %s",
                req.rid, len(req.prompt_ids), n, req.finish_reason, ttft, speed)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def configure(ec: EngineConfig) -> tuple[EngineConfig, ModelConfig, str]:
    """(options checked and fitted to the model, with `model` its directory; the model's
    config; the model's name): ConfigError before anything heavy is built."""
    from moeferry.model_source import resolve_model

    ec.check()  # every option alone, before even the default model is made
    source = resolve_model(ec.model, ec.revision)
    mc = ModelConfig.from_dir(source.path, ec.hf_overrides)
    return ec.replace(model=source.path).check(mc), mc, source.name


class Engine:
    """Invariants: every request `add_request` accepted ends finished (EOS, stop string or
    token, max_tokens), aborted, or failed, and its KV pages go back to the pool when it does.
    A request fails alone: what one request's values can still break inside a step (its
    sampling, its detokenisation) fails that request, and the others' tokens are the ones
    they would have had without it."""

    def __init__(self, ec: EngineConfig, shard=None):
        """`shard`: this rank's share of the routed experts (moe/shard.py) when the engine is
        one of several ranks (engine/ranks.py builds those); None: every expert."""
        from moeferry.model_source import resolve_model

        ec, mc, self.model_name = configure(ec)
        model_dir = ec.model
        self.generation = GenerationDefaults.load(model_dir, ec.generation_config, ec.override_generation_config)
        self.ec, self.mc = ec, mc
        self.tokenizer = load_tokenizer(resolve_model(ec.tokenizer).path if ec.tokenizer else model_dir)
        if ec.chat_template is not None:  # before the weights: a template that fails costs no loading
            use_chat_template(self.tokenizer, ec.chat_template)
        t0 = time.monotonic()
        self.runner = ModelRunner(ec, mc, shard)
        logger.info("model %s (%s, %d layers, %d experts, top-%d) loaded in %.1fs: strategy %s, dtype %s, device %s",
                    model_dir, mc.model_type, mc.num_layers, mc.num_experts, mc.top_k, time.monotonic() - t0,
                    ec.moe_strategy, str(self.runner.dtype).replace("torch.", ""), self.runner.device)
        self.scheduler = Scheduler(self.runner.kv.pool, ec.page_size, ec.max_running_requests, ec.max_prefill_tokens,
                                   self.runner.max_model_len, prefix_caching=ec.enable_prefix_caching)
        self.eos_ids = set(mc.eos_token_ids) | {i for i in self.generation.eos_token_ids if i < mc.vocab_size}
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._in_flight: DecodeLaunch | None = None  # a decode step launched, its tokens not read
        self._grammars = None  # GrammarCompiler, made at the first structured request
        self._grammars_lock = threading.Lock()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0,
                         "requests_aborted": 0, "requests_failed": 0, "prefill_tokens": 0, "decode_tokens": 0,
                         "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0}

    # ---- requests --------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: pass token ids", "prompt")
        return list(self.tokenizer.encode(prompt))

    def grammar_compiler(self):
        """The structured output compiler of this model's tokenizer and vocabulary, its end
        tokens the grammars' (moeferry.structured.GrammarCompiler; made once, on first use:
        xgrammar's import and tokenizer tables cost seconds). Thread-safe: the server calls it
        from worker threads."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequest("this model has no tokenizer: structured output needs one", "response_format")
                from moeferry.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.mc.vocab_size, sorted(self.eos_ids))
            return self._grammars

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        """Check a request and queue it; InvalidRequest (naming the field) if it cannot run.
        Sampling values `params` leaves unset take the model's generation_config.json ones."""
        params = params.with_defaults(self.generation.sampling)
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_token_ids("prompt", ids)
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", list(params.logit_bias or ()))
        grammar = None
        if params.structured is not None:
            grammar = self.grammar_compiler().matcher(params.structured)
            if params.reasoning_tags is not None:
                from moeferry.structured import ReasoningGate

                grammar = ReasoningGate(grammar, params.reasoning_tags)
        req = Request(ids, params, grammar=grammar)
        if params.min_tokens:
            req.params_after_min, req.params = req.params, self._ends_blocked(req.params)
        self.scheduler.add(req)
        self._detok[req.rid] = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                                      params.spaces_between_special_tokens)
        self.counters["prompt_tokens"] += len(ids)
        return req

    def _ends_blocked(self, params: SamplingParams) -> SamplingParams:
        """`params` whose logit_bias keeps the sampler off the end and stop tokens (min_tokens)."""
        ends = self.eos_ids | set(params.stop_token_ids)
        bias = {**(params.logit_bias or {}), **{t: LOGIT_BIAS_RANGE[0] for t in ends}}
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"min_tokens blocks {len(bias)} tokens with logit_bias's, at most {MAX_LOGIT_BIAS}: "
                                 f"give fewer stop_token_ids or logit_bias entries", "min_tokens")
        return dataclasses.replace(params, logit_bias=bias)

    def _check_token_ids(self, param: str, ids: list[int]) -> None:
        vocab_size = self.mc.vocab_size  # read once: each read goes through the transformers config
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)

    def abort(self, req: Request) -> None:
        if req.finished:
            return
        self._finish(req, "abort")

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.scheduler.free(req)
        self.runner.sampler.release(req)
        self._detok.pop(req.rid, None)
        counter = {"abort": "requests_aborted", "error": "requests_failed"}.get(reason, "requests_finished")
        self.counters[counter] += 1
        log_finished(req)

    def _fail(self, req: Request, what: str) -> StepOutput:
        """End `req` alone after its own step work raised (the caller logged the traceback)."""
        self._finish(req, "error")
        return StepOutput(req, [], "", True, error=f"internal error in {what}; see the server log")

    def stats(self, include_moe: bool = True) -> dict:
        """A plain-Python snapshot: requests, token counters (cumulative; the prefix cache's
        queried and hit tokens among them), KV page use (pages held by requests, and those
        holding a cached prefix), and the MoE strategy's own figures under "moe" (may sync the
        device: leave out on hot paths)."""
        sched, pool = self.scheduler, self.scheduler.pool
        used = pool.num_pages - pool.free_pages
        out = {
            "requests": {"running": len(sched.running), "waiting": len(sched.waiting),
                         "finished": self.counters["requests_finished"], "aborted": self.counters["requests_aborted"],
                         "failed": self.counters["requests_failed"], "preemptions": sched.num_preemptions},
            "tokens": {k: self.counters[k] for k in ("prompt_tokens", "generation_tokens", "prefill_tokens",
                                                      "decode_tokens", "prefix_cache_queried_tokens",
                                                      "prefix_cache_hit_tokens")},
            "kv": {"pages_used": used, "pages_total": pool.num_pages, "page_size": sched.page_size,
                   "usage": used / pool.num_pages if pool.num_pages else 0.0, "pages_cached": pool.cached_pages},
        }
        if include_moe:
            out["moe"] = self.runner.strategy.stats()
        return out

    def close(self) -> None:
        """Release what outlives the engine's objects: nothing for one process; the driver of
        several ranks stops them (engine/ranks.py)."""

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping --------------------------------------------------------------------------
    def _append(self, req: Request, token: int, logprobs: TokenLogprobs | None = None) -> StepOutput:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        req.num_computed = req.num_tokens - 1
        self.counters["generation_tokens"] += 1
        p = req.params
        if req.params_after_min is not None and len(req.output_ids) >= req.params_after_min.min_tokens:
            req.params, req.params_after_min = req.params_after_min, None
            self.runner.sampler.release(req)  # the next bind writes the params without the block
        reason = self._advance_grammar(req, token)
        # An ending token: a stop token id, an end token unless ignore_eos, or an end token
        # that finished the grammar; none before min_tokens. Its own text is never output,
        # special or not (a grammar that finishes on ordinary text, such as a closing brace,
        # keeps that text).
        may_end = len(req.output_ids) > p.min_tokens
        ending = may_end and (token in p.stop_token_ids
                              or (token in self.eos_ids and (not p.ignore_eos or reason == "stop")))
        if ending:
            reason = "stop"
        delta = "" if ending else self._detok[req.rid].push(token)
        text = req.text + delta
        for s in p.stop if may_end else ():
            cut = text.find(s, max(0, len(req.text) - len(s)))
            if cut >= 0:
                text, reason = text[:cut + len(s) if p.include_stop_str_in_output else cut], "stop"
                break
        req.text = text
        # The scheduler admitted prompt + max_tokens within the context limit, so max_tokens
        # is the only length bound a request can reach.
        if reason is None and len(req.output_ids) >= p.max_tokens:
            reason = "length"
        # Text that may be a stop string's start is held back until the next tokens say (a
        # stop string spanning tokens is never partly sent); all is sent once finished.
        shown = len(text) if reason is not None else len(text) - _stop_prefix_len(text, p.stop)
        delta, req.sent_chars = text[req.sent_chars:shown], max(req.sent_chars, shown)
        if reason is not None:
            self._finish(req, reason)
        prompt = req.prompt_logprobs if len(req.output_ids) == 1 else None
        return StepOutput(req, [token], delta, reason is not None, logprobs=[logprobs] if logprobs else [],
                          prompt_logprobs=prompt)

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> str | None:
        """Feed a constrained request's grammar its new token: "stop" once the grammar is
        finished (it took an end token, or the text is complete and allows nothing more)."""
        if req.grammar is None:
            return None
        if not req.grammar.accept(token):  # the device mask allowed only tokens the grammar takes
            raise RuntimeError(f"request {req.rid}: token {token} is outside its grammar")
        return "stop" if req.grammar.finished else None

    def _bind(self, reqs: list[Request]) -> tuple[list[Request], list[StepOutput]]:
        """The requests whose sampler slot holds their parameters, and the failures of those
        whose values the sampler cannot take (each fails alone, before anything is drawn)."""
        ready, failed = [], []
        for req in reqs:
            try:
                self.runner.sampler.bind(req)
                ready.append(req)
            except Exception:  # noqa: BLE001 - this request's own values: it fails, the rest go on
                logger.exception("sampling request %d failed; the other requests go on", req.rid)
                failed.append(self._fail(req, "sampling"))
        return ready, failed

    def _emit(self, reqs: list[Request], tokens: list[int], logprobs: list) -> list[StepOutput]:
        """Append each request's sampled token (and its log-probs, or None), each failing alone."""
        outputs = []
        for req, token, logprobs in zip(reqs, tokens, logprobs):
            try:
                outputs.append(self._append(req, token, logprobs))
            except Exception:  # noqa: BLE001 - detokenising or stop matching this request's output
                logger.exception("request %d failed after sampling; the other requests go on", req.rid)
                outputs.append(self._fail(req, "detokenisation"))
        return outputs

    def step(self) -> list[StepOutput]:
        flight = self._in_flight
        if flight is not None and all(r.finished for r in flight.reqs):  # aborted meanwhile: nothing to read
            flight = None
        ahead = self._decodes_ahead(flight)
        self._in_flight = None
        if ahead is not None:
            self._in_flight = self.runner.launch_decode(ahead, after=flight)
            self.counters["decode_tokens"] += len(ahead)
            return self._land(flight) if flight is not None else []
        outputs = self._land(flight) if flight is not None else []
        return outputs + self._planned_step()

    def _decodes_ahead(self, flight: DecodeLaunch | None) -> list[Request] | None:
        """The requests of a decode step that may be launched before `flight`'s tokens are read
        (the module's async scheduling), their pages reserved: every running request but those
        whose token in flight is their last. None when this step must be planned with every
        token on the host."""
        sched, sampler = self.scheduler, self.runner.sampler
        running = sched.running
        if not self.ec.async_scheduling or not self.runner.can_launch_ahead or not running:
            return None
        if sched.waiting and len(running) < sched.max_running:  # one may be admitted: plan it
            return None
        if flight is not None and not set(running) <= set(flight.reqs):  # one joined since: plan it
            return None
        pending = int(flight is not None)  # tokens of each request on their way to the host
        ahead = []
        for req in running:
            if (req.in_prefill or req.grammar is not None or req.params.logprobs is not None
                    or req.params_after_min is not None or not sampler.is_bound(req)):
                return None
            if len(req.output_ids) + pending < req.params.max_tokens:
                ahead.append(req)
        if not ahead or not all(sched.reserve(req, req.num_tokens + pending) for req in ahead):
            return None
        return ahead

    def _land(self, flight: DecodeLaunch) -> list[StepOutput]:
        """Read a launched step's tokens and emit those of its requests still running."""
        tokens = flight.pending.wait()
        live = [(req, token) for req, token in zip(flight.reqs, tokens) if not req.finished]
        return self._emit([req for req, _ in live], [token for _, token in live], [None] * len(live))

    def _planned_step(self) -> list[StepOutput]:
        """One step as the scheduler plans it, every token of its requests on the host."""
        plan = self.scheduler.schedule()
        self.counters["prefix_cache_queried_tokens"] += plan.prefix_queried_tokens
        self.counters["prefix_cache_hit_tokens"] += plan.prefix_hit_tokens
        for req in plan.preempted:
            self.runner.sampler.release(req)
        outputs: list[StepOutput] = []
        if plan.prefill:
            prefilled = self.runner.run_prefill(plan.prefill)
            for req, entries in prefilled.prompt_logprobs:
                req.prompt_logprobs += entries
            self.counters["prefill_tokens"] += sum(n for _, n in plan.prefill)
            rows = {}
            for row, (req, n) in enumerate(plan.prefill):
                req.num_computed += n
                if req.num_computed == req.num_tokens:
                    rows[req.rid] = row
            ready, failed = self._bind([req for req, _ in plan.prefill if req.rid in rows])
            outputs += failed
            if ready:
                sampled = self.runner.sample(prefilled.logits[[rows[req.rid] for req in ready]], ready)
                outputs += self._emit(ready, sampled.tokens, sampled.logprobs)
        if plan.decode:
            ready, failed = self._bind(plan.decode)
            outputs += failed
            self.counters["decode_tokens"] += len(ready)
            if ready:
                sampled = self.runner.decode(ready)
                outputs += self._emit(ready, sampled.tokens, sampled.logprobs)
        return outputs
