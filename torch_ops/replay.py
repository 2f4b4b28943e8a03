"""The C++ op front on CUDA (csrc/replay.cpp): later calls of a signature replay its first call.

The first call of a signature runs in the Python front (`torch_ops.backends`), which records
what the call's prepared launch did: the buffers it allocated, each Triton kernel launch
(`kernels.triton.launcher.TritonLaunch`) and each call into a CUDA library (`c_call`), every address
as an op argument's or a buffer's plus an offset. csrc/replay.cpp keeps the recording; later
calls of the signature allocate the buffers and repeat the launches with their own addresses,
without Python (H200 host, `benchmarks/bench_host.py`: 9-40 µs a call against 25-178 µs through
Python). A call is recorded only
when it did nothing else: a prepared launch that converts, copies or reads a tensor, or passes
an address that lies inside several of the call's tensors, keeps going through the Python front.

The library is built by `torch_ops.warmup()` (with the host C++ compiler, 12 s) and loaded at
import once built. `ATTN_REPLAY=0` (read at import and by `clear_plans()`) and `ATTN_DEBUG=1`
send every call through the Python front.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import zlib
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import csrc_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "replay.cpp"
LIBRARY_NAME = "libattn_replay.so"
_installed = False
RECORDERS: list["Recording"] = []   # the recordings watching this process's launches, innermost last
_KEPT: list[torch.Tensor] = []       # tensors alive for the whole process: recordings keep their addresses

# --- build and load -------------------------------------------------------------------------------


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compile_command(target: Path) -> list[str]:
    compiler = Path(csrc_build.find_nvcc() or "/usr/local/cuda/bin/nvcc")   # the toolkit's headers: cuda.h
    toolkits = dict.fromkeys((compiler.parent.parent, compiler.resolve().parent.parent,
                              Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")))
    torch_dir = Path(torch.__file__).parent
    torch_lib = torch_dir / "lib"
    includes = (torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
                *(t / "include" for t in toolkits))
    cuda_lib = ["-ltorch_cuda"] if (torch_lib / "libtorch_cuda.so").exists() else []   # at::detail::empty_strided_cuda
    return [_compiler(), "-O2", "-std=c++20", "-fPIC", "-shared", str(SOURCE), "-o", str(target),
            *(f"-I{p}" for p in includes),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch", *cuda_lib,
            "-ldl"]


@functools.cache
def _build_folder() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    except OSError:   # no compiler: nothing was built with one either
        version = "none"
    for part in (torch.__version__, version, " ".join(_compile_command(Path("o")))):
        h.update(part.encode())
    return f"replay-{h.hexdigest()[:16]}"


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staged = Path(tmp) / LIBRARY_NAME
        cmd = _compile_command(staged)
        result = csrc_build.run_tool(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"building the replay front failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        os.replace(staged, target)


def available() -> bool:
    """Whether this torch can run the C++ front (a CUDA build, the source tree present)."""
    return torch.version.cuda is not None and SOURCE.exists()


def library_built() -> bool:
    return available() and csrc_build.cached(_build_folder(), LIBRARY_NAME)


def install(build: bool = False) -> bool:
    """Load the C++ front and make it the CUDA implementation of every attn:: op (building it
    first if `build`); False if it is not built (or cannot be, here)."""
    global _installed
    if _installed:
        return True
    if not available() or not (build or library_built()):
        return False
    path = csrc_build.cached_build(_build_folder(), LIBRARY_NAME, f"the C++ op front ({SOURCE.name})", _build, log)
    from . import backends

    torch.ops.load_library(str(path))
    backends.hand_cuda_to_replay()
    qualnames = sorted(backends.qualnames())
    torch.ops._attn_replay.install(qualnames, backends.bucketed_positions(qualnames))
    _installed = True
    backends.clear_plans()   # calls planned before go through the C++ front and are recorded
    return True


def installed() -> bool:
    return _installed


def configure(bypass: bool | None = None) -> None:
    """Forget every recording; send every call through the Python front if `bypass`, or, by
    default, as `ATTN_REPLAY` / `ATTN_DEBUG` say (read again)."""
    if _installed:
        from . import checks

        if bypass is None:
            bypass = os.environ.get("ATTN_REPLAY", "1") == "0" or checks.debug_checks_enabled()
        torch.ops._attn_replay.configure(bypass)


def request(backend: str | None) -> None:
    """Tell the C++ front which backend this thread requests (part of every signature)."""
    if _installed:
        torch.ops._attn_replay.request(0 if backend is None else zlib.crc32(backend.encode()) + 1)


def counters() -> dict[str, int]:
    """Calls replayed in C++, calls that went to the Python front, and signatures recorded."""
    replayed, redispatched, recorded = torch.ops._attn_replay.counters() if _installed else (0, 0, 0)
    return {"replayed": replayed, "python": redispatched, "recorded": recorded}


def keep(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor` as alive for the whole process (e.g. the device error flag): a recording
    that passes its address replays that same address."""
    _KEPT.append(tensor)
    return tensor


