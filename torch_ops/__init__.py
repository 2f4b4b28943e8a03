"""attn-ops: attention ops for LLM inference, registered as `torch.ops.attn.*` on import.

Importing registers the schemas, fakes and implementations and changes no global config.
"""

from . import ops, backends, replay  # noqa: F401  (registration)
from .backends import backend_for, clear_plans, explain, register_backend, use_backend
from .errors import check_errors
from .kernels.cuda.decode_sm90 import CudaDecodeBackend
from .kernels.cuda.fmha_sm90 import CutlassBackend, MixedBatchBackend
from .kernels.triton import TritonBackend
from .warmup import warmup

register_backend(TritonBackend())
register_backend(CudaDecodeBackend())  # Hopper, paged_decode of small problems (torch_ops/kernels/cuda/decode_sm90.py)
register_backend(CutlassBackend())  # Hopper, where it serves the call (docs/cutlass.md)
register_backend(MixedBatchBackend())  # paged_prefill of several sequences: CUTLASS for the long ones
replay.install()  # the C++ front takes the CUDA calls over, where built (torch_ops.warmup() builds it)

__all__ = ["backend_for", "check_errors", "clear_plans", "explain", "register_backend", "use_backend", "warmup"]
