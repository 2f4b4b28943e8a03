"""Metadata the shape checks cannot see (it lives on the device) never makes a Triton kernel read
or write outside its tensors, and the kernels and the reference agree on what it means
(docs/ops.md, "Errors"): lengths are clamped, slots outside the cache skip their token, RoPE
positions are clamped into the table, and `cache_attention` rows outside the cache are neither
read nor written. A sequence with an absent block (an id outside the cache) gets finite rows of
no specified value; every other sequence is exact. The kernels set a bit per
argument class in the device error flag; `torch_ops.check_errors()` raises naming them. Under the
interpreter, the paged kernels' loads are watched for any read of the margins laid around the
block-table rows and the caches (`GuardedLoads`)."""

import numpy as np
import pytest
import torch

import torch_ops
from torch_ops import errors, reference
from torch_ops.testing import assert_error_ratio
from torch_ops.kernels.triton import paged_decode, prefill_attention

from ... import samples
from .test_cache_attention import check as check_cache_attention, make_problem as cache_attention_problem
from .test_mla_decode import D as MLA_D, DV as MLA_DV
from .test_prefill_attention import check


pytestmark = pytest.mark.usefixtures("clear_error_flags")


def _raised() -> str:
    """`check_errors()`'s message, or "" if it does not raise."""
    try:
        torch_ops.check_errors()
    except ValueError as e:
        return str(e)
    return ""


def _assert_flagged(*names: str) -> None:
    """The calls since the last check flagged exactly the argument classes of `names`, and the
    check cleared the flags."""
    message = _raised()
    for bit, text in errors.MESSAGES.items():
        flagged = text in message
        expected = any(text.startswith(name) for name in names)
        assert flagged == expected, f"{text!r} flagged: {flagged}, expected {expected}; message: {message!r}"
    assert _raised() == "", "check_errors did not clear the flags"


def _cache(device, hkv=2, d=16, bs=4, blocks=8, fmt="bf16"):
    return samples.paged_cache(blocks, bs, hkv, d, fmt, device=device)


def _check(op, args, kwargs, backend="triton"):
    with torch_ops.use_backend(backend):
        out, lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    check(op, args, out, lse, **kwargs)


def _check_other_sequences(op, args, kwargs, rows, exact, backend="triton"):
    """`op` on `backend`: finite everywhere, and as the reference on the rows of the sequences that
    have no absent block (`exact`: per sequence; `rows`: query rows per sequence)."""
    with torch_ops.use_backend(backend):
        out, lse = getattr(torch.ops.attn, op)(*args, **kwargs)
    assert torch.isfinite(out.float()).all() and not torch.isnan(lse).any()
    keep = torch.repeat_interleave(torch.tensor(exact), torch.tensor(rows)).to(out.device)
    truth_o, truth_l = getattr(reference, op)(*args, compute_dtype=torch.float64, **kwargs)
    base_o, base_l = getattr(reference, op)(*args, compute_dtype=args[0].dtype, **kwargs)
    assert_error_ratio(out[keep], truth_o[keep], base_o[keep])
    assert_error_ratio(lse[keep], truth_l[keep], base_l[keep], name="lse")


def _index(rows, device):
    return torch.tensor(rows, dtype=torch.int32, device=device)


# ---- lengths -------------------------------------------------------------------------------------


