"""Continuous batching: requests arrive and finish between steps; each step packs the decodes
of running requests and prefill chunks of new ones into one batch under a token budget (mixed
batches go through `paged_prefill`), samples greedily, and frees finished requests. Steps made
only of decodes replay a CUDA graph captured once per batch-size bucket (padding sequences have
length 0) when the attention backend is graph-safe.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from torch_ops.kv_cache import OutOfBlocksError
from torch_ops.serving.attention import AttentionBackend
from torch_ops.serving.cache_manager import KVCacheManager
from torch_ops.serving.model import Llama
from torch_ops.testing import capture_cuda_graph


@dataclass
class Request:
    """A prompt and how many tokens to generate greedily; `output` fills as it runs."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose k/v are in the cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_range(self, start: int, stop: int) -> list[int]:
        """`tokens[start:stop]`, without building `tokens`."""
        p = len(self.prompt)
        if start >= p:  # decodes
            return self.output[start - p:stop - p]
        if stop <= p:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.output[:stop - p]

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class StepStats:
    num_seqs: int
    num_tokens: int
    graph: bool          # replayed a CUDA graph
    metadata_us: float   # CPU time building the step's metadata
    gpu_us: float | None  # device time of the forward (CUDA events), None on CPU
    schedule_us: float   # CPU time scheduling the step, cache appends included
    host_us: float       # CPU time from the step's start to the forward's launch


