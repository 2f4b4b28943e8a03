"""Triton `attn::paged_decode`: 1..8 new query tokens per sequence over a paged KV cache.

Design (semantics: docs/ops.md; numbers and reasoning: the notes in benchmarks/bench_decode.py)

- **One program = one (sequence, KV head, split) and all its query rows.** The `Hq / Hkv` query
  heads of a KV head times the `q_per_seq` new tokens form the M dimension of the two `tl.dot`s
  (row `m = i * G + g`: token `i`, head `g` of the group), padded to >= 16 and tiled by at most
  64 rows (`M_TILES` programs share the KV head then; they run side by side, so the second read
  comes from L2). The K/V tiles are read once per program, whatever the GQA ratio.
- **Replicated rows.** With <= 8 query rows, a one-warp program's 16-row tile can hold R copies of
  them (row i = query row i // R, copy i % R); copy j scores key tile j of each R-tile step, so
  one softmax step and one rescale of the accumulators serve R tiles. Each copy keeps its own
  online-softmax state; the epilogue merges them (`config` says when R = 2 pays).
- **Paged tiles.** A tile is `BLOCK_N` tokens. When the block size is a multiple of `BLOCK_N`, a
  tile lies in one page and costs one block-table load (and, where `config` says so, its rows are
  32-bit offsets from one 64-bit base pointer); otherwise (block sizes 1..BLOCK_N-1, or not
  multiples) every token row looks its page up (an L1 hit). Row offsets are int64.
  Any block/token/head strides with a contiguous last dim (NHD, HND, combined, vLLM) are served.
- **Quantized tiles as words, split into 4 lanes.** FP8/INT8 rows are read as int32 words and
  packed INT4 rows as int16 words, 4 values each; word c of a row holds dims 4c..4c+3. Each word
  is dequantized in registers into 4 fp16 "lanes" (lane j = dim 4c + j), exactly: FP8 by the
  hardware `cvt.rn.f16x2.e4m3x2`/`e5m2x2`, INT8/INT4 by the fp16 magic number (`prmt`/`lop3`
  build the bit pattern 0x6400|bits = 1024 + bits, one `sub.f16x2`/`fma.rn.f16x2` removes the
  offset, two values per instruction), in PTX on the GPU and in plain Triton integer code under
  the interpreter, then times the group scale (a packed fp16 multiply for fp16 scale caches, in
  fp32 for fp32/bf16 ones, so that the product is rounded to fp16 once, as the reference does).
  Lane j of K is dotted with lane j of q
  (q[:, j::4]) and P @ V accumulates 4 lane accumulators, re-interleaved once in the epilogue,
  so no shuffle ever restores the dim order inside the loop; and the tiles are read from shared
  memory as whole words, straight into the MMA operand layout (no layout conversion in the sm_90a
  TTGIR; a byte-wise layout made Triton emit one `ld.shared.b8` per value).
  The FP8 per-tensor/per-head K scale rides on the softmax scale, the V scale on the output.
  With bf16 queries the QK operands are fp16 too: q is scaled by a power of two so that
  max |q| <= 2^15 (exact; undone in the softmax scale). Dequantized INT8/INT4 values must fit
  fp16 (|x| < 65504). Group scales are loaded once per (token, group) when the group is 4 x a
  power of 2 values, else gathered per value (slow path: groups of 2, 24, 48, ...).
- **Warps.** Quantized caches (and plain ones when B x Hkv is 32 to half the SM count) run
  one-warp programs of 16-key tiles: a warp owns all rows and keys of its tile, so no softmax
  state crosses warps inside the loop, and split-K supplies the parallelism. 32-row quantized
  tiles take two warps, the rest four (eight for 64-row plain tiles at D = 256; `config`).
- **Pipelining.** Triton's software pipeliner stages the block-table, K, V and scale loads through
  shared memory (cp.async); the page indirection costs it two stages, so `num_stages=5` keeps
  two tiles of every program in flight (`config`).
- **Softmax** online in fp32 with exp2, log2(e) folded into the scale; softcap via exp2-based
  tanh; ALiBi per row; causal among the new tokens; sliding window + sink tokens skip whole tiles
  (the split range starts at the window, sink tiles are visited by split 0 only).
- **Split-K.** `num_splits` comes from shapes only (B, Hkv, M tiles, `block_tables.shape[1]`,
  block size, SM count; `split_count`), so the grid is fixed under CUDA graphs. When the batch
  alone comes near filling the GPU, plain caches take tiles of twice the keys and one or two
  splits instead (`large_tile_splits`; one split for tables of <= 512 keys at D = 128, in 8-warp
  programs, and <= 1024 keys at D = 64: `Tuning.short_context`). Inside, each
  sequence cuts its own visible key span into `num_splits` equal parts (rounded up to `BLOCK_N`,
  at least `Tuning.min_split_tokens`): long sequences use every split, short ones a few, and splits
  past the span exit at once (they write nothing, and the merge kernel never reads them).
  With one split the kernel writes `out`/`lse` itself; otherwise `_merge_kernel` combines the
  partial (out, lse) of the active splits and adds the learned sinks once, after the merge.
  Few (sequence, KV head) pairs over long tables (B = 1 on a tensor-parallel shard of 1-2 KV
  heads) split up to `Tuning.max_splits` = 256 ways, and the merge then takes the head dim in blocks
  (`Tuning.merge_tile` partial values per program). H200, bf16, 16k-32k keys: 8/1 heads 1.6-1.9x, 16/2
  1.2x, FP8 8/1 1.9x, INT4 2.3x the 64-split cap.
  The merge is a kernel of its own (3.0-4.1 µs of a 9-27 µs call at B <= 16 on an H200): merging
  in the split kernel (the last split of a tile, after an atomic counter) saves 1-2 µs for MHA but
  is up to 2.3x slower for GQA at B = 1, where one program would merge 22-26 splits serially.
- **Workspace** (only when `num_splits > 1`): fp32 partial outputs `[num_splits, T, Hq, D]` and
  partial lse `[num_splits, T, Hq]`, allocated per call with `torch.empty` from shapes alone
  (inside CUDA-graph capture it comes from the graph's private pool: fixed addresses on replay).
- Length-0 sequences write zeros and lse -inf (or `sinks[h]`). No host sync in `run`.
- Bad metadata (docs/ops.md, "Errors"): lengths are clamped into the block table. Each program
  checks the block ids it reads before its loop (`block_table.any_absent_block`); with one outside
  the cache it reads no keys (its split or its rows stay empty). The loop itself carries no check:
  a per-tile check costs it its schedule (sm_90). Each bad value sets its bit in the device error
  flag (`torch_ops.errors`).

Not served (`unsupported` says why): head dims > 256; quantized caches whose head dim is not a
multiple of 4 or whose strides/alignment do not allow 4-value words. Any block size, any
GQA ratio, q_per_seq 1..8, fp16/bf16 queries are all served.

A value head dim of its own (`D_v < D`, MLA's latent cache) runs the kernel of `mla_decode.py`.

Files: this module prepares and launches the kernels (`prepare`); `paged_decode_kernels.py` holds
them, `paged_decode_dequant.py` their word dequantization, `paged_decode_config.py` the choices from
shapes (`config`, `split_count`, `large_tile_splits`) and the knobs.

Knobs (tests, tuning): `Tuning`, changed inside `with tuning(num_splits=..., config=...):`.
A prepared launch carries its `kernels` (main, then merge) and `num_splits`. Under
TRITON_INTERPRET=1 the kernel takes a fixed trip count (the interpreter cannot use a loaded value as a loop bound with numpy >= 2.4), feeds `tl.dot`
fp32 instead of bf16 (the interpreter multiplies bf16 bit patterns) and rounds FP8 output in
fp32 (its fp32 -> e4m3 cast does not carry into the exponent): same math, CPU-testable.
"""

