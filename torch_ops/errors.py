"""The device error flag: out-of-range metadata the kernels met, reported without a host sync.

Kernels never read or write outside their tensors on bad metadata (docs/ops.md, "Errors"): they
clamp or skip the value, and OR one bit per argument class (below) into `device_flag(device)`.
`check_errors()` reads the flags (a device sync, only when called), clears them and raises.
"""

from __future__ import annotations

import torch

from . import gpu, replay

BLOCK_TABLES = 1
SEQ_LENS = 2
CU_SEQLENS = 4
SLOT_MAPPING = 8
POSITIONS = 16
CACHESTARTS = 32
KVSTARTS = 64

MESSAGES = {
    BLOCK_TABLES: "block_tables: block id outside [0, num_blocks)",
    SEQ_LENS: "seq_lens: length outside [0, max_blocks_per_seq * block_size]",
    CU_SEQLENS: "cu_seqlens_q, cu_seqlens_k or seqstarts: boundary outside [0, tokens] or below the one before",
    SLOT_MAPPING: "slot_mapping: slot >= num_blocks * block_size",
    POSITIONS: "positions: RoPE position outside [0, cos_sin_cache rows)",
    CACHESTARTS: "cachestarts or start_pos: cache rows outside [0, MaxT) or pages past MaxP",
    KVSTARTS: "kvstarts: key count outside [0, max_kvlen rounded up to a power of two]",
}

_FLAGS: dict[torch.device, torch.Tensor] = {}


def _key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_flag(device) -> torch.Tensor:
    """The error flag of `device`: one int32 `[1]` tensor, allocated at its first use and kept for
    the life of the process (a constant address: CUDA graphs and recorded launches may hold it;
    `gpu.kept_tensor`). Allocate it outside a stream capture (an eager call of any op on the
    device does)."""
    key = _key(device)
    flag = _FLAGS.get(key)
    if flag is None:
        flag = _FLAGS[key] = replay.keep(gpu.kept_tensor(lambda: torch.zeros(1, dtype=torch.int32, device=key), key))
    return flag


def check_errors() -> None:
    """Raise a ValueError naming every argument class a kernel found out of range since the last
    check (on any device), and clear the flags. Synchronizes with the devices that have a flag."""
    found = 0
    for flag in _FLAGS.values():
        bits = int(flag.item())
        if bits:
            flag.zero_()
            found |= bits
    if found:
        problems = [message for bit, message in MESSAGES.items() if found & bit]
        raise ValueError("kernels met out-of-range metadata (clamped or skipped): " + "; ".join(problems))
