"""Write docs/performance.md and its plots (docs/img/*.png) from the benchmark results.

    python benchmarks/report.py

Reads benchmarks/results/*.json and renders, for each benchmark on each GPU, its latest run only
(the newest `env.date`; older runs live in git history). A benchmark is a script plus the mode
that changes what it compares: CUDA-graph timing for bench_e2e_compile.py (`--graphs`), the op
for bench_prefill.py (context attention, or paged prefill and mixed batches), and whether any
peer ran (`--peers` given no names) for bench_decode.py and bench_prefill.py. Each section says
what was measured and how close it came to the hardware limit, then gives a table, a plot and
the command that reproduces the run. Every ratio compares numbers of one JSON, that is one run.

Plots need matplotlib (`pip install -e ".[docs]"`). Without it the markdown is still written,
linking the plots already in docs/img/.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import nominal_limits as limits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
IMG = ROOT / "docs" / "img"

# file-name prefix -> benchmark (the committed names, and the names the scripts write)
PREFIXES = {"decode": "decode", "bench_decode": "decode", "prefill": "prefill", "bench_prefill": "prefill",
            "fp8": "fp8", "kvwrite": "kvwrite", "bench_kv_cache_write": "kvwrite", "bench_host": "host",
            "e2e_compile": "e2e", "generate": "generate", "bench_generate": "generate", "serving": "serving", "serving_grid": "serving",
            "serving_metadata": "serving_metadata", "cascade": "cascade", "cache_attention": "cache_attention",
            "bench_cache_attention": "cache_attention", "ab_decode": "ab_decode", "probe_cutlass": "probe_cutlass",
            "mla": "mla", "bench_mla": "mla", "ab_trees": "ab_trees", "bench_cold_start": "cold_start"}


# ---- selecting the runs ---------------------------------------------------------------------------


def benchmark(path: Path) -> str | None:
    """The benchmark a result file belongs to (its longest matching prefix), None for other files."""
    names = [p for p in PREFIXES if path.stem.startswith(p + "_")]
    return PREFIXES[max(names, key=len)] if names and not path.stem.endswith("_partial") else None


def mode(kind: str, data: dict) -> str:
    """The part of a run's identity beyond its benchmark and GPU (see the module docstring)."""
    parts = []
    if kind == "e2e" and data.get("graphs"):
        parts.append("CUDA graphs")
    if kind == "prefill":
        context = all(r.get("section") == "context" for r in data["rows"])
        parts.append("context attention" if context else "paged prefill")
    if kind in ("decode", "prefill") and data.get("args", {}).get("peers") == []:
        parts.append("ours only")
    return ", ".join(parts)


def latest(paths) -> dict[tuple[str, str, str], tuple[Path, dict]]:
    """(benchmark, mode, GPU) -> (path, data) of its newest run."""
    runs = {}
    for path in sorted(paths):
        kind = benchmark(path)
        if kind is None:
            continue
        data = json.loads(path.read_text())
        key = (kind, mode(kind, data), data["env"].get("gpu", "cpu"))
        if key not in runs or data["env"]["date"] >= runs[key][1]["env"]["date"]:
            runs[key] = (path, data)
    return runs


# ---- formatting -----------------------------------------------------------------------------------


def num(v, digits: int = 1) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def ratio(peer, ours) -> str:
    """peer time / our time (> 1: ours is faster)."""
    return f"{peer / ours:.2f}" if isinstance(peer, (int, float)) and ours else "-"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table without the columns that are empty ("-") in every row."""
    keep = [i for i in range(len(header)) if any(r[i] != "-" for r in rows)] or list(range(len(header)))
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    return lines + ["| " + " | ".join(r[i] for i in keep) + " |" for r in rows]


def passed(check: dict) -> bool:
    """A row's accuracy check: its `ok`, else no error and every `*_bitwise` comparison equal."""
    if "ok" in check:
        return bool(check["ok"])
    return "error" not in check and all(v for k, v in check.items() if k.endswith("bitwise"))


def checked(rows: list[dict]) -> str:
    """What the rows' accuracy checks say, as a sentence (empty if none ran)."""
    checks = [r["check"] for r in rows if isinstance(r.get("check"), dict)]
    if not checks:
        return ""
    bad = sum(not passed(c) for c in checks)
    return f" {len(checks)} rows were checked against the reference: " + (f"{bad} failed." if bad else "all passed.")


def command(script: str, args: dict) -> str:
    """The script's command line for a run's recorded arguments (`--out` left at its default)."""
    words = ["python", f"benchmarks/{script}"]
    for name, value in args.items():
        if name == "out" or value is None or value is False or (name == "budget_s" and value >= 1e9):
            continue
        words.append("--" + name.replace("_", "-"))
        if isinstance(value, list):
            words += [str(v) for v in value]
        elif value is not True:
            words.append(f"{value:g}" if isinstance(value, float) else str(value))
    return shlex.join(words)


def bars(plt, labels: list[str], series: list[tuple[str, list]], xlabel: str, title: str, refs=(), log=False):
    """Horizontal grouped bars, a group per label and a bar per (name, values) series; `refs`:
    (x, label) vertical lines (the hardware limits)."""
    step = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + len(labels) * (0.08 + 0.07 * len(series))))
    for i, (name, values) in enumerate(series):
        ax.barh([y + i * step for y in range(len(labels))], [v or 0 for v in values], step, label=name)
    for (x, label), style in zip(refs, ("--", ":")):
        ax.axvline(x, color="k", ls=style, lw=1, label=label)
    ax.set_yticks([y + 0.4 - step / 2 for y in range(len(labels))], labels=labels, fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel=xlabel, title=title, xscale="log" if log else "linear")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