# --- recording ------------------------------------------------------------------------------------

_VIEWS = {
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::expand", "aten::select", "aten::slice",
    "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::transpose", "aten::t", "aten::alias",
    "aten::detach", "aten::narrow",
}
_ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided"}
_SCALAR_BYTES = {"i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}
_TRITON, _C_CALL = 1, 2
_NULL, _ARGUMENT, _BUFFER, _CONSTANT = 0, 1, 2, 3


class NotRecordable(Exception):
    """The call did something a replay would not repeat."""


class Recording(TorchDispatchMode):
    """Watches one call: the buffers it allocates, the launches reported to it, and
    any other tensor operation (which makes the call not recordable)."""

    def __init__(self):
        super().__init__()
        self.buffers: list[torch.Tensor] = []
        self.launches: list[tuple] = []
        self.refused: str | None = None
        self.jit_launches = 0       # Triton JIT launches seen ...
        self.jit_reported = 0       # ... and those of reported launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in _ALLOCATIONS:
            self.buffers.append(result)
        elif name not in _VIEWS and self.refused is None:
            self.refused = f"it runs {name}"
        return result

    def __enter__(self):
        RECORDERS.append(self)
        self._count_jit_launches(True)
        return super().__enter__()

    def __exit__(self, *exc):
        self._count_jit_launches(False)
        RECORDERS.remove(self)
        return super().__exit__(*exc)

    def _count_jit_launches(self, on: bool) -> None:
        """Count every Triton JIT launch while recording: one not reported to the recording (a
        kernel launched outside `TritonLaunch`) would be missing from the replay."""
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        if not on:
            JITFunction.run = self._jit_run
            return
        self._jit_run = run = JITFunction.run

        def counted(fn, *args, **kwargs):
            result = run(fn, *args, **kwargs)
            self.jit_launches += 1
            return result

        JITFunction.run = counted

    def encode(self, arguments: list[tuple[int, torch.Tensor]], results) -> list[int]:
        """The recording for csrc/replay.cpp `store`:
        device, #results, buffer index per result, #steps, then per step either
          1 (Triton), CUfunction, grid x y z, threads, shared bytes, #params, per param
            0 and an address (source, index, byte offset) or its size in bytes and its bits;
          2 (C call), entry address, #bytes, the argument struct's bytes, #pointers, per pointer
            its byte offset in the struct and an address.
        An address is a source (0 null, 1 argument, 2 buffer, 3 a `keep` tensor's: the
        address itself in the offset), an index and a byte offset.
        Raises `NotRecordable` where a replay would not do what the call did."""
        if self.refused:
            raise NotRecordable(self.refused)
        if self.jit_launches != self.jit_reported:
            raise NotRecordable("it launches a Triton kernel outside TritonLaunch")
        returned = []
        for r in results:
            same = [i for i, b in enumerate(self.buffers) if i not in returned and _same_tensor(b, r)]
            if not same:
                raise NotRecordable("it returns a tensor it did not allocate")
            returned.append(same[0])
        device = torch.cuda.current_device()
        code = [device, len(returned), *returned, len(self.launches)]
        addresses = _Addresses(arguments, self.buffers)
        for kind, *what in self.launches:
            code += (_encode_triton if kind == _TRITON else _encode_c_call)(device, addresses, *what)
        return code

    # called by `kernels.triton.launcher.TritonLaunch` and `c_call`
    def triton(self, launch, tensors: tuple, jit: bool) -> None:
        self.launches.append((_TRITON, launch, tuple(t.data_ptr() for t in tensors)))
        self.jit_reported += jit

    def c_call(self, entry, args: ctypes.Structure, device: int) -> None:
        pointers = [(getattr(type(args), name).offset, getattr(args, name) or 0)
                    for name, kind in type(args)._fields_ if kind is ctypes.c_void_p]
        self.launches.append((_C_CALL, ctypes.cast(entry, ctypes.c_void_p).value, bytes(args), pointers, device))


class _Addresses:
    """Where each address of a call comes from: an argument's or a buffer's, plus an offset."""

    def __init__(self, arguments: list[tuple[int, torch.Tensor]], buffers: list[torch.Tensor]):
        self.spans = [(_ARGUMENT, i, t) for i, t in arguments] + [(_BUFFER, i, t) for i, t in enumerate(buffers)]

    def __call__(self, address: int) -> list[int]:
        if address == 0:
            return [_NULL, 0, 0]
        # arguments sharing an address share it in every call of the signature (csrc/replay.cpp
        # keys on it): the first of them stands for all
        exact = [(s, i) for s, i, t in self.spans if t.data_ptr() == address]
        if exact:
            return [*min(exact), 0]
        inside = [(s, i, address - t.data_ptr()) for s, i, t in self.spans if 0 < address - t.data_ptr() < _extent(t)]
        if len(inside) == 1:
            return list(inside[0])
        if not inside and any(0 <= address - t.data_ptr() < _extent(t) for t in _KEPT):
            return [_CONSTANT, 0, address]
        raise NotRecordable("an address lies in none or several of its tensors")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same allocation, seen the same way (a recording sees other
    Python objects than the code it watches)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def _extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _encode_triton(device: int, addresses: _Addresses, launch, pointers: tuple) -> list[int]:
    compiled = launch.direct
    if compiled is None or launch.device != device:
        raise NotRecordable("a Triton kernel was not launched through its compiled launcher here")
    meta = compiled.metadata
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False) or getattr(meta, "tensordesc_meta", None)):
        raise NotRecordable("a Triton kernel needs clusters, a cooperative grid, PDL or TMA descriptors")
    values = [*pointers, *launch.tail]
    types = list(compiled.src.signature.values())
    if len(types) != len(values):
        raise NotRecordable("a Triton kernel's signature does not match its arguments")
    params = []
    for value, kind in zip(values, types):
        if kind == "constexpr":
            continue
        if isinstance(kind, str) and kind.startswith("*"):
            params.append([0, *addresses(value)])
        elif kind in _SCALAR_BYTES:
            size = _SCALAR_BYTES[kind]
            params.append([size, _signed(int(value) & ((1 << (8 * size)) - 1))])
        elif kind in ("fp32", "f32"):
            params.append([4, int.from_bytes(ctypes.c_float(value), "little")])
        elif kind == "fp64":
            params.append([8, _signed(int.from_bytes(ctypes.c_double(value), "little"))])
        else:
            raise NotRecordable(f"a Triton kernel takes a {kind} parameter")
    for scratch in ("global_scratch_size", "profile_scratch_size"):   # hidden parameters, passed null
        if hasattr(meta, scratch):
            if getattr(meta, scratch):
                raise NotRecordable("a Triton kernel needs scratch memory")
            params.append([0, _NULL, 0, 0])
    code = [_TRITON, compiled.function, *launch.grid, 32 * meta.num_warps, meta.shared, len(params)]
    for p in params:
        code += p
    return code


