"""Inductor passes that rewrite model attention onto `torch.ops.attn.*` (see issue: FX passes)."""