from __future__ import annotations

import math

import torch

from ... import errors, gpu
from ...quant import KVFormat, kv_format
from . import cdiv, interpreting, mla_decode, pow2
from .block_table import key_capacity, table_for_no_blocks
from .launcher import TritonLaunch, no_launch, scale_operands
from .paged_decode_config import (INTERPRETER_SMS, LARGE_TILE_KEYS, LARGE_TILE_MAX_BLOCK_M, ONE_PAGE_SPAN, config,
                                  large_tile_splits, split_count, tuning)
from .paged_decode_kernels import _merge_kernel, _paged_decode_kernel

MAX_HEAD_DIM = 256
MAX_BLOCK_M = 64
# Quantized tiles stop at 32 rows: at 64 their lane accumulators take ~250 registers, and with
# 16-value groups Triton 3.6 fails to compile them for sm_90 (TritonGPUOptimizeDotOperands).
MAX_BLOCK_M_QUANTIZED = 32


def _group_layout(head_dim: int, fmt: KVFormat, k_scale) -> tuple[int, int, int, int, bool]:
    """(NG, NGP, GW, QGROUP, per_group) of the [BLOCK_N, NGP, GW] word tiles: NG scale groups of
    QGROUP values per row; a group is GW = QGROUP / 4 words when that is a power of 2 (one scale
    load per group), else one padded row with a scale gathered per value."""
    block_dw = max(16, pow2(head_dim // 4))
    if fmt is KVFormat.FP8:
        return 1, 1, block_dw, head_dim, True
    ng = k_scale.shape[-1]
    qgroup = head_dim // ng
    gw = qgroup // 4
    if qgroup % 4 == 0 and gw & (gw - 1) == 0 and gw <= block_dw:
        return ng, block_dw // gw, gw, qgroup, True
    return ng, 1, block_dw, qgroup, False


def _word_view(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as words of 4 values: int32 for 1-byte formats, int16 for packed INT4."""
    word, size = (torch.int16, 2) if cache.dtype == torch.uint8 else (torch.int32, 4)
    if cache.shape[-1] * cache.element_size() % size or cache.data_ptr() % size:
        return None
    if any(st % size for st in cache.stride()[:-1]):
        return None
    return cache.view(word)


def split_workspace(num_splits: int, tokens: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials, uninitialized: fp32 out `[num_splits, T, Hq, D]` and lse `[num_splits, T, Hq]`,
    in one allocation. A split past its sequence's keys writes neither, and the merge never reads it
    (tests poison them)."""
    rows = num_splits * tokens * heads
    space = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=device)
    return (space[:rows * head_dim].view(num_splits, tokens, heads, head_dim),
            space[rows * head_dim:].view(num_splits, tokens, heads))


def unsupported(query, k_cache, v_cache, block_tables, seq_lens, **options) -> list[str]:
    """Reasons this kernel cannot run the call (the front has validated shapes and dtypes)."""
    if v_cache.shape[-1] != k_cache.shape[-1]:
        return mla_decode.unsupported(query, k_cache, v_cache, block_tables, seq_lens, **options)
    why = []
    d = query.shape[-1]
    if d > MAX_HEAD_DIM:
        why.append(f"head dim {d} > {MAX_HEAD_DIM} is not served by the Triton paged_decode kernel "
                   "(the fp32 accumulator and q tile would spill registers)")
    if query.dtype not in (torch.float16, torch.bfloat16):
        why.append(f"query dtype {query.dtype} is not served (fp16/bf16 only)")
    if kv_format(k_cache.dtype) is not KVFormat.PLAIN:
        if d % 4:
            why.append(f"a {k_cache.dtype} cache needs a head dim divisible by 4 (read as 4-value words), got {d}")
        elif k_cache.numel() and (_word_view(k_cache) is None or _word_view(v_cache) is None):
            why.append("a quantized cache must have 4-byte (INT4: 2-byte) aligned data and block/token/head "
                       f"strides (it is read as 4-value words); got strides {k_cache.stride()}")
    return why


def run(*args, **kwargs) -> None:
    """Fill `out [T, Hq, D]` and `lse [T, Hq]` (see the module docstring)."""
    prepare(*args, **kwargs)(*args, **kwargs)


def prepare(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, scale=None, q_scaling=1.0,
            alibi_slopes=None, window_left=-1, sink_tokens=0, sinks=None, softcap=0.0, out_scale=None,
            k_scale=None, v_scale=None, key_mask=None, num_blocks=None, block_error=errors.BLOCK_TABLES):
    """The launch of a call of this signature (`run`'s arguments; only their metadata is read):
    `launch(*args, **kwargs)` fills `out`/`lse` of a call with the same signature. Block ids
    outside `[0, num_blocks)` (default `k_cache.shape[0]`) are absent blocks, flagged with the
    error bit `block_error` (0: none). Values of their own head dim go to `mla_decode`."""
    if v_cache.shape[-1] != k_cache.shape[-1]:
        return mla_decode.prepare(query, k_cache, v_cache, block_tables, seq_lens, out=out, lse=lse, scale=scale,
                                  q_scaling=q_scaling, sinks=sinks, out_scale=out_scale, k_scale=k_scale,
                                  v_scale=v_scale, key_mask=key_mask, num_blocks=num_blocks, block_error=block_error)
    t, hq, d = query.shape
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return no_launch
    _, page, hkv, _ = k_cache.shape
    fmt = kv_format(k_cache.dtype)
    e5m2 = k_cache.dtype == torch.float8_e5m2
    qps, group = t // batch, hq // hkv
    rows = qps * group
    block_m = min(MAX_BLOCK_M if fmt is KVFormat.PLAIN else MAX_BLOCK_M_QUANTIZED, max(16, pow2(rows)))
    m_tiles = cdiv(rows, block_m)
    programs = batch * hkv * m_tiles   # before any split
    sms = gpu.sm_count(query.device, cpu=INTERPRETER_SMS)
    cfg = config(d, fmt, block_m, programs, sms)
    knobs = tuning.current
    if fmt.group_scaled and not _group_layout(d, fmt, k_scale)[4] and not knobs.config:
        # scales gathered per value (group not 4 x a power of 2): small tiles, no deep pipeline
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if fmt is KVFormat.PLAIN:
        block_d = max(16, pow2(d))
        block_dw = 16
    else:
        block_dw = max(16, pow2(d // 4))
        block_d = 4 * block_dw
    max_blocks = block_tables.shape[1]
    num_blocks = k_cache.shape[0] if num_blocks is None else num_blocks
    kv_cap = key_capacity(max_blocks, page, num_blocks)
    # With one page per sequence every key is in it: any tile lies in one page (and one compiled
    # kernel serves every page size, e.g. the lengths of Hugging Face static caches).
    page_span = ONE_PAGE_SPAN if max_blocks == 1 else page
    num_splits = 0
    if (fmt is KVFormat.PLAIN and block_d in LARGE_TILE_KEYS and block_m <= LARGE_TILE_MAX_BLOCK_M
            and not knobs.config and knobs.num_splits is None):
        num_splits = large_tile_splits(programs, sms)
        if num_splits:
            cfg = dict(cfg, BLOCK_N=LARGE_TILE_KEYS[block_d])
        keys, short_cfg = knobs.short_context.get(block_d, (0, {}))
        if num_splits > 1 and block_m == 16 and max_blocks * page <= keys:
            num_splits = 1
            cfg.update(short_cfg)
    block_n = cfg["BLOCK_N"]
    if (not num_splits and fmt is not KVFormat.PLAIN and knobs.num_splits is None
            and programs >= sms and max_blocks * page <= knobs.quantized_one_split_keys):
        num_splits = 1
    if not num_splits:
        per_sm = knobs.programs_per_sm or cfg.get("programs_per_sm", 2)
        num_splits = split_count(batch, hkv, m_tiles, max_blocks, page, block_n, rows, sms, per_sm)
    replicas = max(1, min(cfg.get("replicas", 1), block_m // pow2(rows)))
    # one tile per step for short splits, and for FP8 at D <= 64 in one split with GQA, where the
    # registers of two copies (126 against 71) cost more occupancy than they save instructions
    # (H200, B = 256, 32/8, ctx 1k / 4k: 82 / 368 us against 100 / 401; 32/32 heads gain from the copies)
    if not knobs.config and (max_blocks * page < knobs.replica_min_keys * num_splits
                                or (fmt is KVFormat.FP8 and d <= 64 and num_splits == 1 and group > 1)):
        replicas = 1
    chunk = replicas * block_n      # keys per loop step
    min_split = max(chunk, cdiv(knobs.min_split_tokens, chunk) * chunk)

    kc, vc, ks, vs = k_cache, v_cache, k_scale, v_scale
    ng, ngp, gw, qgroup, per_grp = 1, 1, block_dw, d, True
    ks_strides = vs_strides = (0, 0, 0)
    fp8_stride = 0
    svec = 1
    scales = "none"   # how a call passes its scales (`scale_operands`)
    if fmt is not KVFormat.PLAIN:
        kc, vc = _word_view(k_cache), _word_view(v_cache)
        ng, ngp, gw, qgroup, per_grp = _group_layout(d, fmt, k_scale)
        scales = "given"
    if fmt is KVFormat.FP8:
        fp8_stride = 1 if k_scale.dim() == 1 else 0
        if v_scale.dim() != k_scale.dim():
            # per-head K scale with a 0-d V scale (or the reverse): one stride serves both
            scales, fp8_stride = "per_head", 1
    elif fmt.group_scaled:
        if (k_scale.shape[-1] > 1 and k_scale.stride(-1) != 1) or (v_scale.shape[-1] > 1 and v_scale.stride(-1) != 1):
            ks, vs, scales = k_scale.contiguous(), v_scale.contiguous(), "contiguous"   # rare: strided last dim
        ks_strides, vs_strides = ks.stride()[:3], vs.stride()[:3]
        if per_grp:
            # the largest power of two (<= the groups per row) dividing every scale-row offset (of
            # the base address, only what the call's signature fixes: its alignment up to 16 bytes)
            vals = [*ks_strides, *vs_strides, *(_alignment(x) // x.element_size() for x in (ks, vs))]
            while svec * 2 <= ng and all(v % (svec * 2) == 0 for v in vals):
                svec *= 2
    asm = False
    if fmt is not KVFormat.PLAIN:
        asm = knobs.dequant_asm if knobs.dequant_asm is not None else (query.device.type == "cuda" and not interpreting())
        words_per_thread = block_n * ngp * gw // (32 * cfg["num_warps"])
        asm = bool(asm) and words_per_thread >= 2 and words_per_thread % 2 == 0

    no_tables = table_for_no_blocks(query.device) if not block_tables.numel() else None
    bt = block_tables if no_tables is None else no_tables
    one_page = page_span % block_n == 0
    # chunks start on multiples of `chunk`: replica tiles stay inside table rows of a multiple of it
    clamp_replicas = (one_page and replicas > 1 and page_span != ONE_PAGE_SPAN
                      and max_blocks * page_span % chunk != 0)
    # single-page tiles may address their rows with 32-bit offsets from the tile's first row. With
    # clamped replica tiles that takes FP8 to 255 registers and 56 B of spills, which pays only with
    # fewer programs than SMs (H200, 32/8 heads, replica tiles clamped, with against without: B = 1
    # ctx 1k / 4k 9.6 / 10.7 against 10.2 / 11.2 us; B = 64 157.5 against 147.1 at ctx 4k)
    rows32 = (one_page and cfg.get("rows32", False) and (replicas > 1 or num_splits > 1)
              and not (clamp_replicas and programs >= sms)
              and (block_n - 1) * max(kc.stride(1), vc.stride(1), ks_strides[1], vs_strides[1]) + d < 2**31)
    split = num_splits > 1
    if split:
        p_strides = (t * hq * d, hq * d, d, t * hq, hq)   # split_workspace's contiguous partials
    else:
        p_strides = (0, 0, 0, 0, 0)

    scale_eff = (scale if scale is not None else 1.0 / math.sqrt(d)) / q_scaling
    has_window = window_left >= 0
    static_loop = interpreting()
    max_iters = 1
    if static_loop:
        per = max(min_split, cdiv(cdiv(kv_cap, num_splits), chunk) * chunk)
        max_iters = max(1, cdiv(min(per, kv_cap), chunk) + 1
                        + (cdiv(min(sink_tokens, kv_cap), chunk) if has_window else 0))
    main = TritonLaunch(_paged_decode_kernel, (programs, num_splits), (
        float(scale_eff), float(softcap), int(window_left), int(sink_tokens), num_splits, min_split,
        query.stride(0), query.stride(1), query.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        *ks_strides, *vs_strides, fp8_stride,
        bt.stride(0), bt.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        *p_strides, *((key_mask.stride(0), key_mask.shape[1]) if key_mask is not None else (0, 0)),
        kv_cap, num_blocks,
    ), dict(
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_DW=block_dw, BLOCK_M=block_m, BLOCK_N=block_n, R=replicas, M_TILES=m_tiles,
        PAGE=page_span, ONE_PAGE=one_page, ROWS32=rows32, CLAMP_REPLICAS=clamp_replicas, QPS=qps, GROUP=group,
        NUM_KV_HEADS=hkv,
        FMT=fmt.code, E5M2=e5m2, NG=ng, NGP=ngp, GW=gw, QGROUP=qgroup, SCALE_PER_GRP=per_grp, ASM=asm,
        PRESCALE_Q=fmt is not KVFormat.PLAIN and query.dtype == torch.bfloat16,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=has_window, HAS_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, OUT_FP8=out_scale is not None, SPLIT=split,
        DYNAMIC_LOOP=not static_loop, MAX_ITERS=max_iters if static_loop else 1,
        DOT_F32=static_loop and fmt is KVFormat.PLAIN and query.dtype == torch.bfloat16, SVEC=svec,
        SCALE_F16=ks is not None and vs is not None and ks.dtype == vs.dtype == torch.float16,
        HAS_KEY_MASK=key_mask is not None, BLOCK_ERR=block_error,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    ))
    merge = merge_launch(t, hq, qps, d, block_d, num_splits, min_split, chunk, window_left, kv_cap, p_strides, out, lse,
                         sinks, out_scale, static_loop) if split else None
    word = (torch.int16 if k_cache.dtype == torch.uint8 else torch.int32) if fmt is not KVFormat.PLAIN else None
    flag = errors.device_flag(query.device)

    def launch(query, k_cache, v_cache, block_tables, seq_lens, *, out, lse, alibi_slopes=None, sinks=None,
               out_scale=None, k_scale=None, v_scale=None, key_mask=None, **_):
        kc, vc = (k_cache, v_cache) if word is None else (k_cache.view(word), v_cache.view(word))
        ks, vs = scale_operands(scales, k_scale, v_scale, hkv, lse)
        pout, plse = split_workspace(num_splits, t, hq, d, query.device) if split else (lse, lse)
        sinks_ = lse if sinks is None else sinks
        out_scale_ = lse if out_scale is None else out_scale
        main(query, kc, vc, ks, vs, block_tables if no_tables is None else no_tables, seq_lens, sinks_,
             lse if alibi_slopes is None else alibi_slopes, out_scale_, out, lse, pout, plse,
             lse if key_mask is None else key_mask.view(torch.uint8), flag)
        if merge is not None:
            merge(pout, plse, out, lse, seq_lens, sinks_, out_scale_)

    launch.describe = (f"Triton paged_decode, grid {programs} x {num_splits} split(s)"
                       f"{' + merge' if split else ''}: {block_m} query rows x {block_n}-key tiles"
                       f"{f' ({replicas} per step)' if replicas > 1 else ''}, {cfg['num_warps']} warps, "
                       f"{cfg['num_stages']} stages")
    launch.kernels = (main,) if merge is None else (main, merge)
    launch.num_splits = num_splits
    return launch


def merge_launch(t: int, hq: int, qps: int, head_dim: int, block_d: int, num_splits: int, min_split: int,
                 chunk: int, window_left: int, kv_cap: int, p_strides: tuple, out, lse, sinks, out_scale,
                 interpreted: bool) -> TritonLaunch:
    """The merge of `num_splits` split-K partials of `head_dim` values (padded to `block_d`; strides
    `p_strides` of `split_workspace`) into `out`/`lse`, for splits cut by `_split_geometry` in
    steps of `chunk` keys: tiles of <= `Tuning.merge_tile` partials, heads while they fit, then
    head-dim blocks."""
    knobs = tuning.current
    ns_p = pow2(num_splits)
    block_h = min(pow2(hq), max(1, knobs.merge_tile // (ns_p * block_d)))
    merge_d = min(block_d, max(16, knobs.merge_tile // ns_p))
    return TritonLaunch(_merge_kernel, (t, cdiv(hq, block_h), block_d // merge_d), (
        int(window_left), num_splits, min_split, qps, chunk, *p_strides,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), kv_cap,
    ), dict(
        NUM_HEADS=hq, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=merge_d,
        NS_P=ns_p, HAS_WINDOW=window_left >= 0,
        HAS_SINKS=sinks is not None, OUT_FP8=out_scale is not None, INTERPRETED=interpreted,
        num_warps=4,
    ))


def _alignment(x: torch.Tensor) -> int:
    """The largest power of two, up to 16, that divides `x`'s address in bytes."""
    a = x.data_ptr() % 16
    return a & -a if a else 16