# ---- sections: renderer(data, name) -> (paragraph, table lines, plot(plt) -> figure, command) -------

DECODE_PEERS = (("flashinfer", "FlashInfer"), ("flashinfer_tc", "FlashInfer tc"), ("cudnn_sdpa", "cuDNN SDPA"),
                ("flash_sdpa", "flash SDPA"), ("flex", "flex"))


def decode(data: dict, name: str):
    rows, read = data["rows"], data["bandwidth"]["read_GBps"]
    hbm = limits(data["env"].get("gpu", ""))[0]
    best = max(r["ours_GBps"] for r in rows)
    if data["args"].get("peers") == []:
        return decode_formats(data, best, read)
    text = ("One decode step (one query token per sequence) of `attn::paged_decode` over a paged cache of "
            "16-token pages in a random order, head dim 128, against peers on the same inputs: FlashInfer's paged "
            "decode on CUDA cores and on tensor cores (`tc`), cuDNN and flash SDPA on a contiguous cache (no "
            "paging: a lower bound on their paged cost), compiled FlexAttention. Decode reads every KV byte once, "
            f"so memory bandwidth is the limit: our best row read {best:.0f} GB/s, {100 * best / read:.0f}% of the "
            f"{read:.0f} GB/s read bandwidth measured in this run and {best / hbm / 10:.0f}% of the {hbm} TB/s "
            "nominal.")
    at64 = [r for r in rows if r["batch"] == 64 and r.get("flashinfer_us")]
    if at64:
        r = at64[0]
        text += (f" At batch 64 ({r['ctx']} keys, {r['hq']}/{r['hkv']} heads, {r['fmt']}): ours {r['ours_us']:.1f} "
                 f"µs, FlashInfer {num(r.get('flashinfer_us'))} µs, FlashInfer tc {num(r.get('flashinfer_tc_us'))} µs.")
    text += (" µs: median of CUDA-graph replays, input sets rotated past L2; `kernel`: what the automatic choice "
             "ran; `×`: peer time / ours (> 1: ours faster)." + checked(rows))
    body = [[str(r["batch"]), str(r["ctx"]), f"{r['hq']}/{r['hkv']}", r["fmt"], num(r["ours_us"]),
             r.get("backend") or "-", num(r["ours_GBps"], 0), num(100 * r["ours_GBps"] / read, 0)]
            + [num(r.get(p + "_us")) for p, _ in DECODE_PEERS]
            + [ratio(r.get("flashinfer_us"), r["ours_us"]), ratio(r.get("flashinfer_tc_us"), r["ours_us"])]
            for r in rows]
    header = ["B", "ctx", "Hq/Hkv", "KV", "ours µs", "kernel", "GB/s", "% read"] + \
        [f"{peer} µs" for _, peer in DECODE_PEERS] + ["× FlashInfer", "× FlashInfer tc"]

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        for (key, label), marker in zip((("ours", "ours"),) + DECODE_PEERS, "o^vsDx"):
            pts = [(r["batch"], r["kv_bytes"] / r[key + "_us"] / 1e3) for r in rows if r.get(key + "_us")]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=label, alpha=0.8)
        ax.axhline(hbm * 1e3, color="k", ls="--", lw=1, label=f"HBM nominal {hbm} TB/s")
        ax.axhline(read, color="k", ls=":", lw=1, label=f"measured read {read:.0f} GB/s")
        batches = sorted({r["batch"] for r in rows})
        ax.set(xscale="log", xlabel="batch (sequences)", ylabel="GB/s of KV read",
               title="paged_decode: one point per table row and implementation")
        ax.set_xticks(batches, labels=[str(b) for b in batches])
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig

    return text, table(header, body), plot, command("bench_decode.py", data["args"])


def decode_formats(data: dict, best: float, read: float):
    rows = data["rows"]
    fmts = list(dict.fromkeys(r["fmt"] for r in rows))
    cell = {(r["batch"], r["ctx"], r["hq"], r["hkv"], r["fmt"]): r for r in rows}
    shapes = list(dict.fromkeys((r["batch"], r["ctx"], r["hq"], r["hkv"]) for r in rows))
    shapes = [s for s in shapes if all(s + (f,) in cell for f in fmts)] or shapes   # run in every format
    kernels = {f: sorted({r.get("backend") or "-" for r in rows if r["fmt"] == f}) for f in fmts}
    text = ("`attn::paged_decode` alone (no peers in this run) on each KV-cache format: bf16, FP8 e4m3, INT8 and "
            "INT4 with group scales (a format's bytes include its scales); 16-token pages, head dim 128; the shapes "
            f"run in every format. Cells: µs (GB/s of KV read). Our best row read {best:.0f} GB/s, "
            f"{100 * best / read:.0f}% of the {read:.0f} GB/s read bandwidth measured in this run. The automatic "
            "choice ran " + "; ".join(f"{f}: {', '.join(k)}" for f, k in kernels.items()) + "." + checked(rows))
    body = [[str(b), str(c), f"{hq}/{hkv}"] + [
        f"{cell[b, c, hq, hkv, f]['ours_us']:.1f} ({cell[b, c, hq, hkv, f]['ours_GBps']:.0f})"
        if (b, c, hq, hkv, f) in cell else "-" for f in fmts] for b, c, hq, hkv in shapes]

    def plot(plt):
        labels = [f"B={b} ctx={c} {hq}/{hkv}" for b, c, hq, hkv in shapes]
        series = [(f, [cell[s + (f,)]["ours_GBps"] if s + (f,) in cell else 0 for s in shapes]) for f in fmts]
        return bars(plt, labels, series, "GB/s of KV read", "paged_decode by KV-cache format",
                    [(read, f"measured read {read:.0f} GB/s")])

    return text, table(["B", "ctx", "Hq/Hkv"] + fmts, body), plot, command("bench_decode.py", data["args"])