class Engine:
    """Serves `Request`s with `model` (whose `attention` backend runs over `kv`).

    `max_num_seqs` sequences and `max_num_tokens` new tokens per step; prompts longer than the
    budget are prefilled in chunks. `graph_buckets` (batch sizes, ascending) enables CUDA-graph
    decode steps; a decode batch is padded to the smallest bucket that holds it.
    """

    def __init__(self, model: Llama, kv: KVCacheManager, *, max_num_seqs: int, max_num_tokens: int,
                 graph_buckets: tuple[int, ...] = ()):
        attention: AttentionBackend = model.attention
        if graph_buckets and not (attention.graph_safe and kv.caches[0].k.is_cuda):
            raise ValueError(f"graph_buckets need a graph-safe backend on CUDA, got {attention.name!r} "
                             f"on {kv.caches[0].k.device}")
        if graph_buckets and max(graph_buckets) > max_num_seqs:
            raise ValueError(f"graph_buckets {graph_buckets} exceed max_num_seqs={max_num_seqs}")
        self.model, self.kv, self.attention = model, kv, attention
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.buckets = tuple(sorted(graph_buckets))
        # bucket -> (graph, its logits output, the captured function, for eager comparisons)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        device = kv.caches[0].k.device
        self._input_ids = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        if self.buckets:
            self._capture_graphs()

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        """`(request, new tokens)` of this step: running requests first (decodes, then
        unfinished prefills), then newly admitted ones, within the token budget. The running
        requests' cache appends are one `append_batch`; only when the cache is short of blocks
        do they go one by one, preempting as needed."""
        budget = self.max_num_tokens
        batch = []
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed):
            n = min(req.num_tokens - req.num_computed, budget)
            if n == 0:
                break
            batch.append((req, n))
            budget -= n
        try:
            self.kv.append_batch([r.id for r, _ in batch], [self._new_tokens(r, n) for r, n in batch])
        except OutOfBlocksError:
            plan, batch = batch, []
            for req, n in plan:
                if req not in self.running:  # preempted to make room for an earlier one
                    continue
                if not self._append(req, n, batch):
                    break
                batch.append((req, n))
            budget = self.max_num_tokens - sum(n for _, n in batch)
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            req.num_computed = self.kv.add(req.id, req.tokens if self.kv.prefix_caching else ())
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._append(req, n, batch, admitting=True):
                self.kv.free(req.id)
                break
            self.running.append(self.waiting.pop(0))
            batch.append((req, n))
            budget -= n
        return batch

    def _new_tokens(self, req: Request, n: int) -> int | list[int]:
        """What `KVCacheManager.append` takes for the next `n` tokens of `req`."""
        return req.token_range(req.num_computed, req.num_computed + n) if self.kv.prefix_caching else n

    def _append(self, req: Request, n: int, batch, admitting: bool = False) -> bool:
        """Room in the cache for `n` more tokens of `req`; preempts the newest running request
        outside this batch (it is recomputed later) until it fits, or returns False."""
        scheduled = {r.id for r, _ in batch}
        while True:
            try:
                self.kv.append(req.id, self._new_tokens(req, n))
                return True
            except OutOfBlocksError:
                victims = [r for r in self.running if r.id not in scheduled and r is not req]
                if admitting or not victims:
                    return False
                self._preempt(victims[-1])

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.id)
        req.num_computed = 0
        self.running.remove(req)
        self.waiting.insert(0, req)

    # --- steps --------------------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """Run one step; None if there was nothing to schedule."""
        start = time.perf_counter()
        batch = self._schedule()
        schedule_us = (time.perf_counter() - start) * 1e6
        if not batch:
            if self.running or self.waiting:
                raise RuntimeError("no request fits in the KV cache: raise num_blocks")
            return None
        self.kv.apply_pending()
        ids = [r.id for r, _ in batch]
        query_lens = np.fromiter((n for _, n in batch), dtype=np.int64, count=len(batch))
        num_tokens = int(query_lens.sum())
        bucket = self._bucket(query_lens)
        t0 = time.perf_counter()
        meta = self.attention.prepare(ids, query_lens, pad_to=bucket)
        metadata_us = (time.perf_counter() - t0) * 1e6

        token_ids = []
        for r, n in batch:
            token_ids += r.token_range(r.num_computed, r.num_computed + n)
        token_ids = torch.from_numpy(np.fromiter(token_ids, dtype=np.int64, count=num_tokens))
        self._input_ids[:num_tokens].copy_(token_ids, non_blocking=True)
        host_us = (time.perf_counter() - start) * 1e6
        timer = _GpuTimer(self._input_ids.is_cuda)
        if bucket is not None:
            graph, logits, _ = self._graphs[bucket]
            graph.replay()
            logits = logits[:len(batch)]
        else:
            hidden = self.model(self._input_ids[:num_tokens], meta)
            last = meta.attn.cu_seqlens_q[1:len(batch) + 1] - 1
            logits = self.model.logits(hidden[last])
        gpu_us = timer.stop()
        self.last_logits = logits

        next_tokens = logits.argmax(dim=-1).tolist()
        for (req, n), token in zip(batch, next_tokens):
            req.num_computed += n
            if req.num_computed == req.num_tokens:  # its last known token ran: sample
                req.output.append(token)
                if req.done:
                    self.kv.free(req.id)
                    self.running.remove(req)
                    self.finished[req.id] = req
        return StepStats(len(batch), num_tokens, bucket is not None, metadata_us, gpu_us, schedule_us,
                         host_us)

    def _bucket(self, query_lens: np.ndarray) -> int | None:
        if not self.buckets or (query_lens != 1).any():
            return None
        return next((b for b in self.buckets if b >= len(query_lens)), None)

    @torch.no_grad()
    def _capture_graphs(self) -> None:
        """One decode graph per bucket, captured over dummy one-token sequences in block 0 of a
        still empty cache (the graph keeps only buffer addresses)."""
        if self.running or self.kv.allocator.num_free != self.kv.allocator.num_blocks:
            raise RuntimeError("CUDA graphs are captured before any request runs")
        for bucket in self.buckets:
            meta = self.attention.step_metadata(
                self.attention.builder.build([1] * bucket, [1] * bucket, [[0]] * bucket))
            run = functools.partial(self._decode_logits, self._input_ids[:bucket], meta)
            self._graphs[bucket] = (*capture_cuda_graph(run), run)

    def _decode_logits(self, ids: torch.Tensor, meta) -> torch.Tensor:
        return self.model.logits(self.model(ids, meta))


class _GpuTimer:
    """Device time between construction and `stop()` (CUDA events; None on CPU)."""

    def __init__(self, cuda: bool):
        self.events = None
        if cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()

    def stop(self) -> float | None:
        if self.events is None:
            return None
        self.events[1].record()
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) * 1e3


def generate(engine: Engine, requests: list[Request], arrivals: list[int] | None = None,
             on_step=None) -> dict[int, list[int]]:
    """Run `requests` to completion, request `i` arriving before step `arrivals[i]` (default:
    all at once); `on_step(stats, engine)` after each step. Returns `{id: output tokens}`."""
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, range(len(requests))))
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add_request(requests[pending.pop(0)[1]])
        stats = engine.step()
        if stats is not None and on_step is not None:
            on_step(stats, engine)
        step += 1
    return {r.id: r.output for r in requests}
