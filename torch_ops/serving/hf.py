"""Hugging Face transformers integration: `register()` adds "attn_ops" to transformers'
`AttentionInterface` (with FlashAttention's mask convention: no mask, or a 2-D padding mask), so
that `AutoModel...(config, attn_implementation="attn_ops")` runs its attention on
`torch.ops.attn.context_attention`: packed, unpadded, GQA without repeating k/v, sliding
windows, soft-capping and learned sinks (gpt-oss's `s_aux`). Packed inputs with
`cu_seq_lens_q`/`cu_seq_lens_k` (transformers' continuous batching) are used as they come.
"""

from __future__ import annotations

import torch

NAME = "attn_ops"


def register(name: str = NAME) -> str:
    """Register the attention function and its mask convention under `name`; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _lengths_to_cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      is_causal: bool | None = None, **kwargs):
    """transformers' attention-function contract: `query [B, Hq, S, D]`, `key`/`value
    [B, Hkv, L, D]`, `attention_mask` None or a bool padding mask `[B, L]` (True = token) ->
    `(out [B, S, Hq, D], None)`. Padded query rows get zeros."""
    if dropout:
        raise ValueError(f"dropout must be 0 (attn_ops is for inference), got {dropout}")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported by attn_ops (it never forms the weights)")
    b, hq, s, d = query.shape
    length = key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q = query.transpose(1, 2)   # [B, S, Hq, D]
    k = key.transpose(1, 2)     # [B, L, Hkv, D]
    v = value.transpose(1, 2)
    rows = None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        if b != 1:
            raise ValueError(f"packed inputs (cu_seq_lens_q) need batch size 1, got query {tuple(query.shape)}")
        cu_q, cu_k = kwargs["cu_seq_lens_q"].int(), kwargs["cu_seq_lens_k"].int()
        q, k, v = q[0], k[0], v[0]
    elif attention_mask is None:
        cu_q = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s
        cu_k = torch.arange(b + 1, device=q.device, dtype=torch.int32) * length
        q, k, v = q.reshape(b * s, hq, d), k.reshape(b * length, -1, d), v.reshape(b * length, -1, d)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape != (b, length):
            raise ValueError(
                f"attention_mask must be None or a padding mask [B, L] = [{b}, {length}] (register() "
                f"installs that convention), got shape {tuple(attention_mask.shape)}"
            )
        keep_k = attention_mask.bool()
        keep_q = keep_k[:, -s:]
        rows = keep_q.reshape(-1).nonzero().squeeze(1)  # synchronizes: unpadding needs the sizes
        cu_q, cu_k = _lengths_to_cu(keep_q.sum(1)), _lengths_to_cu(keep_k.sum(1))
        q, k, v = q.reshape(b * s, hq, d)[rows], k[keep_k], v[keep_k]
    out, _ = torch.ops.attn.context_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, causal=bool(causal), scale=scaling,
        window_left=sliding_window - 1 if sliding_window else -1, softcap=softcap or 0.0,
        sinks=None if s_aux is None else s_aux.float())
    if rows is not None:
        padded = out.new_zeros(b * s, hq, d)
        padded[rows] = out
        out = padded
    return out.view(b, s, hq, d), None