CONTEXT_IMPLS = (("ours_triton", "our Triton"), ("cudnn_sdpa", "cuDNN SDPA"), ("flashinfer_fa3", "FlashInfer fa3"),
                 ("flash_sdpa", "flash SDPA"), ("flex", "flex"))
PAGED_IMPLS = (("ours_cutlass", "CUTLASS"), ("ours_triton", "our Triton"), ("ours_mixed", "mixed"),
               ("ours_contiguous", "our context attn, same keys"), ("flashinfer_fa3", "FlashInfer fa3"),
               ("flashinfer_fa2", "FlashInfer fa2"))
PREFILL_PEERS = ("flash_sdpa", "cudnn_sdpa", "flashinfer_fa3", "flashinfer_fa2", "flex")


def prefill(data: dict, name: str):
    rows = data["rows"]
    peak = limits(data["env"].get("gpu", ""))[1]
    context = all(r["section"] == "context" for r in rows)
    impls = CONTEXT_IMPLS if context else PAGED_IMPLS
    best = max(r["ours_tflops"] for r in rows)
    if context:
        text = ("`attn::context_attention` on packed batches of 16k tokens (`uniform`: equal lengths S; `ragged`: "
                f"random lengths around S, where SDPA does not run), {rows[0]['heads']} query and KV heads")
    else:
        text = ("`attn::paged_prefill`: causal chunks of new tokens over a cached prefix in a paged cache, "
                f"{rows[0]['heads']} heads" + (", and mixed batches (prefills, chunks and decodes in one call)"
                                               if any(r["section"] == "mixed" for r in rows) else ""))
    peers = any(isinstance(r.get(p + "_us"), (int, float)) for r in rows for p in PREFILL_PEERS)
    text += (", bf16. TFLOP/s = 4 · Hq · D · (query-key pairs computed) / time, causal counting the visible half. "
             f"Our best row made {best:.0f} TFLOP/s, {100 * best / peak:.0f}% of the {peak} TFLOP/s dense bf16 "
             "tensor-core peak. `backend`: what the automatic choice ran"
             + ("; `× best peer`: the fastest peer's time / ours (> 1: ours faster)." if peers else "; no peers ran.")
             + checked(rows))
    labels = [r.get("desc") or f"S={r['seqlen']} {r['batch']}" for r in rows]
    body = []
    for label, r in zip(labels, rows):
        times = [r[p + "_us"] for p in PREFILL_PEERS if isinstance(r.get(p + "_us"), (int, float))]
        body.append([label, str(r["d"]), "yes" if r["causal"] else "no", num(r["ours_tflops"], 0), r["backend"]]
                    + [num(r.get(k + "_tflops"), 0) for k, _ in impls]
                    + [ratio(min(times), r["ours_us"]) if times else "-"])
    header = ["case", "D", "causal", "ours TF/s", "backend"] + [f"{n} TF/s" for _, n in impls] + ["× best peer"]

    def plot(plt):
        keys = [("ours", "ours")] + [i for i in impls if any(r.get(i[0] + "_tflops") for r in rows)]
        series = [(n, [r.get(k + "_tflops") for r in rows]) for k, n in keys]
        ylabels = [f"{label}, D={r['d']}" + (", causal" if context and r["causal"] else "")
                   for label, r in zip(labels, rows)]
        return bars(plt, ylabels, series, "TFLOP/s", "context_attention" if context else "paged_prefill",
                    [(peak, f"dense bf16 peak {peak}")])

    return text, table(header, body), plot, command("bench_prefill.py", data["args"])


FP8_IMPLS = (("cutlass_fp8", "ours FP8"), ("flashinfer_fa3_fp8", "fa3 FP8"), ("cutlass_bf16", "ours bf16"),
             ("flashinfer_fa3_bf16", "fa3 bf16"), ("cudnn_sdpa_bf16", "cuDNN bf16"), ("triton_fp8", "our Triton FP8"))


def fp8(data: dict, name: str):
    rows = data["rows"]
    _, peak16, peak8 = limits(data["env"].get("gpu", ""))
    tflops = lambda r, key: r.get(key + "_tflops") if isinstance(r.get(key + "_tflops"), float) else None  # noqa: E731
    best = max(tflops(r, "cutlass_fp8") or 0 for r in rows)
    text = ("`attn::context_attention` with FP8 e4m3 inputs (per-tensor scales) on the CUTLASS backend, and the "
            "same in bf16, against FlashInfer's fa3 kernels (FP8 and bf16) and cuDNN SDPA (bf16), on packed batches "
            "of 16k tokens (`ragged`: random lengths, `B=`: that many sequences). TFLOP/s as for prefill. Our best "
            f"FP8 row made {best:.0f} TFLOP/s, {100 * best / peak8:.0f}% of the {peak8} TFLOP/s dense FP8 peak "
            f"(bf16: {peak16}). `× fa3`: FlashInfer's FP8 time / ours; RMSE of heads 0-1 against an fp32 reference "
            "on the same FP8 inputs, ours / FlashInfer's.")
    body = []
    for r in rows:
        rmse = [r.get(i + "_rmse") for i in ("cutlass_fp8", "flashinfer_fa3_fp8")]
        body.append([r["case"], "yes" if r["causal"] else "no"] + [num(tflops(r, i), 0) for i, _ in FP8_IMPLS]
                    + [ratio(r.get("flashinfer_fa3_fp8_us"), r.get("cutlass_fp8_us")),
                       " / ".join(f"{x:.2e}" if isinstance(x, float) else "-" for x in rmse)])
    header = ["case", "causal"] + [f"{n} TF/s" for _, n in FP8_IMPLS] + ["× fa3", "RMSE ours / fa3"]

    def plot(plt):
        labels = [r["case"] + (", causal" if r["causal"] else "") for r in rows]
        series = [(n, [tflops(r, k) for r in rows]) for k, n in FP8_IMPLS[:4]]
        return bars(plt, labels, series, "TFLOP/s", "context_attention, FP8 and bf16",
                    [(peak8, f"dense FP8 peak {peak8}"), (peak16, f"dense bf16 peak {peak16}")])

    shapes = []   # D:H:S[:B] from the case labels, e.g. "S=2048 ragged B=4 D=128 H=32"
    for r in rows:
        f = dict(part.split("=") for part in r["case"].split() if "=" in part)
        shapes.append(f"{f['D']}:{f['H']}:{f['S']}" + (f":{f['B']}" if "B" in f else ""))
    persistent = data.get("cutlass_persistent")
    env = "" if persistent is None else f"ATTN_CUTLASS_PERSISTENT={int(persistent)} "
    return text, table(header, body), plot, env + shlex.join(
        ["python", "benchmarks/bench_fp8.py", "--shapes", *dict.fromkeys(shapes)])