def _signed(bits: int) -> int:
    """A 64-bit pattern as the int64 that carries it."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _encode_c_call(device: int, addresses: _Addresses, entry: int, struct: bytes, pointers: list, call_device: int) -> list[int]:
    if call_device != device:
        raise NotRecordable("a library call ran on another device")
    code = [_C_CALL, entry, len(struct), *struct, len(pointers)]
    for offset, address in pointers:
        code += [offset, *addresses(address)]
    return code


def c_call(entry, args: ctypes.Structure, device: int, what: str) -> None:
    """`entry(&args, stream, error, error_size)`, a CUDA library's C entry point, on `device`'s
    current stream; raises a RuntimeError with the library's message if it fails."""
    error = ctypes.create_string_buffer(512)
    with csrc_build.on_device(device):
        if entry(ctypes.byref(args), torch._C._cuda_getCurrentRawStream(device), error, len(error)) != 0:
            raise RuntimeError(f"{what} failed: {error.value.decode()}")
    if RECORDERS:
        RECORDERS[-1].c_call(entry, args, device)


def record(run, arguments: list[tuple[int, torch.Tensor]]):
    """`run()` under a recording; stores the recording in the C++ front if the call can be
    replayed (`arguments`: the call's tensors with their positions in the op's schema)."""
    with Recording() as recording:
        result = run()
    results = [] if result is None else [result] if isinstance(result, torch.Tensor) else list(result)
    try:
        code = recording.encode(arguments, results)
    except NotRecordable as e:
        log.debug("attn replay: not recorded: %s", e)
        return result
    torch.ops._attn_replay.store(code, recording.buffers)
    return result
