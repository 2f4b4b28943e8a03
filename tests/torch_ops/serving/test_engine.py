"""The continuous-batching engine: greedy outputs equal a dense cache-free generation with the
same weights, with requests arriving and finishing, chunked prefills mixed with decodes,
preemption, and prefix caching."""

import random

import pytest
import torch

from torch_ops.serving.engine import Request, generate

from .helpers import CONFIG, build_engine, dense_greedy, random_requests


def fresh_rng():
    return random.Random(int(torch.randint(0, 2**31, ())))


def check_against_dense(engine, requests, rng):
    arrivals = sorted(rng.randint(0, 3) for _ in requests)
    mixed = []
    outputs = generate(engine, requests, arrivals,
                       on_step=lambda s, e: mixed.append(s.num_tokens > s.num_seqs))
    for req in requests:
        assert outputs[req.id] == dense_greedy(engine.model, req.prompt, req.max_new_tokens), req.id
    assert any(mixed) and not engine.has_work
    assert engine.kv.allocator.num_free + len(engine.kv._prefix) == engine.kv.allocator.num_blocks


def test_greedy_equals_dense_generation():
    rng = fresh_rng()
    engine = build_engine(max_num_tokens=12)  # long prompts are chunked
    check_against_dense(engine, random_requests(rng, 10, CONFIG.vocab_size, max_prompt=30), rng)


def test_preemption_keeps_outputs():
    rng = fresh_rng()
    engine = build_engine(num_blocks=10, max_num_tokens=32)  # 5 requests of 2 blocks fit at first
    preempted = []
    engine._preempt = (lambda orig: lambda req: (preempted.append(req.id), orig(req)))(engine._preempt)
    requests = [Request(i, [rng.randrange(CONFIG.vocab_size) for _ in range(7)], 12) for i in range(6)]
    check_against_dense(engine, requests, rng)
    assert preempted


def test_prefix_caching_reuses_blocks_and_keeps_outputs():
    rng = fresh_rng()
    engine = build_engine(prefix_caching=True)
    prefix = [rng.randrange(CONFIG.vocab_size) for _ in range(13)]
    requests = random_requests(rng, 6, CONFIG.vocab_size, max_prompt=6, shared_prefix=prefix)
    hits = []
    add = engine.kv.add
    engine.kv.add = lambda seq, prompt=(): hits.append(add(seq, prompt)) or hits[-1]
    check_against_dense(engine, requests, rng)
    assert max(hits) >= 12


def test_request_token_range_equals_a_slice_of_tokens():
    rng = fresh_rng()
    for _ in range(200):
        req = Request(0, [rng.randrange(100) for _ in range(rng.randint(0, 6))], 5,
                      output=[rng.randrange(100) for _ in range(rng.randint(0, 6))])
        start = rng.randint(0, req.num_tokens)
        stop = rng.randint(start, req.num_tokens)
        assert req.token_range(start, stop) == req.tokens[start:stop]


def test_outputs_changed_feeds_the_new_last_token():
    """A caller that rewrites a running request's output (teacher forcing) and says so gets the
    new last token decoded next: the step's logits equal a dense run of the rewritten tokens."""
    rng = fresh_rng()
    engine = build_engine()
    req = Request(0, [rng.randrange(CONFIG.vocab_size) for _ in range(5)], 4)
    engine.add_request(req)
    engine.step()                                     # the prompt; one token sampled
    req.output[-1] = (req.output[-1] + 1) % CONFIG.vocab_size
    engine.outputs_changed()
    engine.step()
    forced = req.prompt + req.output[:1]
    assert req.output[1] == dense_greedy(engine.model, forced, 1)[0]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_warmup_leaves_the_engine_as_it_found_it(prefix_caching):
    rng = fresh_rng()
    engine = build_engine(max_num_tokens=12, prefix_caching=prefix_caching)
    assert engine.warmup(progress=False) > 0
    assert not engine.has_work and not engine.finished
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks
    check_against_dense(engine, random_requests(rng, 4, CONFIG.vocab_size, max_prompt=20), rng)
    with pytest.raises(RuntimeError, match="before any request"):
        engine.add_request(Request(0, [1, 2], 1))
        engine.warmup(progress=False)
