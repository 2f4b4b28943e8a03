"""The op front: which backend runs an `attn::` call, and how cheaply a call reaches it.

`PRIORITY` lists, per op, the backends the automatic choice tries, fastest first; it takes the
first whose `auto_devices` has the call's device and that neither cannot run the call (`reasons`)
nor passes it over (`auto_declines`, where another backend measured faster). `vanilla` (the
reference) serves everything and comes last. An explicit request (`use_backend("triton")` or
`ATTN_BACKEND=triton`) never falls back: if that backend cannot serve a call, the call raises a
`ValueError` listing why. `explain(op, *args, **kwargs)` says which backend runs a call and why
the ones before it do not. Choosing compiles and builds nothing: a backend whose library is not
built yet declines (`torch_ops.warmup()` builds them).

Everything a call's launch depends on besides its tensors' data is in its *signature*: each
tensor's dtype, shape, strides, device and 16-byte alignment, every other argument's value (the
power-of-two bucket of an op's `OpSpec.bucketed` integers, which its launches read only as upper
bounds), and the requested backend. The first call of a signature validates it, chooses the backend and asks
it to `prepare` a launch; the result (a `Plan`) is cached, so later calls cost a dictionary
lookup, the output allocation and the backend's launch. Module knobs and environment variables
(`ATTN_BACKEND`, `ATTN_DEBUG` and the backends' own) are read when a signature is first planned,
or at import: `clear_plans()` makes the next calls see a change.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Callable, Protocol

import torch

from . import checks, ops, reference, replay

Launch = Callable[..., Any]   # (*args, **kwargs with every schema option, out/lse included) -> result


class Backend(Protocol):
    name: str
    auto_devices: tuple[str, ...]  # device types on which the automatic choice considers it

    def reasons(self, op: str, args: tuple, kwargs: dict) -> list[str]:
        """Why this backend cannot run `attn::op(*args, **kwargs)`; empty if it can."""

    # Optional: `auto_declines(op, args, kwargs) -> list[str]`, why the automatic choice passes
    # this backend over for a call it could run (another backend is faster there, measured).

    # Optional: `prepare(op, args, kwargs) -> Launch | None`, the work that depends only on the
    # call's signature, done once; `launch(*args, **kwargs)` then runs a call of that signature,
    # given the arguments as the caller passed them (its defaults are the schema's). Without it,
    # or where it returns None, every call goes through `run` with every argument.

    def run(self, op: str, args: tuple, kwargs: dict):
        """Run the op. Attention ops get `out`/`lse` buffers in `kwargs` and fill them."""


class VanillaBackend:
    """The pure-PyTorch reference: any device, any input the fronts accept; not graph-safe."""

    name = "vanilla"
    auto_devices = ("cpu", "cuda")

    def reasons(self, op, args, kwargs):
        return []

    def run(self, op, args, kwargs):
        fn = getattr(reference, op)
        if op not in ops.ATTENTION_OPS:
            return fn(*args, **kwargs)
        out, lse = kwargs.pop("out"), kwargs.pop("lse")
        o, l = fn(*args, **kwargs)
        out.copy_(o)
        lse.copy_(l)


# op -> backend names, tried in this order by the automatic choice (the `mixed` backend splits a
# paged_prefill batch between the CUTLASS and Triton kernels; `cuda` is the small-batch decode kernel)
PRIORITY: dict[str, list[str]] = {
    "paged_decode": ["cuda", "triton", "vanilla"],
    "paged_prefill": ["mixed", "cutlass", "triton", "vanilla"],
    "context_attention": ["cutlass", "triton", "vanilla"],
    "kv_cache_write": ["triton", "vanilla"],
    "merge_states": ["triton", "vanilla"],
    "cache_attention": ["triton", "vanilla"],
}
MAX_PLANS = 4096   # cached signatures per op overload; past that the cache starts over

_BACKENDS: dict[str, Backend] = {"vanilla": VanillaBackend()}
_PLANS: dict[str, dict[tuple, "Plan"]] = {}
_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar("attn_backend", default=None)
_environment = {"backend": os.environ.get("ATTN_BACKEND") or None, "debug": checks.debug_checks_enabled()}


def register_backend(backend: Backend) -> None:
    """Add a backend. One named in `PRIORITY` takes its place there; any other is tried first for
    every op (it declines the ops it does not serve through `reasons`)."""
    _BACKENDS[backend.name] = backend
    if not any(backend.name in names for names in PRIORITY.values()):
        for names in PRIORITY.values():
            names.insert(0, backend.name)
    clear_plans()


def backend_names() -> list[str]:
    return list(_BACKENDS)


def clear_plans() -> None:
    """Forget every cached plan and read the environment again (after changing a module knob or
    an environment variable)."""
    for plans in _PLANS.values():
        plans.clear()
    _environment.update(backend=os.environ.get("ATTN_BACKEND") or None, debug=checks.debug_checks_enabled())
    replay.configure()


@contextlib.contextmanager
def use_backend(name: str | None):
    """Run ops in this block on backend `name` only (None restores the automatic choice)."""
    if name is not None and name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {backend_names()}")
    token = _requested.set(name)
    replay.request(name)
    try:
        yield
    finally:
        _requested.reset(token)
        replay.request(_requested.get())


def _requested_name() -> str | None:
    return _requested.get() or _environment["backend"]


@dataclasses.dataclass
class Choice:
    """Which backend runs a call (`backend`), and why each one tried before it did not."""

    op: str
    backend: str
    requested: bool
    passed_over: dict[str, list[str]]
    kernel: str = ""   # the backend's description of its launch (`explain` fills it)

    def __str__(self) -> str:
        how = "requested" if self.requested else "automatic choice"
        lines = [f"attn::{self.op} runs on {self.backend!r} ({how})"]
        lines += [f"  kernel: {self.kernel}"] if self.kernel else []
        lines += [f"  {name} passed over: {'; '.join(why)}" for name, why in self.passed_over.items()]
        return "\n".join(lines)


def _choose(op: str, args: tuple, kwargs: dict) -> Choice:
    requested = _requested_name()
    if requested is not None:
        backend = _BACKENDS.get(requested)
        if backend is None:
            raise ValueError(f"unknown backend {requested!r} (ATTN_BACKEND or use_backend); available: {backend_names()}")
        why = backend.reasons(op, args, kwargs)
        if why:
            raise ValueError(f"backend {requested!r} cannot run attn::{op}: " + "; ".join(why))
        return Choice(op, requested, True, {})
    passed_over = {}
    device = args[0].device.type
    for name in PRIORITY[op]:
        backend = _BACKENDS.get(name)
        if backend is None:
            continue
        if device not in backend.auto_devices:
            why = [f"not chosen automatically on {device}"]
        else:
            why = backend.reasons(op, args, kwargs)
            declines = getattr(backend, "auto_declines", None)
            if not why and declines is not None:
                why = declines(op, args, kwargs)
        if not why:
            return Choice(op, name, False, passed_over)
        passed_over[name] = why
    raise AssertionError(f"no backend serves attn::{op}: {passed_over}")   # vanilla serves every call


# --- the op front ---------------------------------------------------------------------------------


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a call's plan depends on (see the module docstring)."""
    return (_requested_name(), tuple(map(_meta, args)), tuple([(k, _meta(v)) for k, v in kwargs.items()]))


