"""The functions the passes call in rewritten graphs. AOTAutograd traces through them, so their
packing and table-building ops reach Inductor as ordinary ops (fused into neighbouring kernels)."""

from __future__ import annotations

import torch

import torch_ops  # noqa: F401  (registers torch.ops.attn)


def rope_table(cos: torch.Tensor, sin: torch.Tensor, tokens: tuple, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(positions [N], cos_sin_cache [N, R])` for the ops' RoPE from per-token tables: `cos`/`sin`
    broadcastable to `(*tokens, R)` (N = prod(tokens)), each value repeated for both elements of
    its rotated pair (`cat([c, c], -1)` for NeoX, `repeat_interleave(c, 2, -1)` for GPT-J, as the
    rope pass has proven). Token n's row is n: `positions = arange(N)`."""
    rot = cos.shape[-1]
    pick = (lambda t: t[..., : rot // 2]) if neox else (lambda t: t[..., ::2])
    table = torch.cat([pick(cos), pick(sin)], dim=-1).float().expand(*tokens, rot).reshape(-1, rot)
    positions = torch.arange(table.shape[0], dtype=torch.int32, device=table.device)
    return positions, table


def key_mask_of(mask: torch.Tensor) -> torch.Tensor:
    """The bool mask of `mask`: itself if bool; for a float additive mask whose every value is 0
    or at most the dtype's lowest (`-inf`, Hugging Face's `finfo.min`), `mask == 0`, with a
    device-side assert that fails the call on any other value (the rewrite would not be exact)."""
    if mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    torch._assert_async(torch.all(keep | (mask <= torch.finfo(mask.dtype).min)),
                        "attn key_mask: a float attention mask holds values other than 0 and -inf")
    return keep


def check_alibi(rows: torch.Tensor, batch: int, positions=None, query_positions=None) -> None:
    """A device-side assert that fails the call where the op's ALiBi, `-slope * |p - k|`, is not
    the model's `slope * position(k)` up to a term constant per row on the keys each query sees,
    `rows [batch * Sq, Sk]` (bool): a key seen after the op's query position `query_positions
    [Sq]` (p of each query), or run-time `positions [batch or 1, Sk]` that differ from the key
    index by more than one number over a row's keys (e.g. a padding mask with a hole)."""
    sk = rows.shape[-1]
    seen = rows.view(batch, -1, sk)
    keys = torch.arange(sk, device=rows.device)
    bad = torch.zeros((), dtype=torch.bool, device=rows.device)
    if query_positions is not None:
        bad = bad | (seen & (keys > query_positions[:, None])).any()
    if positions is not None:
        offset = (positions.long() - keys).expand(batch, sk)[:, None, :]
        lowest = torch.where(seen, offset, torch.iinfo(torch.int64).max).amin(-1)
        highest = torch.where(seen, offset, torch.iinfo(torch.int64).min).amax(-1)
        bad = bad | (highest > lowest).any()
    torch._assert_async(~bad, "attn alibi_slopes: a query sees a key after its position, or the model's ALiBi "
                              "positions are not the key index up to a constant on the keys a query sees")


def context_attention_bhsd(query, key, value, *, causal: bool, scale: float | None, q_factor=None,
                           out_scale=None, cos=None, sin=None, rope_neox: bool = True, window_left: int = -1,
                           softcap: float = 0.0, sinks=None, alibi_slopes=None, key_mask=None, alibi_positions=None,
                           alibi_checked: bool = False):
    """SDPA on `query [B, Hq, Sq, D]`, `key [B, Hkv, Sk, D]`, `value [B, Hkv, Sk, D_v]` through
    `attn::context_attention`; returns `[B, Hq, Sq, D_v]` (a transposed view of `[B*Sq, Hq, D_v]`).

    `q_factor` (a symbolic number): the query is multiplied by it first (a scale known only at
    run time; the op's `scale` is a float). `window_left`: the op's sliding window (causal
    attention to keys `q - window_left .. q`; -1: none) and `softcap` (scores `softcap * tanh(s /
    softcap)`; 0: none) are the op's, and so are `sinks` (`[Hq]` learned sink logits, any float
    dtype) and `alibi_slopes` (`[Hq]` fp32: `-slope * |q - k|` added to the scores). `out_scale`
    (0-d fp32): FP8 e4m3 output, `clamp(out / out_scale, -448, 448)`. `cos`/`sin` (broadcastable
    to `[B, 1, S, R]`, Sq == Sk, see `rope_table`): query and key are rotated (RoPE, partial when
    R < D) inside the op. `key_mask` (bool, or a 0/-inf float mask: `key_mask_of`; broadcastable to
    `[B, 1, Sq, Sk]`): which keys each query sees (any pattern: e.g. left padding), the op's
    `key_mask` row by row; with ALiBi, `check_alibi` fails the call if a query sees a key after
    its position in the op (`Sk - Sq + i`), or, given the model's `alibi_positions [B, Sk]`, if
    they are not the key index up to a constant on each row's keys (`alibi_checked`: an earlier
    layer over the same mask and positions checks them)."""
    b, hq, sq, _ = query.shape
    sk = key.shape[2]

    def pack(x):
        return x.transpose(1, 2).reshape(b * x.shape[2], x.shape[1], x.shape[3])

    def cu_seqlens(s):
        return torch.arange(b + 1, dtype=torch.int32, device=query.device) * s

    if q_factor is not None:
        query = query * q_factor
    rope = {}
    if cos is not None:
        positions, table = rope_table(cos, sin, (b, 1, sq), rope_neox)
        rope = dict(positions=positions, cos_sin_cache=table, rope_neox=rope_neox)
    rows = None if key_mask is None else key_mask_of(key_mask).expand(b, 1, sq, sk)[:, 0].reshape(b * sq, sk)
    if rows is not None and alibi_slopes is not None and not alibi_checked:
        check_alibi(rows, b, alibi_positions, torch.arange(sk - sq, sk, device=query.device))
    out, _ = torch.ops.attn.context_attention(
        pack(query), pack(key), pack(value), cu_seqlens(sq), cu_seqlens(sk), causal=causal, scale=scale,
        out_scale=out_scale, window_left=window_left, softcap=softcap,
        sinks=sinks.float() if sinks is not None else None, alibi_slopes=alibi_slopes, key_mask=rows, **rope)
    return out.view(b, sq, hq, value.shape[3]).transpose(1, 2)


def paged_decode_bhsd(query, key, value, mask=None, *, scale: float | None, q_factor=None, out_scale=None,
                      block_tables=None, seq_lens=None, key_mask: bool = False, softcap: float = 0.0, sinks=None,
                      alibi_slopes=None, alibi_positions=None):
    """SDPA of one query per sequence, `query [B, Hq, 1, D]`, over `key [B, Hkv, S, D]` and `value
    [B, Hkv, S, D_v]` (e.g. a static KV cache) through `attn::paged_decode`, reading the keys in
    place: each sequence is one page of S tokens (`k.transpose(1, 2)`, block table `[[0], [1],
    ...]`).
    `mask` (bool `[..., 1, S]`, proven by `index_mask.is_key_prefix` to keep the same prefix of
    the keys in every row; None: all S keys) gives the sequence length: its number of true keys.
    With `key_mask`, `mask` (bool or a 0/-inf float mask, one for all heads; see `key_mask_of`) is
    any pattern: it goes to the op as each sequence's `key_mask` row, and the length is its last
    visible key + 1, the query's position (ALiBi's `-slope * |p - j|` is measured from it; the
    model's run-time `alibi_positions [B, S]` are checked as in `context_attention_bhsd`).
    `block_tables` (int32 `[B, 1]`) and `seq_lens` (int32 `[B]`), when given, are those tables
    already made (graph constants when B and S are static). Returns `[B, Hq, 1, D_v]`;
    `q_factor`, `out_scale`, `softcap`, `sinks` and `alibi_slopes` as in `context_attention_bhsd`."""
    b, s = query.shape[0], key.shape[2]
    device = query.device
    rows = None
    if key_mask:
        rows = key_mask_of(mask).expand(b, 1, 1, s)[:, 0, 0, :]
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        seq_lens = (rows * torch.arange(1, s + 1, device=device)).amax(-1).to(torch.int32)
        if alibi_positions is not None:
            check_alibi(rows, b, alibi_positions)
    if seq_lens is None and mask is None:
        seq_lens = torch.full((b,), s, dtype=torch.int32, device=device)
    elif seq_lens is None:
        row = mask[(0,) * (mask.dim() - 1)]
        seq_lens = row.sum(dtype=torch.int32).expand(b).contiguous()
    if q_factor is not None:
        query = query * q_factor
    if block_tables is None:
        block_tables = torch.arange(b, dtype=torch.int32, device=device).unsqueeze(1)
    out, _ = torch.ops.attn.paged_decode(query[:, :, 0], key.transpose(1, 2), value.transpose(1, 2), block_tables,
                                         seq_lens, scale=scale, out_scale=out_scale, key_mask=rows, softcap=softcap,
                                         sinks=sinks.float() if sinks is not None else None,
                                         alibi_slopes=alibi_slopes)
    return out.unsqueeze(2)
