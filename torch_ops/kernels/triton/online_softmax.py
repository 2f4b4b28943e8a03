"""The online-softmax step shared by the Triton attention kernels (decode, MLA decode, prefill)."""

import triton
import triton.language as tl


@triton.jit
def softmax_step(s, m_i, l_i, MAY_BE_EMPTY: tl.constexpr):
    """One online-softmax step (log2 units) on scores `s [rows, keys]` (-inf: not seen): the
    probabilities `p`, the factor `alpha` that rescales what was accumulated, and the new row
    maxima and sums. With MAY_BE_EMPTY (a row may have seen no key yet) exp2 is kept away from
    (-inf) - (-inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