def kvwrite(data: dict, name: str):
    rows = data["rows"]
    hbm = limits(data["env"].get("gpu", ""))[0]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fmts = list(dict.fromkeys(r["fmt"] for r in rows))
    cell = {(r["tokens"], r["fmt"], r["mode"]): r for r in rows}
    last = modes[-1]
    best = max(r["ours_GBps"] for r in rows)
    text = ("`attn::kv_cache_write`: T tokens' keys and values written into a paged cache (8 KV heads, head dim "
            "128, 16-token blocks) in each format, with no RoPE (`kv`), RoPE on the keys (`rope_k`) or on queries "
            "and keys (`rope_qk`, the rotated query returned). T up to 256 is a decode batch, larger T a prefill. "
            "GB/s = bytes read and written / time; `% copy`: of a device copy moving the same bytes. Our best row "
            f"moved {best:.0f} GB/s, {best / hbm / 10:.0f}% of the {hbm} TB/s nominal HBM bandwidth; small T is "
            f"bound by launch latency. Peers, for `{last}`: plain PyTorch indexing (`torch`) and FlashInfer's "
            "`append_paged_kv_cache` (bf16), as peer time / ours." + checked(rows))
    body = []
    for t, f in dict.fromkeys((r["tokens"], r["fmt"]) for r in rows):
        r = cell.get((t, f, last), {})
        body.append([str(t), f] + [num(cell[t, f, m]["ours_us"]) if (t, f, m) in cell else "-" for m in modes]
                    + [num(r.get("ours_GBps"), 0), num(r.get("pct_copy"), 0),
                       ratio(r.get("torch_us"), r.get("ours_us")), ratio(r.get("flashinfer_us"), r.get("ours_us"))])
    header = ["T", "KV"] + [f"{m} µs" for m in modes] + [f"{last} GB/s", "% copy", "× torch", "× FlashInfer"]

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        for f in fmts:
            ax.plot(*zip(*sorted((r["tokens"], r["ours_GBps"]) for r in rows if r["fmt"] == f and r["mode"] == last)),
                    marker="o", label=f"{f}, {last}")
        ax.axhline(hbm * 1e3, color="k", ls="--", lw=1, label=f"HBM nominal {hbm} TB/s")
        ax.set(xscale="log", xlabel="tokens T", ylabel="GB/s (read + written)", title="kv_cache_write")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig

    return text, table(header, body), plot, command("bench_kv_cache_write.py", data["args"])


def host(data: dict, name: str):
    sh = data["shape"]
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in data["rows"]:
        if "host_us" in r:
            cases.setdefault((r["op"], r["variant"]), {})[r["backend"]] = r
    calls = (f"in bursts of {data['burst']} between syncs" if data.get("burst") else "back to back")
    text = (f"µs of host time per eager call (median of {data['repeats']} loops of {data['iters']} calls {calls}) "
            f"on problems small enough that the host sets the pace: {sh['batch']} sequences of {sh['ctx']} "
            f"keys, {sh['hq']}/{sh['hkv']} heads, D = {sh['d']}, {sh['page']}-token pages; prefill "
            f"{sh['prefill_seqs']} x {sh['prefill_q']} queries. The limit is the call's GPU time (`device µs`, the "
            "same call replayed in a CUDA graph). `auto`: the automatic choice (the backend it took); `replayed`: "
            "the share of those calls the C++ front replayed; `Python front`: the same with every call through "
            "Python (ATTN_REPLAY=0); `pinned`: the fastest backend pinned with `use_backend`; `first ms`: the first "
            "call in the process (planning, compiling or loading kernels). FlashInfer's `run()` (after one `plan()`) "
            "and SDPA ran in the same process on the same shapes.")
    body = []
    for (op, variant), by in cases.items():
        auto = by.get("auto", {})
        pinned = min(((r["host_us"], b) for b, r in by.items() if b not in ("auto", "auto/python", "flashinfer", "sdpa")),
                     default=None)
        body.append([op, variant, f"{num(auto.get('host_us'))} ({auto.get('chosen', '-')})",
                     num(100 * auto["replayed"], 0) + "%" if "replayed" in auto else "-",
                     num(by.get("auto/python", {}).get("host_us")), f"{pinned[0]:.1f} ({pinned[1]})" if pinned else "-",
                     num(auto.get("device_us")), num(auto.get("first_ms"), 0),
                     num(by.get("flashinfer", {}).get("host_us")), num(by.get("sdpa", {}).get("host_us"))])
    header = ["op", "variant", "auto µs", "replayed", "Python front µs", "pinned µs", "device µs", "first ms",
              "FlashInfer µs", "SDPA µs"]

    def plot(plt):
        keys = (("auto", "auto", "host_us"), ("auto/python", "Python front", "host_us"),
                ("flashinfer", "FlashInfer", "host_us"), ("sdpa", "SDPA", "host_us"), ("auto", "device", "device_us"))
        series = [(label, [by.get(b, {}).get(field) for by in cases.values()]) for b, label, field in keys]
        return bars(plt, [f"{op} {variant}" for op, variant in cases], series, "µs per call",
                    "host time per eager call", log=True)

    return text, table(header, body), plot, command("bench_host.py", data["args"])


