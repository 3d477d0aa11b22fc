"""ModelRunner: builds the model, its KV cache and its sampler, turns a StepPlan into
ForwardBatches, runs them (decode and its sampling through captured CUDA graphs on the GPU) and
returns the sampled tokens (or the logits, for callers that want them), and the prompt
log-probs of the prefill chunks whose requests asked for them."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from moeferry.config import EngineConfig, ModelConfig
from moeferry.engine.batch import fill_page_table
from moeferry.layers.batch import ForwardBatch, PrefillSeq
from moeferry.engine.cuda_graph import DecodeGraphs, StagedInputs
from moeferry.engine.loader import load_dummy, load_safetensors
from moeferry.engine.planner import KVShape, plan_memory, planned_context, served_context, wanted_kv_tokens
from moeferry.engine.sampler import PendingTokens, PromptLogprobs, SampledTokens, Sampler, prompt_logprobs
from moeferry.kvcache.paged import PagedKVCache
from moeferry.layers.attention import Attention
from moeferry.layers.mla import MLAttention
from moeferry.models.decoder import MoECausalLM
from moeferry.moe.strategies import create_strategy
from moeferry.routing.recorder import RoutingRecorder
from moeferry.routing.trace import TraceHeader, TraceWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSpan:
    """The positions [first, end) of a prefill chunk whose logits give its request's prompt
    log-probs (position p's give prompt token p + 1's); `row` is position `first`'s batch row."""

    req: object
    row: int
    first: int
    end: int


def prompt_spans(chunks) -> list[PromptSpan]:
    """The spans of `chunks` [(request, tokens)] (before their num_computed advances) whose
    prompt log-probs are still to compute: positions from the first without one, short of the
    prompt's last (whose logits give the first generated token)."""
    spans, row = [], 0
    for req, n in chunks:
        start = req.num_computed
        if req.needs_prompt_logprobs:
            first, end = max(start, len(req.prompt_logprobs) - 1), min(start + n, len(req.prompt_ids) - 1)
            if first < end:
                spans.append(PromptSpan(req, row + first - start, first, end))
        row += n
    return spans


@dataclass
class PrefillOutput:
    """One prefill forward's results: the float32 logits of each chunk's last row [chunks, V],
    and the prompt log-probs of each span (request, PromptLogprobs of positions first + 1...)."""

    logits: torch.Tensor
    prompt_logprobs: list[tuple[object, list[PromptLogprobs]]] = field(default_factory=list)


@dataclass(frozen=True)
class DecodeLaunch:
    """A decode step queued on the device whose tokens the host has not read: its requests in
    row order, their tokens on the device [n] (the input ids of a step launched after it) and
    their way to the host."""

    reqs: list
    tokens: torch.Tensor
    pending: PendingTokens


