"""The KV-cache formats' numbers inside the Triton kernels (their `FMT` meta-parameter), as
constants the kernels compare against: `quant.KVFormat.code`."""

import triton.language as tl

from ...quant import KVFormat

FMT_PLAIN = tl.constexpr(KVFormat.PLAIN.code)
FMT_FP8 = tl.constexpr(KVFormat.FP8.code)
FMT_INT8 = tl.constexpr(KVFormat.INT8.code)
FMT_INT4 = tl.constexpr(KVFormat.INT4.code)