def e2e(data: dict, name: str):
    m = data["model"]
    cases: dict[tuple[str, str, str], dict[str, dict]] = {}
    for r in data["rows"]:
        cases.setdefault((r["case"], r["shape"], r["variant"]), {})[r["mode"]] = r
    timing = "CUDA-graph replays" if data.get("graphs") else "eager launches (do_bench: host overhead included)"
    text = (f"A random-weight Llama ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']}/{m['num_key_value_heads']} heads of dim {m['head_dim']}, bf16): eager, "
            "stock `torch.compile(fullgraph=True)`, and the same compile inside `fx_passes.enabled()`, which "
            "rewrites attention onto `torch.ops.attn`. `fp8_out`: SDPA's output quantized to FP8 (the passes fold "
            f"it into the op). Times: {timing}. The whole model, so no single hardware limit applies; `× compile`: "
            "stock compile time / passes time (> 1: the passes are faster); compile seconds stock / passes; graph "
            "breaks and recompilations with the passes.")
    body = []
    for (case, shape, variant), by in cases.items():
        e, c, p = (by.get(k, {}) for k in ("eager", "compile", "passes"))
        body.append([f"{case}, {shape}", variant, num(e.get("time_us"), 0), num(c.get("time_us"), 0),
                     num(p.get("time_us"), 0), ratio(c.get("time_us"), p.get("time_us")),
                     f"{num(c.get('compile_s'))} / {num(p.get('compile_s'))}",
                     str(p.get("graph_breaks", "-")), str(p.get("recompiles", "-"))])
    header = ["case", "variant", "eager µs", "compile µs", "passes µs", "× compile", "compile s", "breaks",
              "recompiles"]

    def plot(plt):
        series = [(k, [by.get(k, {}).get("time_us", 0) / 1e3 for by in cases.values()])
                  for k in ("eager", "compile", "passes")]
        return bars(plt, [f"{case} {variant}" for case, _, variant in cases], series, "ms per call",
                    f"1B Llama end to end ({'CUDA graphs' if data.get('graphs') else 'eager launches'})")

    flags = ["--graphs"] * bool(data.get("graphs")) + ["--freezing"] * bool(data.get("freezing"))
    flags += ["--quick"] * bool(data.get("quick")) + ["--no-fp8"] * all(r["variant"] != "fp8_out" for r in data["rows"])
    ran = list(dict.fromkeys(r["case"] for r in data["rows"]))
    flags += ["--cases", *ran] if ran != ["prefill", "decode"] else []
    return text, table(header, body), plot, shlex.join(["python", "benchmarks/bench_e2e_compile.py", *flags])


def generate(data: dict, name: str):
    rows = [r for r in data["rows"] if "error" not in r]
    failed = {(r["model"], r["batch"], r["mode"]) for r in data["rows"] if "error" in r}
    keys = list(dict.fromkeys((r["model"], r["batch"]) for r in data["rows"]))
    modes = list(dict.fromkeys(r["mode"] for r in data["rows"]))
    pairs = [(p, c) for p, c in (("passes", "compile"), ("passes/graphs", "compile/graphs")) if p in modes and c in modes]
    by = {(r["model"], r["batch"], r["mode"]): r for r in rows}
    new = rows[0]["new_tokens"] if rows else "-"
    quick = data.get("args", {}).get("quick")
    size = "2-layer, hidden-512 models" if quick else "models (a 1B Llama, and the same size in Gemma 2's shape)"
    text = (f"`model.generate(..., cache_implementation=\"static\")` of random-weight bf16 {size}, Gemma 2 "
            "through transformers' eager attention, on left-padded "
            f"prompts of random lengths, {new} new tokens, greedy: eager, transformers' own compile of the "
            "decode steps (`compile`), and the same inside `fx_passes.enabled()` (`passes`); `/graphs`: "
            "`mode=\"reduce-overhead\"`. Tokens/s = batch x new tokens / seconds, prefill included; "
            "`= eager`: the same tokens as eager; `failed`: the run raised (its error is in the JSON). "
            "The whole model, so no single hardware limit applies.")
    if data.get("runs"):   # rows gathered from several invocations (each row runs in a process of its own)
        text += " Rows from " + "; ".join(f"`{r['command']}` (commit {r['git_commit']}, {r['date'][:16]})"
                                         for r in data["runs"].values()) + "."
    header = ["model", "B", *[f"{m} tok/s" for m in modes], *[f"{p} / {c}" for p, c in pairs], "= eager"]
    body = []
    for model, batch in keys:
        cells = ["failed" if (model, batch, m) in failed else num(by.get((model, batch, m), {}).get("tokens_per_s"), 0)
                 for m in modes]
        speed = {m: by.get((model, batch, m), {}).get("tokens_per_s") for m in modes}
        equal = {by[(model, batch, m)].get("tokens_equal_eager") for m in modes if (model, batch, m) in by} - {None}
        body.append([model, str(batch), *cells, *[ratio(speed[p], speed[c]) if speed[c] and speed[p] else "-"
                                                  for p, c in pairs],
                     "yes" if equal == {"yes"} else "no" if "no" in equal else "-"])

    def plot(plt):
        series = [(m, [by.get((model, batch, m), {}).get("tokens_per_s", 0) for model, batch in keys]) for m in modes]
        return bars(plt, [f"{model} B={batch}" for model, batch in keys], series, "tokens/s", "generate()")

    args = data.get("args", {})
    flags = ["--quick"] * bool(quick) + (["--batch", *map(str, args["batch"])] if args.get("batch") else [])
    flags += ["--modes", *args["modes"]] if args.get("modes") and len(args["modes"]) < 5 else []   # not all five
    return text, table(header, body), plot, shlex.join(["python", "benchmarks/bench_generate.py", *flags])