class ModelRunner:
    """Owns the model, the MoE strategy and the KV cache of one engine.

    Invariants: the model's dense weights live on `device` in `dtype`; the routed experts live
    where the strategy put them; padded decode rows write to the KV cache's scratch page.
    """

    def __init__(self, ec: EngineConfig, mc: ModelConfig, shard=None):
        """`shard`: this rank's share of the routed experts (moe/shard.py), or None for all."""
        self.ec, self.mc = ec, mc
        self.device, self.dtype = ec.torch_device, ec.torch_dtype
        model_len = ec.max_model_len or mc.max_position_embeddings  # (check(mc) capped a given one at the model's)
        torch.manual_seed(ec.seed)
        self.strategy = create_strategy(ec.moe_strategy, ec, mc, shard)
        kv_heads, kv_dim, kv_values = mc.kv_cache_layout
        kv_shape = KVShape(PagedKVCache.bytes_per_token(mc.num_layers, kv_heads, kv_dim, self.dtype, kv_values),
                           planned_context(ec, model_len))
        # rotary tables for no more positions than the KV cache can ever hold (served_context
        # below never exceeds it): a 262,144-token model does not build tables it cannot serve
        self.model = self._build_model(min(model_len, wanted_kv_tokens(ec, kv_shape)))
        sampler_bytes = Sampler.device_bytes(ec.max_running_requests, mc.vocab_size, ec.max_running_requests)
        self.plan = plan_memory(ec, self.strategy.memory_needs(), kv_shape, self.device, sampler_bytes)
        logger.info(self.plan.table())
        # at most the KV cache's size: the page tables below are this wide per request
        self.max_model_len = served_context(ec, model_len, self.plan)
        self.strategy.finalize(self.plan)
        self.kv = PagedKVCache(mc.num_layers, self.plan.kv_pages, ec.page_size, kv_heads, kv_dim, self.dtype,
                               self.device, kv_values)
        self.scratch_page = self.kv.scratch_page
        self.sampler = Sampler(ec.max_running_requests, mc.vocab_size, self.device)
        self.max_pages_per_req = -(-self.max_model_len // ec.page_size)
        self.recorder = self._open_recorder()  # before the graphs: they capture its writes
        self.graphs = self._capture_graphs() if ec.use_cuda_graph else None

    def _capture_graphs(self) -> DecodeGraphs:
        """The decode graphs over the model's forward and the sampler (engine/cuda_graph.py)."""
        inputs = StagedInputs(self.ec.max_running_requests, self.max_pages_per_req, self.device, self.scratch_page,
                              self.ec.page_size)
        return DecodeGraphs(self._model_forward, self.sampler, self.decode_inputs, inputs, self.mc.vocab_size)

    def _model_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.kv)

    def _open_recorder(self) -> RoutingRecorder | None:
        """Under --moe-record-routing, a recorder every MoE block writes to (routing/recorder.py)."""
        ec, mc, slots = self.ec, self.mc, self.plan.expert_slots
        if ec.moe_record_routing is None:
            return None
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        header = TraceHeader(len(self.strategy.moe_layer_of), mc.num_experts, mc.top_k, self.strategy.expert_bytes,
                             model=mc.path, dtype=str(self.dtype).removeprefix("torch."), strategy=ec.moe_strategy,
                             device=device, cuda_graph=ec.use_cuda_graph, cache_slots=slots or None,
                             cache_policy=ec.moe_cache_policy if slots else None)
        rows = max(ec.max_prefill_tokens, ec.max_running_requests)
        recorder = RoutingRecorder(TraceWriter(ec.moe_record_routing, header), rows, ec.max_running_requests,
                                   self.device)
        self.strategy.recorder = recorder
        return recorder

    def _recorded(self, is_decode: bool, num_tokens: int):
        """Around one forward: its routes into the trace when recording (after the forward)."""
        if self.recorder is None:
            return nullcontext()
        return self.recorder.step(is_decode, num_tokens, self.strategy.admits_prefill)

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again, after something they bake in changed (the slot
        pool, the admission statistics, a forward hook): the old graphs' memory pool is
        released first. No-op without graphs."""
        if self.graphs is not None:
            self.graphs = None
            self.graphs = self._capture_graphs()

    def _build_model(self, max_positions: int) -> MoECausalLM:
        with torch.device("cpu"):
            model = MoECausalLM(self.mc, self.strategy, max_positions)
        model.to(device=self.device, dtype=self.dtype)
        model.model.rotary.to(torch.float32)
        for module in model.modules():
            if getattr(module, "keeps_fp32", False):  # before loading: the checkpoint's fp32 values kept
                module.to(torch.float32)
        if self.ec.load_format == "dummy":
            load_dummy(model, self.ec.seed, self.device)
        else:
            load_safetensors(model, self.mc.path, self.device)
        for module in model.modules():
            if isinstance(module, Attention):
                module.fuse_qkv()
            elif isinstance(module, MLAttention):
                module.after_load()
        model.eval()
        return model

    # ---- batches -------------------------------------------------------------------------
    def _t(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def prefill_batch(self, chunks, spans: list[PromptSpan] = ()) -> ForwardBatch:
        """The forward of prefill `chunks`; its logits rows are each chunk's last, then the rows
        of each of `spans` (prompt_spans)."""
        ids, pos, slots, logits_rows, seqs = [], [], [], [], []
        for req, n in chunks:
            start = req.num_computed
            toks = req.tokens[start:start + n]
            row0 = len(ids)
            ids += toks
            pos += range(start, start + n)
            slots.append(self.kv.token_slots(req.pages, start, start + n))
            seqs.append(PrefillSeq(row0, n, start, self.kv.token_slots(req.pages, 0, start + n).to(self.device)))
            logits_rows.append(row0 + n - 1)
        for span in spans:
            logits_rows += range(span.row, span.row + span.end - span.first)
        return ForwardBatch(False, self._t(ids), self._t(pos), torch.cat(slots).to(self.device),
                            self._t(logits_rows), prefill_seqs=seqs)

    def decode_inputs(self, reqs, ahead: int = 0):
        """Host-side decode inputs: token ids, positions, output slots, lengths (lists) and
        each request's page list, in the order StagedInputs.write takes them. With `ahead`
        (1: a step launched before the host read the previous one's tokens), each request
        decodes that many positions past its last token on the host, whose id the device has
        (the ids given are then placeholders)."""
        ids = [r.tokens[-1] for r in reqs]
        pos = [r.num_tokens - 1 + ahead for r in reqs]
        ps = self.ec.page_size
        slots = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, pos)]
        lens = [p + 1 for p in pos]
        return ids, pos, slots, lens, [r.pages for r in reqs]

    def decode_batch(self, reqs, ahead: int = 0, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """An eager decode forward of `reqs` (`ahead`: decode_inputs'), reading `input_ids`
        [len(reqs)] on the device when given."""
        ids, pos, slots, lens, pages = self.decode_inputs(reqs, ahead)
        n = len(reqs)
        table = torch.empty((n, self.max_pages_per_req), dtype=torch.int32)
        fill_page_table(table.numpy(), pages, self.scratch_page)
        return ForwardBatch(True, self._t(ids) if input_ids is None else input_ids, self._t(pos), self._t(slots),
                            torch.arange(n, device=self.device), page_table=table.to(self.device),
                            seq_lens=self._t(lens, torch.int32))

    # ---- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One eager forward: the float32 logits of the batch's logits rows."""
        return self.model.logits(self.hidden(batch))

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """One eager forward to the final hidden states of the logits rows: the strategy's
        per-forward bookkeeping, then the model's layers and its final norm."""
        self.strategy.begin_forward(batch.is_decode, batch.num_rows)
        return self.model.hidden(batch, self.kv)

    @torch.inference_mode()
    def run_prefill(self, chunks) -> PrefillOutput:
        """One prefill forward of `chunks` [(request, tokens)]: the logits of each chunk's last
        row, and the prompt log-probs its requests still owe (only their rows reach the lm_head
        beyond the last ones, in slices: sampler.prompt_logprobs)."""
        spans = prompt_spans(chunks)
        batch = self.prefill_batch(chunks, spans)
        with self._recorded(False, batch.num_rows):
            hidden = self.hidden(batch)
        out = PrefillOutput(self.model.logits(hidden[:len(chunks)]))
        row = len(chunks)
        for span in spans:
            n = span.end - span.first
            targets = span.req.prompt_ids[span.first + 1:span.end + 1]
            out.prompt_logprobs.append((span.req, prompt_logprobs(hidden[row:row + n], self.model.logits, targets,
                                                                  span.req.params.prompt_logprobs, self.sampler.vocab)))
            row += n
        return out

    @torch.inference_mode()
    def run_decode(self, reqs) -> torch.Tensor:
        """The logits of one decode step of `reqs`, nothing sampled."""
        self.strategy.begin_decode_step()
        with self._recorded(True, len(reqs)):
            if self.graphs is not None and self.graphs.can_run(len(reqs)):
                return self.graphs.run(reqs)[0]
            return self.forward(self.decode_batch(reqs))

    @torch.inference_mode()
    def decode(self, reqs) -> SampledTokens:
        """One decode step of `reqs` (bound to sampler slots) and a token for each, sampled on
        the device (inside the step's CUDA graph where there is one)."""
        self.strategy.begin_decode_step()
        with self._recorded(True, len(reqs)):
            if self.graphs is not None and self.graphs.can_run(len(reqs)):
                _, samples = self.graphs.run(reqs, self.sampler.slots(reqs))
                return self.sampler.read(samples, reqs)
            return self.sampler.sample(self.forward(self.decode_batch(reqs)), reqs)

    @property
    def can_launch_ahead(self) -> bool:
        """Whether a decode step may be launched before the previous one's tokens are read:
        not while routing is recorded (its trace is written after each forward)."""
        return self.recorder is None

    @torch.inference_mode()
    def launch_decode(self, reqs, after: DecodeLaunch | None = None) -> DecodeLaunch:
        """One decode step of `reqs` (bound to sampler slots, no token masks, no log-probs)
        queued on the device, its tokens not read. With `after`, a launched step of each of
        `reqs` (and maybe others) whose tokens the host has not read: this step's inputs are
        those tokens, on the device, one position further on than the host's tokens say (its
        requests hold pages for it)."""
        assert self.can_launch_ahead
        ahead, input_ids = (0, None) if after is None else (1, self._tokens_of(reqs, after))
        self.strategy.begin_decode_step()
        if self.graphs is not None and self.graphs.can_run(len(reqs)):
            _, buffers = self.graphs.run(reqs, self.sampler.slots(reqs), ahead, input_ids)
        else:
            buffers = self.sampler.draw(self.forward(self.decode_batch(reqs, ahead, input_ids)), reqs, ahead)
        tokens = buffers.tokens[:len(reqs)]
        return DecodeLaunch(list(reqs), tokens, self.sampler.read_later(tokens))

    def _tokens_of(self, reqs, after: DecodeLaunch) -> torch.Tensor:
        """`after`'s tokens of `reqs`, in their order, on the device (a gather where some of
        its rows left)."""
        row_of = {req: row for row, req in enumerate(after.reqs)}
        rows = [row_of[req] for req in reqs]
        if rows == list(range(len(reqs))):
            return after.tokens[:len(reqs)]
        return after.tokens[self._t(rows)]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs) -> SampledTokens:
        """A token for each of `reqs` from its row of `logits` (the end of a prefill)."""
        return self.sampler.sample(logits, reqs)