def _meta(x):
    if isinstance(x, torch.Tensor):
        return x.dtype, x.shape, x.stride(), x.device, x.data_ptr() % 16
    return x


class _Schema:
    """The defaults of one op overload's schema, to complete the arguments the dispatcher passes
    (only those the caller gave)."""

    def __init__(self, qualname: str):
        name, _, overload = qualname.partition(".")
        schema = getattr(getattr(torch.ops.attn, name), overload or "default")._schema
        self.op, self.with_out = name, overload == "out"
        self.position = {a.name: i for i, a in enumerate(schema.arguments)}
        self.bucketed = tuple((self.position[n], n) for n in ops.SPECS[name].bucketed)   # (position, name)
        positional = [a for a in schema.arguments if not a.kwarg_only]
        self.positional_defaults = tuple(a.default_value for a in positional)
        self.keyword_defaults = {a.name: a.default_value for a in schema.arguments if a.kwarg_only}

    def complete(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args + self.positional_defaults[len(args):], {**self.keyword_defaults, **kwargs}

    def bucket(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments with each bucketed integer replaced by its bucket (`ops.bucket`)."""
        if not self.bucketed:
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        for i, name in self.bucketed:
            if i < len(args):
                args[i] = ops.bucket(args[i])
            elif name in kwargs:
                kwargs[name] = ops.bucket(kwargs[name])
        return tuple(args), kwargs

    def tensors(self, args: tuple, kwargs: dict) -> list[tuple[int, torch.Tensor]]:
        """The call's tensors, each with its position in the schema."""
        given = [*enumerate(args), *((self.position[k], v) for k, v in kwargs.items())]
        return [(i, v) for i, v in given if isinstance(v, torch.Tensor)]


@dataclasses.dataclass
class Plan:
    """A call signature's validated choice and prepared launch. A prepared launch takes the
    arguments as the caller gave them (its defaults are the schema's); `run` gets them all."""

    schema: _Schema
    choice: Choice
    launch: Launch
    outputs: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None   # functional attention ops
    complete: bool   # the launch needs every argument

    def __call__(self, args: tuple, kwargs: dict):
        if _environment["debug"]:
            checks.check_data(self.schema.op, *self.schema.complete(args, kwargs))
        if self.complete:
            args, kwargs = self.schema.complete(args, kwargs)
        if self.outputs is None:
            return self.launch(*args, **kwargs)
        out, lse = self.outputs()
        self.launch(*args, **kwargs, out=out, lse=lse)
        return out, lse


def _allocator(spec: ops.OpSpec, args: tuple, options: dict) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """What allocates a functional attention op's `out [T, Hq, value_dim]` and `lse [T, Hq]` for
    calls of this signature."""
    query, value_dim, dtype = spec.output_spec(*args, **options)
    rows, device = (query.shape[0], query.shape[1]), query.device
    return lambda: (torch.empty((*rows, value_dim), dtype=dtype, device=device),
                    torch.empty(rows, dtype=torch.float32, device=device))


def _make_plan(schema: _Schema, args: tuple, kwargs: dict) -> Plan:
    """The plan of the call's signature; a prepared launch is made for the call with its bucketed
    integers at their buckets (it runs every call of the bucket)."""
    args, kwargs = schema.complete(*schema.bucket(args, kwargs))
    op = schema.op
    options = {k: v for k, v in kwargs.items() if k not in ("out", "lse")}
    spec = ops.SPECS[op]
    spec.check(*args, **options)
    outputs = None
    if schema.with_out:
        spec.check_outputs(args, options, kwargs["out"], kwargs["lse"])
    elif op in ops.ATTENTION_OPS:
        outputs = _allocator(spec, args, options)
        kwargs["out"], kwargs["lse"] = outputs()
    choice = _choose(op, args, options)
    backend = _BACKENDS[choice.backend]
    prepare = getattr(backend, "prepare", None)
    launch = prepare(op, args, kwargs) if prepare is not None else None
    if launch is not None:
        return Plan(schema, choice, launch, outputs, complete=False)

    def launch(*args, **kwargs):
        return backend.run(op, args, kwargs)

    return Plan(schema, choice, launch, outputs, complete=True)


def _front(qualname: str):
    plans = _PLANS.setdefault(qualname, {})
    schema = _Schema(qualname)

    def impl(*args, **kwargs):
        key = _signature(*schema.bucket(args, kwargs))
        plan = plans.get(key)
        if plan is None:
            plan = _make_plan(schema, args, kwargs)
            if len(plans) >= MAX_PLANS:
                plans.clear()
            plans[key] = plan
            if replay.installed() and not plan.complete and args[0].is_cuda:
                return replay.record(lambda: plan(args, kwargs), schema.tensors(args, kwargs))
        return plan(args, kwargs)

    return impl


# The Python front is every op's CPU implementation, and its CUDA one until the C++ front
# (`torch_ops.replay`) takes CUDA over; that one sends the calls it cannot replay to the CPU
# implementation, which serves any device.
_CUDA_IMPLS = torch.library.Library("attn", "IMPL")
for _qualname in ops.SCHEMAS:
    ops.LIB.impl(_qualname, _front(_qualname), "CPU")
    _CUDA_IMPLS.impl(_qualname, _front(_qualname), "CUDA")


def qualnames() -> list[str]:
    return list(ops.SCHEMAS)


def bucketed_positions(qualnames: list[str]) -> list[int]:
    """(index into `qualnames`, schema position) pairs, flattened, of every bucketed integer."""
    return [v for i, name in enumerate(qualnames) for p, _ in _Schema(name).bucketed for v in (i, p)]


def hand_cuda_to_replay() -> None:
    """Unregister the Python front's CUDA implementations (the C++ front registers its own)."""
    _CUDA_IMPLS._destroy()


def _qualname(op) -> str:
    """`op` as `explain` and `backend_for` take it, a name ("paged_decode", "paged_decode.out") or
    the op itself (`torch.ops.attn.paged_decode`, `torch.ops.attn.paged_decode.out`), as a name."""
    if isinstance(op, torch._ops.OpOverload):
        op = op.name()
    elif isinstance(op, torch._ops.OpOverloadPacket):
        op = op._qualified_op_name
    if not isinstance(op, str):
        raise TypeError(f"op must be an attn:: op or its name, got {type(op).__name__}")
    namespace, _, name = op.rpartition("::")
    name = name.removesuffix(".default")
    base, _, overload = name.partition(".")
    if namespace not in ("", "attn") or base not in ops.SPECS or overload not in ("", "out"):
        raise ValueError(f"op must be one of {sorted(ops.SPECS)} (or its .out overload), got {op!r}")
    return name


def explain(op, *args, **kwargs) -> Choice:
    """Which backend and kernel would run `torch.ops.attn.<op>(*args, **kwargs)`, and why the
    backends before it in `PRIORITY[op]` would not (`print` it); `op` is the op or its name.
    Validates and plans the call like the op does (planning may build a backend's library: the
    one the choice fell on)."""
    plan = _make_plan(_Schema(_qualname(op)), args, kwargs)
    return dataclasses.replace(plan.choice, kernel=getattr(plan.launch, "describe", ""))


def backend_for(op, *args, **kwargs) -> str:
    """The name of the backend that would run this call (validated, not planned); `op` as for
    `explain`."""
    schema = _Schema(_qualname(op))
    args, kwargs = schema.complete(args, kwargs)
    ops.SPECS[schema.op].check(*args, **kwargs)
    return _choose(schema.op, args, kwargs).backend