def serving(data: dict, name: str):
    m, rows = data["model"], data["rows"]
    text = (f"The serving engine's decode steps (Triton backend, a CUDA graph per batch size) on a random-weight "
            f"Llama ({m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']}/{m['num_kv_heads']} "
            f"heads of dim {m['head_dim']}, bf16), B requests of {data['prompt_len']} prompt and "
            f"{data['new_tokens']} new tokens, against transformers {data['env'].get('transformers', '-')} "
            "`generate` (static cache, `torch.compile(mode=\"reduce-overhead\")`) on the same shapes. Medians per "
            "step: wall, GPU, host (step start to launch) and metadata build.")
    replay = data.get("replay") or {}
    if replay.get("replay_us"):
        text += (f" The limit is the GPU time of the step's kernels: one step replayed back to back at B = "
                 f"{replay['batch']} took {replay['replay_us']:.0f} µs, {replay['ratio']:.3f}x the "
                 f"{replay['kernel_sum_us']:.0f} µs sum of its {replay['kernels_per_replay']:.0f} kernels.")
    body = [[str(r["batch"]), num(r["ours_tokens_per_s"], 0), num(r.get("ours_step_wall_us")),
             num(r.get("ours_step_gpu_us")), num(r.get("ours_host_us")), num(r.get("ours_metadata_us")),
             num(r.get("hf_tokens_per_s"), 0), num(r.get("speedup"), 2)] for r in rows]
    lines = table(["B", "ours tok/s", "step µs", "GPU µs", "host µs", "metadata µs", "hf tok/s", "× hf"], body)
    lines += [f"- transformers at B = {r['batch']} failed: {r['hf_error']}" for r in rows if r.get("hf_error")]
    if data.get("metadata"):
        lines += ["", "Host time per step:", ""] + metadata_table(data["metadata"])

    def plot(plt):
        fig, ax = plt.subplots(figsize=(7.5, 3.4))
        for key, label in (("ours_tokens_per_s", "ours"), ("hf_tokens_per_s", "transformers")):
            pts = [(r["batch"], r[key]) for r in rows if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="tokens/s", title="decode throughput")
        ax.legend(fontsize=7)
        return fig

    flags = ["--grid"] if name.startswith("serving_grid") else []
    return text, lines, plot, shlex.join(["python", "benchmarks/bench_serving.py", *flags])


def metadata_table(rows: list[dict]) -> list[str]:
    body = [[r["kind"], str(r["num_seqs"]), str(r.get("num_tokens", "-")), num(r.get("prepare_us")),
             num(r.get("append_us")), num(r.get("total_us")), num(r.get("host_us"))] for r in rows]
    errors = [f"- {r['kind']} {r['num_seqs']} failed: {r['error']}" for r in rows if r.get("error")]
    return table(["kind", "seqs", "tokens", "prepare µs", "append µs", "total µs", "host µs"], body) + errors


def serving_metadata(data: dict, name: str):
    rows = data["metadata"]
    text = ("CPU µs per serving step (medians) of the host work between scheduling and launch: `append` = "
            "`KVCacheManager.append_batch` of the step's new tokens, `prepare` = `AttentionBackend.prepare` (the "
            "metadata build and its one host-to-device copy), `total` = their sum. decode: one new token per "
            "sequence; prefill: 4096 tokens split evenly; mixed: half decodes, half prefill chunks; `engine decode`: "
            "the same inside `Engine.step` with CUDA-graph decode steps (`host` = step start to launch). Host work "
            "has no hardware ceiling: it must stay well under the GPU time of the step it prepares.")

    def plot(plt):
        done = [r for r in rows if "prepare_us" in r]
        series = [(k, [r.get(k + "_us") for r in done]) for k in ("prepare", "append", "host")]
        return bars(plt, [f"{r['kind']}, {r['num_seqs']} seqs" for r in done], series, "µs per step",
                    "host time per serving step")

    return text, metadata_table(rows), plot, "python benchmarks/bench_serving.py --metadata-only"


