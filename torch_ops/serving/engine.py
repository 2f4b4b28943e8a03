"""Continuous batching: requests arrive and finish between steps; each step packs the decodes
of running requests and prefill chunks of new ones into one batch under a token budget (mixed
batches go through `paged_prefill`), samples greedily, and frees finished requests. Steps made
only of decodes replay a CUDA graph captured once per batch-size bucket (padding sequences have
length 0) when the attention backend is graph-safe.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from torch_ops.kv_cache import OutOfBlocksError
from torch_ops.serving.attention import AttentionBackend
from torch_ops.serving.cache_manager import KVCacheManager
from torch_ops.serving.model import Llama
from torch_ops.gpu import capture_cuda_graph


@dataclass
class Request:
    """A prompt and how many tokens to generate greedily; `output` fills as it runs."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)

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


@dataclass
class _Batch:
    """One step's sequences: `requests[j]` is `running[where[j]]` with `counts[j]` new tokens;
    `rows` their `BlockTables` rows when the scheduler has them (else None)."""

    requests: list[Request]
    where: np.ndarray
    counts: np.ndarray
    rows: np.ndarray | None


class Engine:
    """Serves `Request`s with `model` (whose `attention` backend runs over `kv`).

    `max_num_seqs` sequences and `max_num_tokens` new tokens per step; prompts longer than the
    budget are prefilled in chunks. `graph_buckets` (batch sizes, ascending) enables CUDA-graph
    decode steps; a decode batch is padded to the smallest bucket that holds it. The graphs are
    captured by `warmup()`, or else by the first `step()` (`capture_graphs`).

    The running requests' counters are numpy arrays aligned with `running` (`_todo`: tokens
    known but not yet in the cache, 1 for a decode; `_left`: tokens still to generate; `_last`:
    the last known token, a decode's input), so that a step schedules and books its sequences
    with a few array operations, not per request.
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
        self._todo = np.zeros(0, dtype=np.int64)
        self._left = np.zeros(0, dtype=np.int64)
        self._last = np.zeros(0, dtype=np.int64)
        self._order = np.arange(max_num_seqs)                # `where` and `counts` of decode-only steps
        self._ones = np.ones(max_num_seqs, dtype=np.int64)
        self._order.flags.writeable = self._ones.flags.writeable = False
        self.finished: dict[int, Request] = {}
        self.buckets = tuple(sorted(graph_buckets))
        # bucket -> (graph, its logits output, the captured function, for eager comparisons)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self._recording = False   # steps whose launches are recorded, not run: decodes stay eager

    @torch.no_grad()
    def warmup(self, *, progress: bool = True) -> float:
        """Compile, before serving, the kernels of every step, and capture the decode CUDA graphs:
        synthetic requests prefill 1, 2, 4, ... and `max_num_tokens` tokens, each alone then split
        in two sequences (mixed batches; sequences longer than the block tables hold are split
        further), and decode two tokens; steps of decodes with one new prompt of 2, 4, 8, ...
        tokens; then a short random workload of `2 * max_num_seqs` requests mixes decodes with
        prefill chunks. They finish and free their blocks. On CUDA the Triton launches of the
        graphs' decodes and of the workload are first recorded, and their kernels compile in
        parallel processes (`kernels.triton.precompile`); then the graphs are captured and the
        workload runs for real. Returns the seconds taken; `progress` prints a line per phase."""
        if self.has_work:
            raise RuntimeError("warmup runs before any request is added")
        start = time.perf_counter()

        def say(message: str) -> None:
            if progress:
                print(f"[engine warmup {time.perf_counter() - start:6.1f} s] {message}", flush=True)

        if self.kv.caches[0].k.is_cuda:
            from torch_ops.kernels.triton import precompile

            self._recording = True
            try:
                compiled = precompile.compile_ahead(lambda: (self._graph_decodes(), self._warmup_workload(None)))
            finally:
                self._recording = False
            self.kv.drop_prefix_cache()   # blocks the recorded steps registered hold no keys
            say(f"{compiled} kernel variants compiled in parallel")
        if self.buckets and not self._graphs:
            self._capture()   # their kernels compiled in the round above
            say(f"{len(self.buckets)} decode CUDA graphs captured")
        self._warmup_workload(say)
        self.kv.drop_prefix_cache()
        self.finished = {i: r for i, r in self.finished.items() if i >= 0}
        if self.kv.caches[0].k.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _warmup_workload(self, say) -> None:
        """The synthetic requests of `warmup`, run to completion (`say(phase)` after each phase)."""
        top = self.max_num_tokens
        sizes = sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})
        capacity = self.attention.builder.max_blocks_per_seq * self.kv.block_size   # tokens a sequence holds
        longest = capacity - 2
        ids = itertools.count(-1, -1)   # ids no caller uses
        say = say or (lambda message: None)
        for n in sizes:
            for halves in [[n]] + ([[n - n // 2, n // 2]] if n > 1 else []):
                lengths = [min(longest, h - i) for h in halves for i in range(0, h, longest)]
                generate(self, [Request(next(ids), [0] * length, 2) for length in lengths])
            say(f"prefills of {n} tokens")
        # decode-heavy mixed steps: n decoding sequences and one new prompt of c tokens in one
        # step, for c = 2, 4, ...: every class of tokens per sequence that picks a prefill tile
        n = min(self.max_num_seqs - 1, 15)
        for c in (s for s in sizes if 2 <= s <= top - n and s < capacity):
            generate(self, [Request(next(ids), [0], 3) for _ in range(n)] + [Request(next(ids), [0] * c, 1)],
                     [0] * n + [1])
        say("decodes with a prefill")
        # then a short random workload: steps that mix decodes with prefill chunks, at many batch sizes
        rng = random.Random(0)
        count = 2 * self.max_num_seqs
        new_tokens = [rng.randint(1, min(16, capacity - 1)) for _ in range(count)]
        workload = [Request(next(ids), [0] * rng.randint(1, min(top, capacity - n)), n) for n in new_tokens]
        generate(self, workload, sorted(rng.randrange(4 * self.max_num_seqs) for _ in range(count)))
        say("mixed steps")

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------------

    def _schedule(self) -> _Batch:
        """This step's batch: running requests first (decodes, then unfinished prefills, the
        shortest first), then newly admitted ones, within the token budget. The running
        requests' cache appends are one `append_batch`; only when the cache is short of blocks
        do they go one by one, preempting as needed."""
        todo = self._todo
        n = len(todo)
        if n <= self.max_num_tokens and n and todo.max() == 1:
            # steady decoding: every running request, in order, one token each
            where, counts, requests = self._order[:n], self._ones[:n], list(self.running)
        else:
            order = np.argsort(todo, kind="stable")
            want = todo[order]
            counts = np.minimum(want, self.max_num_tokens - (np.cumsum(want) - want))
            k = int(np.count_nonzero(counts > 0))  # the budget runs out after the first k
            where, counts = order[:k], counts[:k]
            requests = [self.running[i] for i in where.tolist()]
        try:
            rows = self.kv.append_batch([r.id for r in requests],
                                        self._new_tokens(requests, todo[where], counts))
            batch = _Batch(requests, where, counts, rows)
        except OutOfBlocksError:
            batch = self._schedule_one_by_one(requests, todo[where], counts)
        budget = self.max_num_tokens - int(batch.counts.sum())
        admitted = []
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.add(req.id, req.tokens if self.kv.prefix_caching else ())
            n = min(req.num_tokens - cached, budget)
            if not self._append(req, req.num_tokens - cached, n, batch.requests + admitted, admitting=True):
                self.kv.free(req.id)
                break
            self.waiting.pop(0)
            self._add_running(req, req.num_tokens - cached)
            admitted.append(req)
            batch.counts = np.append(batch.counts, n)
            budget -= n
        if admitted:
            batch.requests += admitted
            batch.where = np.append(batch.where, np.arange(len(self.running) - len(admitted), len(self.running)))
            batch.rows = None
        return batch

    def _schedule_one_by_one(self, requests, todo, counts) -> _Batch:
        """The appends of `_schedule` when they do not all fit: in order, each preempting the
        newest running request outside the batch until it fits, or stopping the batch."""
        kept, kept_counts = [], []
        for req, t, n in zip(requests, todo.tolist(), counts.tolist()):
            if req not in self.running:  # preempted to make room for an earlier one
                continue
            if not self._append(req, t, n, kept):
                break
            kept.append(req)
            kept_counts.append(n)
        index = {id(r): i for i, r in enumerate(self.running)}
        where = np.fromiter((index[id(r)] for r in kept), dtype=np.intp, count=len(kept))
        return _Batch(kept, where, np.array(kept_counts, dtype=np.int64), None)

    def _new_tokens(self, requests: list[Request], todo, counts) -> list | np.ndarray:
        """What `KVCacheManager.append_batch` takes for the next `counts[j]` of the `todo[j]`
        uncached tokens of `requests[j]`: the counts, or the token ids when prefix caching."""
        if not self.kv.prefix_caching:
            return counts
        return [r.token_range(r.num_tokens - t, r.num_tokens - t + n)
                for r, t, n in zip(requests, np.asarray(todo).tolist(), np.asarray(counts).tolist())]

    def _append(self, req: Request, todo: int, n: int, scheduled: list[Request],
                admitting: bool = False) -> bool:
        """Room in the cache for `n` of the `todo` uncached tokens of `req`; preempts the newest
        running request outside `scheduled` (it is recomputed later) until it fits, or returns
        False."""
        ids = {r.id for r in scheduled}
        while True:
            try:
                self.kv.append_batch([req.id], self._new_tokens([req], [todo], [n]))
                return True
            except OutOfBlocksError:
                victims = [r for r in self.running if r.id not in ids and r is not req]
                if admitting or not victims:
                    return False
                self._preempt(victims[-1])

    def _add_running(self, req: Request, todo: int) -> None:
        self.running.append(req)
        self._todo = np.append(self._todo, todo)
        self._left = np.append(self._left, req.max_new_tokens - len(req.output))
        self._last = np.append(self._last, (req.output or req.prompt)[-1])

    def _remove_running(self, gone: np.ndarray) -> None:
        """Drop `running[i]` for each index in `gone`."""
        keep = np.ones(len(self.running), dtype=bool)
        keep[gone] = False
        self.running = [r for r, k in zip(self.running, keep.tolist()) if k]
        self._todo, self._left, self._last = self._todo[keep], self._left[keep], self._last[keep]

    def outputs_changed(self) -> None:
        """Call after changing a running request's `output` in place (teacher forcing, tests):
        the engine feeds each decode the last token it booked, not `output[-1]`."""
        self._last = np.array([(r.output or r.prompt)[-1] for r in self.running], dtype=np.int64)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.id)
        self._remove_running(np.array([self.running.index(req)]))
        self.waiting.insert(0, req)

    # --- steps --------------------------------------------------------------------------------

    def step(self) -> StepStats | None:
        """Run one step; None if there was nothing to schedule."""
        if self.buckets and not self._graphs and not self._recording:
            self.capture_graphs()   # an engine that was not warmed up: its first step
        start = time.perf_counter()
        batch = self._schedule()
        schedule_us = (time.perf_counter() - start) * 1e6
        requests, where, counts = batch.requests, batch.where, batch.counts
        if not requests:
            if self.running or self.waiting:
                raise RuntimeError("no request fits in the KV cache: raise num_blocks")
            return None
        self.kv.apply_pending()
        todo = self._todo[where]
        if todo.max() == 1:  # decodes (or one-token prompt tails): each one's last token
            token_ids = self._last[where]
        else:
            token_ids = list(itertools.chain.from_iterable(
                r.token_range(r.num_tokens - t, r.num_tokens - t + n)
                for r, t, n in zip(requests, todo.tolist(), counts.tolist())))
        bucket = self._bucket(counts)
        t0 = time.perf_counter()
        meta = self.attention.prepare([r.id for r in requests], counts, rows=batch.rows,
                                      pad_to=bucket, token_ids=token_ids)
        metadata_us = (time.perf_counter() - t0) * 1e6
        host_us = (time.perf_counter() - start) * 1e6
        timer = _GpuTimer(meta.attn.slot_mapping.is_cuda)
        if bucket is not None and not self._recording:
            graph, logits, _ = self._graphs[bucket]
            graph.replay()
            logits = logits[:len(requests)]
        else:
            hidden = self.model(meta.attn.token_ids, meta)
            last = meta.attn.cu_seqlens_q[1:len(requests) + 1] - 1
            logits = self.model.logits(hidden[last])
        gpu_us = timer.stop()
        self.last_logits = logits
        self._book(batch, logits.argmax(dim=-1).cpu().numpy())
        return StepStats(len(requests), int(counts.sum()), bucket is not None, metadata_us, gpu_us,
                         schedule_us, host_us)

    def _book(self, batch: _Batch, next_tokens: np.ndarray) -> None:
        """After the forward: the batch's tokens are in the cache; each request whose last
        known token ran gets its sampled token (`next_tokens [B]`); finished requests leave."""
        where = batch.where
        self._todo[where] -= batch.counts
        sampled = np.flatnonzero(self._todo[where] == 0)
        tokens = next_tokens.tolist()
        if len(sampled) == len(where):
            for req, token in zip(batch.requests, tokens):
                req.output.append(token)
        else:
            for j in sampled.tolist():
                batch.requests[j].output.append(tokens[j])
        grew = where[sampled]
        self._last[grew] = next_tokens[sampled]
        self._todo[grew] = 1
        self._left[grew] -= 1
        done = grew[self._left[grew] <= 0]
        if len(done):
            for i in done.tolist():
                req = self.running[i]
                self.kv.free(req.id)
                self.finished[req.id] = req
            self._remove_running(done)

    def _bucket(self, counts: np.ndarray) -> int | None:
        if not self.buckets or counts.max() != 1:
            return None
        return next((b for b in self.buckets if b >= len(counts)), None)

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """One decode graph per bucket, captured over dummy one-token sequences in block 0 of a
        still empty cache (the graph keeps only buffer addresses: a bucket's metadata and input
        ids land at the same ones every step); their kernels compile first, in parallel."""
        if self.running or self.kv.allocator.num_free != self.kv.allocator.num_blocks:
            raise RuntimeError("CUDA graphs are captured before any request runs")
        from torch_ops.kernels.triton import precompile

        precompile.compile_ahead(self._graph_decodes)
        self._capture()

    @torch.no_grad()
    def _capture(self) -> None:
        """`capture_graphs` once the graphs' kernels are compiled (no request has run)."""
        for bucket in self.buckets:
            run = functools.partial(self._decode_logits, self._dummy_decode(bucket))
            self._graphs[bucket] = (*capture_cuda_graph(run), run)

    def _dummy_decode(self, bucket: int):
        """The metadata of `bucket` one-token sequences in block 0 (built right before use: every
        bucket's views share one buffer)."""
        return self.attention.step_metadata(self.attention.builder.build(
            [1] * bucket, [1] * bucket, [[0]] * bucket, token_ids=[0] * bucket))

    def _graph_decodes(self) -> None:
        """The decode steps the graphs capture, run once each."""
        for bucket in self.buckets:
            self._decode_logits(self._dummy_decode(bucket))

    def _decode_logits(self, meta) -> torch.Tensor:
        return self.model.logits(self.model(meta.attn.token_ids, meta))


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
