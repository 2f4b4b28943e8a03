"""The support matrix (torch_ops/support.py) and the copy of it in docs/guide.md."""

from pathlib import Path

from torch_ops import support

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


def test_the_guide_carries_the_current_support_matrix():
    text = GUIDE.read_text()
    between = text.split(support.BEGIN)[1].split(support.END)[0]
    assert between.strip() == support.markdown().strip(), "run: python -m torch_ops.support --write docs/guide.md"


def test_the_matrix_comes_from_the_backends_checks():
    decode = support.served("paged_decode")
    assert 256 in decode["head dim"]["triton"] and 256 not in decode["head dim"]["cuda"]
    assert "fp32" not in decode["query dtype"]["vanilla"]   # the op's validation rejects it: no backend lists it
    assert "ALiBi" in decode["options"]["triton"] and decode["options"]["cuda"] == []
    mla = decode["D / D_v (values of their own head dim)"]
    assert "576 / 512 (MLA)" in mla["triton"] and mla["cuda"] == []
    context = support.served("context_attention")
    assert "FP8 e4m3" in context["query dtype"]["cutlass"] and 80 not in context["head dim"]["cutlass"]