def cold_start(data: dict, name: str):
    serve_args = data.get("args", {}).get("serve_args") or []
    text = ("Whole-process wall time of `examples/serve.py`"
            + (f" ({' '.join(serve_args)})" if serve_args else " (its defaults)")
            + ": the first run on a fresh Triton cache (`cold`) and the next on the cache it left (`warm`), "
            "each pair on a new cache, attn-ops' C++/CUDA libraries built beforehand. `warm-up`: model, engine, "
            "compile round and CUDA-graph capture, as serve.py reports it; `round`: the engine's compile round "
            "(recording the warm-up's launches while their kernels compile in worker processes); `serving`: the "
            "timed run after the warm-up. Host and compiler time, so no hardware limit applies.")
    def both(cold, warm, key, digits=1):
        return "-" if key not in cold and key not in warm else f"{num(cold.get(key), digits)} / {num(warm.get(key), digits)}"

    body = []
    for s in data.get("summary", []):
        runs = {r["run"]: r for r in data["rows"] if r["pair"] == s["pair"]}
        cold, warm = runs["cold"], runs["warm"]
        body.append([str(s["pair"]), num(s["cold_s"]), num(s["warm_s"]), f"{s['ratio']:.2f}",
                     both(cold, warm, "warmup_s"), both(cold, warm, "compile_round_s"),
                     str(cold.get("variants", "-")), str(cold["cubins"]), both(cold, warm, "serving_s", 2)])
    header = ["pair", "cold s", "warm s", "cold / warm", "warm-up s (cold / warm)", "round s (cold / warm)",
              "variants compiled", "cubins", "serving s (cold / warm)"]
    failed = [f"- pair {r['pair']} {r['run']}: exit {r['rc']}" for r in data["rows"] if r.get("rc") != 0]

    def plot(plt):
        series = [(run, [next(r["wall_s"] for r in data["rows"] if r["pair"] == s["pair"] and r["run"] == run)
                         for s in data.get("summary", [])]) for run in ("cold", "warm")]
        return bars(plt, [f"pair {s['pair']}" for s in data.get("summary", [])], series, "s (whole process)",
                    "serve.py: first start against the next")

    args = {k: v for k, v in data.get("args", {}).items() if k not in ("serve_args", "timeout") and
            not (k == "pairs" and v == 2)}
    cmd = command("bench_cold_start.py", args) + (" -- " + shlex.join(serve_args) if serve_args else "")
    return text, table(header, body) + failed, plot, cmd


MLA_DECODE_PEERS = (("flashinfer_fa2", "FlashInfer fa2"), ("flashinfer_fa3", "FlashInfer fa3"),
                    ("sdpa_mha", "SDPA decompressed"), ("ours_mha", "ours decompressed"))
MLA_PREFILL_PEERS = (("flashinfer_fa3", "FlashInfer fa3"), ("cudnn_sdpa", "cuDNN SDPA"))
MLA_DEFAULTS = {"sections": ["decode", "prefill"], "formats": ["bf16", "fp8"], "page": 64,
                "peers": ["flashinfer_fa2", "flashinfer_fa3", "sdpa_mha", "cudnn_sdpa"]}


def mla_focus(rows: list[dict]) -> int | None:
    """The decode context length the table and plot show: 4096 if measured, else the longest."""
    ctxs = {r["ctx"] for r in rows}
    return 4096 if 4096 in ctxs else max(ctxs, default=None)


