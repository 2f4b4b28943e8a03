"""The op schemas, pinned: a contract change shows up here in review (EXPECTTEST_ACCEPT=1 updates)."""

import expecttest
import torch

import torch_ops  # noqa: F401


def schema(qualname: str) -> str:
    name, _, overload = qualname.partition(".")
    text = str(getattr(getattr(torch.ops.attn, name), overload or "default")._schema)
    return text.replace(", *, ", ",\n  *, ").replace("(Tensor", "(\n  Tensor", 1)


class TestSchemas(expecttest.TestCase):
    def test_paged_decode(self):
        self.assertExpectedInline(schema("paged_decode"), """\
attn::paged_decode(
  Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
  *, float? scale=None, float q_scaling=1., Tensor? alibi_slopes=None, int window_left=-1, int sink_tokens=0, Tensor? sinks=None, float softcap=0., Tensor? out_scale=None, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? key_mask=None) -> (Tensor out, Tensor lse)""")

    def test_paged_decode_out(self):
        self.assertExpectedInline(schema("paged_decode.out"), """\
attn::paged_decode.out(
  Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens,
  *, float? scale=None, float q_scaling=1., Tensor? alibi_slopes=None, int window_left=-1, int sink_tokens=0, Tensor? sinks=None, float softcap=0., Tensor? out_scale=None, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? key_mask=None, Tensor(a!) out, Tensor(b!) lse) -> ()""")

    def test_paged_prefill(self):
        self.assertExpectedInline(schema("paged_prefill"), """\
attn::paged_prefill(
  Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens,
  *, bool causal=True, float? scale=None, float q_scaling=1., Tensor? alibi_slopes=None, int window_left=-1, int sink_tokens=0, Tensor? sinks=None, float softcap=0., Tensor? out_scale=None, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? key_mask=None) -> (Tensor out, Tensor lse)""")

    def test_context_attention(self):
        self.assertExpectedInline(schema("context_attention"), """\
attn::context_attention(
  Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  *, bool causal=False, float? scale=None, float q_scaling=1., Tensor? alibi_slopes=None, int window_left=-1, int sink_tokens=0, Tensor? sinks=None, float softcap=0., Tensor? out_scale=None, Tensor? q_scale=None, Tensor? k_scale=None, Tensor? v_scale=None, ScalarType? out_dtype=None, Tensor? positions=None, Tensor? cos_sin_cache=None, bool rope_neox=True, Tensor? key_mask=None) -> (Tensor out, Tensor lse)""")

    def test_kv_cache_write(self):
        self.assertExpectedInline(schema("kv_cache_write"), """\
attn::kv_cache_write(
  Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping,
  *, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None, Tensor? query=None, Tensor? positions=None, Tensor? cos_sin_cache=None, bool rope_neox=True) -> Tensor""")

    def test_merge_states(self):
        self.assertExpectedInline(schema("merge_states"), """\
attn::merge_states(
  Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor out, Tensor lse)""")

    def test_cache_attention(self):
        self.assertExpectedInline(schema("cache_attention"), """\
attn::cache_attention(
  Tensor query, Tensor current_key, Tensor current_value, Tensor seqstarts, Tensor kvstarts, Tensor cachestarts, Tensor start_pos, Tensor decoding_batches, SymInt max_seqlen, SymInt max_kvlen, Tensor(a!) cache, Tensor(b!)? scale=None, Tensor? attn_mask=None,
  *, int num_heads, int head_dim, bool is_causal=True, bool is_alibi=False, int num_kv_heads=0, int num_layer=1, int layer_idx=0, int quant_bit=0, int quant_group=8, int cache_mode=0, int cache_layout=0, int page_size=128) -> Tensor""")

    def test_every_op_listed(self):
        names = sorted(n for n in dir(torch.ops.attn) if not n.startswith("_") and n not in ("name",))
        ops_ = [n for n in names if isinstance(getattr(torch.ops.attn, n), torch._ops.OpOverloadPacket)]
        self.assertExpectedInline(str(ops_), """['cache_attention', 'context_attention', 'kv_cache_write', 'merge_states', 'paged_decode', 'paged_prefill']""")