def test_decode_lengths_past_the_table_or_negative(kernel_device):
    k, v, _ = _cache(kernel_device)
    tables = _index([[0, 1], [2, 3], [4, 5]], kernel_device)   # 8 keys each
    lens = _index([8 + 50, -3, 5], kernel_device)
    q = torch.randn(3, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    _check("paged_decode", (q, k, v, tables, lens), {})
    _assert_flagged("seq_lens")


def test_decode_with_an_empty_block_table(kernel_device):
    # no table columns: every length clamps to 0 (zeros, lse -inf), and the call records like any other
    k, v, _ = _cache(kernel_device)
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    _check("paged_decode", (q, k, v, _index([[], []], kernel_device).view(2, 0), _index([5, 0], kernel_device)), {})
    _assert_flagged("seq_lens")


def test_prefill_lengths_past_the_table_and_queries_past_the_tokens(kernel_device):
    k, v, _ = _cache(kernel_device)
    tables = _index([[0, 1], [2, 3]], kernel_device)
    q = torch.randn(7, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    cu = _index([0, 3, 40], kernel_device)   # the last sequence ends past T = 7
    lens = _index([30, 6], kernel_device)    # the first one past its 8 keys
    _check("paged_prefill", (q, k, v, tables, cu, lens), {"causal": True})
    _assert_flagged("seq_lens", "cu_seqlens")


@pytest.mark.parametrize("causal", [True, False])
def test_context_boundaries_past_the_tokens(kernel_device, causal):
    q = torch.randn(9, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    k, v = (torch.randn(11, 2, 16, dtype=torch.bfloat16, device=kernel_device) for _ in range(2))
    cu_q = _index([0, 4, 30], kernel_device)
    cu_k = _index([0, 6, 90], kernel_device)
    _check("context_attention", (q, k, v, cu_q, cu_k), {"causal": causal})
    _assert_flagged("cu_seqlens")


def test_good_metadata_flags_nothing(kernel_device):
    k, v, _ = _cache(kernel_device)
    tables = _index([[0, 1], [2, 3]], kernel_device)
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    flag = errors.device_flag(kernel_device)
    address = flag.data_ptr()
    _check("paged_decode", (q, k, v, tables, _index([8, 0], kernel_device)), {})
    _assert_flagged()
    assert errors.device_flag(kernel_device) is flag and flag.data_ptr() == address


# ---- block ids -----------------------------------------------------------------------------------

# (block size, config): per-row table lookups; one lookup per tile with two 16-key tiles per step
DECODE_TILES = [(4, None), (16, {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "replicas": 2})]


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("bs,config", DECODE_TILES)
def test_decode_block_ids_outside_the_cache(kernel_device, fmt, bs, config, softcap):
    k, v, scales = _cache(kernel_device, bs=bs, fmt=fmt)
    # 8 blocks; the last sequence's bad id lies past the blocks its keys use
    tables = _index([[0, 9, 1], [-2, 3, 6], [4, 5, 7], [8, -1, 2], [3, 2, 6], [1, 0, -3]], kernel_device)
    lens = _index([3 * bs, 2 * bs + 1, 3 * bs - 1, 2 * bs, 3 * bs, 2 * bs], kernel_device)
    q = torch.randn(6, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    with paged_decode.tuning(config=config):
        _check_other_sequences("paged_decode", (q, k, v, tables, lens), dict(scales, softcap=softcap),
                               rows=[1] * 6, exact=[False, False, True, False, True, True])
    _assert_flagged("block_tables")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bs", [16, 5])
def test_prefill_block_ids_outside_the_cache(kernel_device, causal, bs):
    k, v, _ = _cache(kernel_device, bs=bs, blocks=12)
    tables = _index([[3, 12, 0, -5, 1, 2, 4, 5], [6, 7, 8, 9, -1, 10, 11, 0], [11, 10, 9, 8, 7, 6, 5, 4]],
                    kernel_device)
    lens = _index([40, 33, 38], kernel_device)
    q = torch.randn(41, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    cu = _index([0, 20, 23, 41], kernel_device)
    # 16 x 16 tiles: the absent blocks lie in tiles every row sees (the unmasked loop) and in masked ones
    with prefill_attention.tuning(config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}):
        _check_other_sequences("paged_prefill", (q, k, v, tables, cu, lens), {"causal": causal},
                               rows=[20, 3, 18], exact=[False, bs == 16, True])
    _assert_flagged("block_tables")


def test_debug_mode_raises_at_the_call(kernel_device, monkeypatch):
    monkeypatch.setenv("ATTN_DEBUG", "1")
    k, v, _ = _cache(kernel_device)
    q = torch.randn(1, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    with torch_ops.use_backend("triton"), pytest.raises(ValueError, match="block_tables"):
        torch.ops.attn.paged_decode(q, k, v, _index([[0, 8]], kernel_device), _index([8], kernel_device))


# ---- reads outside the tables and caches (interpreter) --------------------------------------------


class GuardedLoads:
    """Watches the loads of Triton's interpreter: a load whose mask lets it read an address in a
    guard (margins laid around a block table's rows, or blocks around a cache) is a read outside
    what the metadata may address. `table`/`cache` return the guarded tensor's inner view."""

    MARGIN = 3   # table entries each side of a row; blocks each side of a cache

    def __init__(self):
        # (guarded tensor, which of its byte offsets are guard); holding the tensor keeps its
        # memory from being reused by other tensors while the loads are watched
        self.guards: list[tuple[torch.Tensor, object]] = []
        self.reads = 0

    def watch(self, ptrs, mask):
        addresses = np.asarray(ptrs.data).astype(np.uint64).ravel()
        live = np.broadcast_to(np.asarray(mask.data).astype(bool), np.shape(ptrs.data)).ravel()
        for wide, is_guard in self.guards:
            lo, hi = wide.data_ptr(), wide.data_ptr() + wide.numel() * wide.element_size()
            inside = addresses[live & (addresses >= lo) & (addresses < hi)]
            self.reads += int(is_guard(inside - np.uint64(lo)).sum())

    def table(self, rows: torch.Tensor) -> torch.Tensor:
        m, width = self.MARGIN, rows.shape[1]
        wide = torch.zeros(rows.shape[0], m + width + m, dtype=rows.dtype, device=rows.device)
        wide[:, m:m + width] = rows
        row_bytes = wide.shape[1] * wide.element_size()
        self.guards.append((wide, lambda off: ~np.isin(off % np.uint64(row_bytes) // np.uint64(wide.element_size()),
                                                       np.arange(m, m + width, dtype=np.uint64))))
        return wide[:, m:m + width]

    def cache(self, blocks: torch.Tensor) -> torch.Tensor:
        m, n = self.MARGIN, blocks.shape[0]
        wide = torch.zeros((m + n + m, *blocks.shape[1:]), dtype=blocks.dtype, device=blocks.device)
        wide[m:m + n] = blocks
        block_bytes = blocks[0].numel() * blocks.element_size()
        inner = np.uint64(m * block_bytes), np.uint64((m + n) * block_bytes)
        self.guards.append((wide, lambda off: (off < inner[0]) | (off >= inner[1])))
        return wide[m:m + n]


@pytest.fixture
def guarded(kernel_device, monkeypatch):
    if kernel_device.type != "cpu":
        pytest.skip("watches the loads of Triton's interpreter (CPU)")
    from triton.runtime import interpreter
    loads = GuardedLoads()
    load = interpreter.InterpreterBuilder.create_masked_load

    def watched(builder, ptrs, mask, *rest, **kwargs):
        loads.watch(ptrs, mask)
        return load(builder, ptrs, mask, *rest, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", watched)
    return loads


def _guarded_paged(guarded, fmt, bs, hkv, d, lens, max_blocks, blocks):
    """A guarded cache of `blocks` blocks and a guarded table of `max_blocks` columns for sequences of
    `lens` keys (clamped into the table), with block ids outside the cache in its first and last rows."""
    k, v, scales = samples.paged_cache(blocks, bs, hkv, d, fmt)
    k, v = guarded.cache(k), guarded.cache(v)
    scales = {name: guarded.cache(s) if s.dim() == 4 else s for name, s in scales.items()}
    table = samples.block_tables_for([min(max(n, 0), max_blocks * bs) for n in lens], bs, blocks, max_blocks)
    table[0, -1], table[-1, 0] = blocks, -1
    return k, v, scales, guarded.table(table), _index(lens, "cpu")


# lengths at, under and past the table's capacity (3 blocks of 16), negative, and short
GUARD_LENS = [48, 47, 31, 48 + 40, 1, -2]


@pytest.mark.parametrize("window", [None, (7, 5)], ids=["full", "window+sinks"])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "int8"])
@pytest.mark.parametrize("max_blocks", [3, 4], ids=["row-of-48-keys", "row-of-64-keys"])
def test_decode_reads_nothing_outside_the_table_and_cache(guarded, fmt, replicas, splits, window, max_blocks):
    # 16-key pages of one table entry per tile and several tiles per step (replicas): a replica's
    # tile can start past a sequence's keys, and past a table row of 48 keys (not a multiple of
    # the 32 or 64 keys per step); 64-key rows hold every step's tiles
    lens = [n + 16 * (max_blocks - 3) if n > 1 else n for n in GUARD_LENS]
    k, v, scales, table, lens = _guarded_paged(guarded, fmt, 16, 2, 32, lens, max_blocks, 24)
    q = torch.randn(len(lens), 8, 32, dtype=torch.bfloat16)
    options = dict(window_left=window[0], sink_tokens=window[1]) if window else {}
    config = {"BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "replicas": replicas, "rows32": True}
    with paged_decode.tuning(config=config, num_splits=splits, min_split_tokens=16), torch_ops.use_backend("triton"):
        torch.ops.attn.paged_decode(q, k, v, table, lens, **scales, **options)
    assert guarded.reads == 0, f"{guarded.reads} reads outside the block table rows or the cache"
    _assert_flagged("block_tables", "seq_lens")


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_reads_nothing_outside_the_table_and_cache(guarded, splits):
    k, _, _, table, lens = _guarded_paged(guarded, "bf16", 16, 1, MLA_D, GUARD_LENS, 3, 24)
    q = torch.randn(len(lens), 16, MLA_D, dtype=torch.bfloat16)
    with paged_decode.tuning(num_splits=splits, min_split_tokens=16), torch_ops.use_backend("triton"):
        torch.ops.attn.paged_decode(q, k, k[..., :MLA_DV], table, lens)
    assert guarded.reads == 0, f"{guarded.reads} reads outside the block table rows or the cache"
    _assert_flagged("block_tables", "seq_lens")


@pytest.mark.parametrize("bs", [16, 5])
def test_prefill_reads_nothing_outside_the_table_and_cache(guarded, bs):
    lens = [3 * bs, 3 * bs - 1, 2 * bs + 1, 3 * bs + 20]
    k, v, _, table, seq_lens = _guarded_paged(guarded, "bf16", bs, 2, 16, lens, 3, 16)
    q = torch.randn(4 * 6, 4, 16, dtype=torch.bfloat16)
    cu = _index([0, 6, 12, 18, 24], "cpu")
    with prefill_attention.tuning(config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}), \
            torch_ops.use_backend("triton"):
        torch.ops.attn.paged_prefill(q, k, v, table, cu, seq_lens, causal=True)
    assert guarded.reads == 0, f"{guarded.reads} reads outside the block table rows or the cache"
    _assert_flagged("block_tables", "seq_lens")


# ---- slots and RoPE positions --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_kv_cache_write_slots_and_positions_outside(kernel_device, fmt):
    k_cache, v_cache, scales = _cache(kernel_device, bs=4, blocks=4, fmt=fmt)   # 16 slots
    key, value = (torch.randn(6, 2, 16, dtype=torch.bfloat16, device=kernel_device) for _ in range(2))
    query = torch.randn(6, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    slots = _index([0, 3, 16, 100, -1, 7], kernel_device)   # -1: skip (documented), 16 and 100: outside
    rope = dict(query=query, positions=_index([0, 5, -3, 40, 2, 31], kernel_device),
                cos_sin_cache=reference.rope_cos_sin_cache(32, 8).to(kernel_device))
    ours = [x.clone() for x in (k_cache, v_cache, *scales.values())]
    theirs = [x.clone() for x in ours]
    with torch_ops.use_backend("triton"):
        rotated = torch.ops.attn.kv_cache_write(key, value, *ours[:2], slots, **dict(zip(scales, ours[2:])), **rope)
    want = reference.kv_cache_write(key, value, *theirs[:2], slots, **dict(zip(scales, theirs[2:])), **rope)
    for got, expected in zip(ours, theirs):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(rotated, want)
    _assert_flagged("slot_mapping", "positions")


def test_kv_cache_write_skip_value_flags_nothing(kernel_device):
    k_cache, v_cache, _ = _cache(kernel_device, bs=4, blocks=4)
    key, value = (torch.randn(3, 2, 16, dtype=torch.bfloat16, device=kernel_device) for _ in range(2))
    with torch_ops.use_backend("triton"):
        torch.ops.attn.kv_cache_write(key, value, k_cache, v_cache, _index([-1, 15, -7], kernel_device))
    _assert_flagged()


def test_context_rope_positions_outside_the_table(kernel_device):
    q = torch.randn(9, 4, 16, dtype=torch.bfloat16, device=kernel_device)
    k, v = (torch.randn(9, 2, 16, dtype=torch.bfloat16, device=kernel_device) for _ in range(2))
    cu = _index([0, 4, 9], kernel_device)
    rope = dict(positions=_index([0, 1, 2, -4, 0, 1, 2, 16, 900], kernel_device),
                cos_sin_cache=reference.rope_cos_sin_cache(16, 16).to(kernel_device))
    _check("context_attention", (q, k, v, cu, cu), {"causal": True, **rope})
    _assert_flagged("positions")


# ---- cache_attention -----------------------------------------------------------------------------


def test_cache_attention_offsets_outside_the_cache(kernel_device):
    # sequence 0 starts before row 0 (reads and writes nothing); sequence 1 runs past the last row
    # (reads the 2 keys inside, writes none of its tokens), into rows appended for it
    args, kwargs = cache_attention_problem(kernel_device, seqlens=[2, 3], start_pos=[3, 2])
    args = list(args)
    args[10] = torch.cat([args[10], torch.randn_like(args[10][:4])])
    args[5] = _index([-10, args[10].shape[0] - 2], kernel_device)
    check_cache_attention((args, kwargs))
    _assert_flagged("cachestarts")


def test_cache_attention_pages_outside_the_cache(kernel_device):
    # sequence 0's first page starts before row 0, sequence 1's only page ends past the last row;
    # sequence 2 is whole
    args, kwargs = cache_attention_problem(kernel_device, seqlens=[2, 3, 2], start_pos=[5, 0, 3], cache_mode=1)
    args = list(args)
    args[5] = args[5].clone()
    args[5][0, 0] = -4
    args[5][1, 0] = args[10].shape[0] - 2
    check_cache_attention((args, kwargs), exact_rows=torch.tensor([False] * 5 + [True] * 2, device=kernel_device))
    _assert_flagged("cachestarts")


def test_cache_attention_key_count_past_max_kvlen(kernel_device):
    args, kwargs = cache_attention_problem(kernel_device, seqlens=[3], start_pos=[4])
    args = list(args)
    args[4] = args[4] + _index([0, 50], kernel_device)
    check_cache_attention((args, kwargs))
    _assert_flagged("kvstarts")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "e4m3"])
def test_cuda_decode_absent_blocks_and_clamped_lengths(csrc_libraries, fmt):
    """The CUDA decode kernel (csrc/decode_sm90.cu) on bad metadata, over more than 32 key tiles:
    what the reference does, and the same bits flagged."""
    k, v, scales = samples.paged_cache(80, 16, 2, 128, fmt, device="cuda")
    tables = samples.block_tables_for([700, 300, 40], 16, 80, max_blocks=48).cuda()
    tables[0, 3], tables[0, 40], tables[1, 0] = 80, -2, 1000   # outside [0, 80): absent blocks
    lens = _index([700, 300 + 10_000, -5], "cuda")             # past the table, negative
    q = torch.randn(3, 8, 128, dtype=torch.bfloat16, device="cuda")
    _check("paged_decode", (q, k, v, tables, lens), scales, backend="cuda")
    _assert_flagged("block_tables", "seq_lens")


@pytest.mark.gpu
def test_cutlass_paged_prefill_absent_blocks_and_clamped_lengths(csrc_libraries):
    """The CUTLASS paged kernel (csrc/fmha_sm90.cu) on bad metadata: the other sequences exact, every
    row finite, the same bits flagged."""
    k, v, _ = samples.paged_cache(80, 16, 2, 128, "bf16", device="cuda")
    tables = samples.block_tables_for([300, 200, 150], 16, 80, max_blocks=24).cuda()
    tables[0, 3], tables[1, 0] = 80, -2                  # outside [0, 80): absent blocks
    lens = _index([300, 200, 150 + 10_000], "cuda")      # the last one past the table: clamped to 384
    q = torch.randn(3 * 64, 8, 128, dtype=torch.bfloat16, device="cuda")
    cu = _index([0, 64, 128, 192], "cuda")
    _check_other_sequences("paged_prefill", (q, k, v, tables, cu, lens), {"causal": True}, rows=[64] * 3,
                           exact=[False, False, True], backend="cutlass")
    _assert_flagged("block_tables", "seq_lens")