def mla(data: dict, name: str):
    rows = [r for r in data["rows"] if r.get("ours_us")]
    decode = [r for r in rows if r["section"] == "decode"]
    prefill = [r for r in rows if r["section"] == "prefill"]
    hbm, peak = limits(data["env"].get("gpu", ""))[:2]
    read = data.get("bandwidth", {}).get("read_GBps")
    ctx = mla_focus(decode)
    shown = [r for r in decode if r["ctx"] == ctx]
    text = ("MLA in DeepSeek-V3's shapes. Decode, the absorbed form: `paged_decode` over one latent cache "
            f"`[blocks, {data['args'].get('page', 64)}, 1, 576]` (values: its first 512 dims, a view), scale "
            "1/sqrt(192), one new token per sequence, against FlashInfer's `BatchMLAPagedAttentionWrapper` (fa2, fa3) "
            "on the same latent; SDPA and our `paged_decode` on the decompressed keys (192 dims) and values (128) "
            "per head (what transformers runs, and the passes rewrite), in the plot. GB/s = "
            "latent bytes (read once) / time for every implementation; FLOPs 2 · Hq · ctx · (576 + 512) per "
            "sequence.")
    if decode:
        best = max(decode, key=lambda r: r["ours_GBps"])
        text += (f" Our best row read {best['ours_GBps']:.0f} GB/s, {100 * best['ours_GBps'] / (hbm * 1e3):.0f}% of "
                 f"the {hbm} TB/s nominal" + (f" and {100 * best['ours_GBps'] / read:.0f}% of the {read:.0f} GB/s "
                                              "read bandwidth measured in this run" if read else "")
                 + f"; the most compute: {max(r['ours_tflops'] for r in decode):.0f} TFLOP/s ({peak} dense bf16 "
                 f"peak). Cells at ctx = {ctx} (every context in the JSON): our GB/s (× the best FlashInfer "
                 "time / ours, > 1: ours faster).")
    for r in prefill:
        peers = ", ".join(f"{label} {num(r.get(key + '_tflops'), 0)}" for key, label in MLA_PREFILL_PEERS)
        text += (f" Prefill, {r['num_seqs']} x {r['seqlen']} tokens, {r['hq']} heads of {r['d_qk']}/{r['d_v']} dims, "
                 f"causal: ours {r['ours_tflops']:.0f} TFLOP/s ({100 * r['ours_tflops'] / peak:.0f}% of peak, "
                 f"{r.get('backend', '-')}), {peers}.")
    text += checked(rows)
    batches = sorted({r["batch"] for r in shown})
    cell = {(r["fmt"], r["hq"], r["batch"]): r for r in shown}
    groups = list(dict.fromkeys((r["fmt"], r["hq"]) for r in shown))

    def fi_ratio(r):
        times = [r[k + "_us"] for k, _ in MLA_DECODE_PEERS[:2] if isinstance(r.get(k + "_us"), (int, float))]
        return f" ({min(times) / r['ours_us']:.2f})" if times else ""

    body = [[fmt, str(hq)] + [f"{cell[fmt, hq, b]['ours_GBps']:.0f}{fi_ratio(cell[fmt, hq, b])}"
                              if (fmt, hq, b) in cell else "-" for b in batches] for fmt, hq in groups]
    header = ["KV", "Hq"] + [f"B={b}" for b in batches]

    def plot(plt):
        cols = min(2, max(1, len(groups)))
        rows_ = -(-max(1, len(groups)) // cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(7.5, 2.6 * rows_), sharey=True, squeeze=False)
        for ax, (fmt, hq) in zip(axes.flat, groups):
            for (key, label), marker in zip((("ours", "ours"),) + MLA_DECODE_PEERS, "o^vsD"):
                pts = [(b, cell[fmt, hq, b]["latent_bytes"] / cell[fmt, hq, b][key + "_us"] / 1e3) for b in batches
                       if isinstance(cell.get((fmt, hq, b), {}).get(key + "_us"), (int, float))]
                if pts:
                    ax.plot(*zip(*pts), marker=marker, label=label)
            ax.axhline(hbm * 1e3, color="k", ls="--", lw=1, label=f"HBM nominal {hbm} TB/s")
            if read:
                ax.axhline(read, color="k", ls=":", lw=1, label=f"measured read {read:.0f} GB/s")
            ax.set(xscale="log", xlabel="batch", title=f"{fmt}, Hq = {hq}")
            ax.set_xticks(batches, labels=[str(b) for b in batches], fontsize=6)
        for ax in axes[:, 0]:
            ax.set_ylabel(f"GB/s of latent (ctx {ctx})", fontsize=7)
        fullest = max(axes.flat, key=lambda ax: len(ax.get_legend_handles_labels()[0]))
        axes[0][-1].legend(*fullest.get_legend_handles_labels(), fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
        return fig

    args = {k: v for k, v in data["args"].items() if MLA_DEFAULTS.get(k, object()) != v}
    return text, table(header, body) if body else [], plot, command("bench_mla.py", args)


# benchmark -> (heading, renderer), in the document's order; the other benchmarks' results are kept
SECTIONS = {
    "decode": ("Decode: `paged_decode`", decode),
    "prefill": ("Prefill: `context_attention` and `paged_prefill`", prefill),
    "fp8": ("FP8 context attention (CUTLASS)", fp8),
    "mla": ("MLA: latent-cache decode and 192/128 prefill (DeepSeek-V3 shapes)", mla),
    "kvwrite": ("KV-cache write: `kv_cache_write`", kvwrite),
    "host": ("Host time per eager call", host),
    "e2e": ("End to end: `torch.compile` with the passes", e2e),
    "generate": ("`generate()`: transformers' static-cache compile, stock and with the passes", generate),
    "serving": ("Serving: engine decode against transformers", serving),
    "serving_metadata": ("Serving: host time per step", serving_metadata),
    "cold_start": ("Serving: first start on a fresh machine", cold_start),
}


# ---- the document ---------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def provenance(path: Path, env: dict) -> str:
    flashinfer = env.get("flashinfer", "-")
    commit = str(env.get("git_commit", "-")).split()[0]
    commit = commit[:7] + "+changes" * commit.endswith("+changes")   # a tree that differed from it
    return (f"`{path.name}`: {env['date'][:10]}, commit {commit}, "
            f"torch {env.get('torch', '-')}, Triton {env.get('triton', '-')}, "
            f"FlashInfer {'-' if flashinfer.startswith('unavailable') else flashinfer}.")


def render(results: Path = RESULTS, img: Path | None = None) -> str:
    """The markdown of docs/performance.md. With `img`, writes the plots there (where matplotlib is
    installed, removing the PNGs no section uses) and links those it holds; without, writes none
    and links those in docs/img."""
    runs = latest(results.glob("*.json"))
    plt = pyplot() if img is not None else None
    img = img or IMG
    out = ["# Performance", "",
           "Generated by `python benchmarks/report.py` from the latest run of each benchmark on each GPU in "
           "`benchmarks/results/` (earlier runs: git history); do not edit by hand. Each table is one run: peers "
           "ran in the same process on the same inputs, and every ratio compares numbers of that run. Hardware "
           "limits used below (nominal):", "",
           "| GPU | HBM | dense bf16 | dense FP8 |", "|---|---|---|---|"]
    for gpu in sorted({gpu for _, _, gpu in runs}):
        hbm, bf16, f8 = limits(gpu)
        out.append(f"| {gpu} | {hbm} TB/s | {bf16} TFLOP/s | {f8} TFLOP/s |")
    written = set()
    for kind, (heading, renderer) in SECTIONS.items():
        mine = sorted((k, v) for k, v in runs.items() if k[0] == kind)
        if mine:
            out += ["", f"## {heading}"]
        for i, ((_, run_mode, gpu), (path, data)) in enumerate(mine):
            text, lines, plot, cmd = renderer(data, path.stem)
            out += [""] * bool(i) + [f"### {gpu}" + (f", {run_mode}" if run_mode else ""),
                    f"{provenance(path, data['env'])} {text} Reproduce: `{cmd}`", ""] + lines
            png = img / f"{path.stem}.png"
            if plt is not None:
                fig = plot(plt)
                fig.tight_layout()
                fig.savefig(png, dpi=110, metadata={"Software": None})
                plt.close(fig)
                written.add(png)
            if png.exists():
                out += ["", f"![{path.stem}](img/{png.name})"]
    others = sorted(p.name for (kind, _, _), (p, _) in runs.items() if kind not in SECTIONS)
    if others:
        out += ["", "Also kept in `benchmarks/results/`, not rendered here: " + ", ".join(f"`{o}`" for o in others) + "."]
    if plt is not None:
        for stale in set(img.glob("*.png")) - written:
            stale.unlink()
    return "\n".join(out) + "\n"


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(RESULTS, IMG))


if __name__ == "__main__":
    main()
