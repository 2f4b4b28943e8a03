"""Render committed benchmark JSON (benchmarks/results/*.json) as docs/performance.md.

    python benchmarks/report.py            # rewrites docs/performance.md
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PEERS = ("flashinfer", "flashinfer_tc", "cudnn_sdpa", "flash_sdpa", "flex")


def _us(row: dict, key: str) -> str:
    v = row.get(f"{key}_us")
    return f"{v:.1f}" if v else "-"


def _ratio(row: dict, key: str) -> float | None:
    v = row.get(f"{key}_us")
    return v / row["ours_us"] if v else None


def _fmt_ratio(r: float | None) -> str:
    return f"{r:.2f}" if r else "-"


def decode_section(data: dict, name: str) -> list[str]:
    env, bw = data["env"], data["bandwidth"]
    read = bw["read_GBps"]
    lines = [
        f"## paged_decode: {env['gpu']} ({name})",
        "",
        f"{env['date']}, commit {env['git_commit']}; torch {env['torch']}, triton {env['triton']}, "
        f"FlashInfer {env.get('flashinfer', '-')}. Measured read bandwidth {read:.0f} GB/s (a bf16 "
        "sum over 2 GiB). Times in µs (CUDA-graph replays, median; caches rotated past L2). "
        "`GB/s` = KV bytes read / time; `%read` = of the measured read bandwidth. Ratios are peer "
        "time / our time (> 1: we are faster); FI = FlashInfer decode (CUDA cores), FI-tc = "
        "FlashInfer with tensor cores (its prefill kernel). cuDNN/flash SDPA and FlexAttention "
        "read a contiguous cache. D = 128, block size 16, bf16 queries. `(cuda)`: the automatic "
        "choice ran the CUDA kernel (torch_ops/cuda_decode.py); otherwise, or in runs before it "
        "existed, the Triton kernel.",
        "",
        "| B | ctx | Hq/Hkv | KV | ours µs | GB/s | %read | FI | FI-tc | cuDNN | flash | flex "
        "| ×best FI | ×cuDNN | err ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        fi = [r for r in (_ratio(row, "flashinfer"), _ratio(row, "flashinfer_tc")) if r]
        lines.append(
            f"| {row['batch']} | {row['ctx']} | {row['hq']}/{row['hkv']} | {row['fmt']}"
            f"{' (cuda)' if row.get('backend') == 'cuda' else ''} | "
            f"{row['ours_us']:.1f} | {row['ours_GBps']:.0f} | {100 * row['ours_GBps'] / read:.0f} | "
            + " | ".join(_us(row, p) for p in PEERS)
            + f" | {_fmt_ratio(min(fi) if fi else None)} | {_fmt_ratio(_ratio(row, 'cudnn_sdpa'))} | "
            f"{'yes' if row.get('check', {}).get('ok') else 'no' if 'check' in row else '-'} |"
        )
    return lines + [""]


def _header(data: dict, title: str, name: str) -> list[str]:
    env = data["env"]
    return [f"## {title}: {env.get('gpu', 'no GPU')} ({name})", "",
            f"{env['date']}, commit {env['git_commit']}; torch {env['torch']}, triton {env['triton']}, "
            f"FlashInfer {env.get('flashinfer', '-')}.", ""]


def prefill_section(data: dict, name: str) -> list[str]:
    peers = ("flash_sdpa", "cudnn_sdpa", "flashinfer_fa3", "flex")
    lines = _header(data, "context_attention / paged_prefill", name) + [
        "TFLOP/s (causal counted as half the FLOPs), bf16, 32 query heads (GQA 32/8 for paged and mixed "
        "rows); `×best` = best peer time / our time. `contig` = our context_attention on the same "
        "tokens; `parts` = our time for the mixed batch's prefill and decode parts run separately; "
        "`[cutlass; triton N]` = the automatic choice ran the CUTLASS backend, our Triton kernel made N TF/s on the same "
        "call (and likewise for the other backends; `mixed` = CUTLASS for the sequences of more than 64 queries, "
        "Triton for the rest).", "",
        "| case | D | causal | ours TF/s | flash SDPA | cuDNN SDPA | FlashInfer fa3 | flex | ×best | err ok |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        case = f"{r['section']} " + (r.get("desc") or f"S={r.get('seqlen')} {r.get('batch')}")
        tf = [f"{r[p + '_tflops']:.0f}" if r.get(p + "_tflops") else "-" for p in peers]
        best = [r[p + "_us"] for p in peers if r.get(p + "_us")]
        extra = f" (parts {r['parts_sum_us']:.0f} µs)" if r.get("parts_sum_us") else ""
        extra += f" (contig {r['ours_contiguous_tflops']:.0f} TF/s)" if r.get("ours_contiguous_tflops") else ""
        others = [f"{b} {r[f'ours_{b}_tflops']:.0f} TF/s" for b in ("triton", "cutlass", "mixed")
                  if r.get(f"ours_{b}_tflops")]
        extra += f" [{r['backend']}; {', '.join(others)}]" if others else ""
        lines.append(f"| {case}{extra} | {r.get('d')} | {r.get('causal')} | {r['ours_tflops']:.0f} | "
                     + " | ".join(tf) + f" | {_fmt_ratio(min(best) / r['ours_us'] if best else None)} | "
                     f"{'yes' if r.get('check', {}).get('ok') else '-'} |")
    return lines + [""]


def fp8_section(data: dict, name: str) -> list[str]:
    """benchmarks/bench_fp8.py: the cutlass backend (FP8 and bf16) against its peers."""
    impls = ("cutlass_fp8", "cutlass_bf16", "triton_fp8", "triton_bf16", "flashinfer_fa3_fp8",
             "flashinfer_fa3_bf16", "cudnn_sdpa_bf16")
    grid = " (persistent grid)" if data.get("cutlass_persistent") else ""
    lines = _header(data, f"FP8 context attention{grid}", name) + [
        "TFLOP/s (causal counted as half the FLOPs), packed varlen batches of 16k tokens (`B=`: that many "
        "sequences); `×fa3` = FlashInfer fa3 FP8 time / our FP8 time; RMSE of heads 0-1 against the fp32 reference on the "
        "same FP8 inputs (ours / FlashInfer's).", "",
        "| case | causal | " + " | ".join(i.replace("flashinfer_", "") for i in impls) + " | ×fa3 | RMSE ours / fa3 |",
        "|---|---|" + "---|" * (len(impls) + 2)]
    for r in data["rows"]:
        tf = [f"{r[i + '_tflops']:.0f}" if isinstance(r.get(i + "_tflops"), float) else "-" for i in impls]
        ratio = r.get("flashinfer_fa3_fp8_vs_cutlass_fp8")
        rmse = [r.get(i + "_rmse") for i in ("cutlass_fp8", "flashinfer_fa3_fp8")]
        rmse_text = " / ".join(f"{x:.2e}" if isinstance(x, float) else "-" for x in rmse)
        lines.append(f"| {r['case']} | {r['causal']} | " + " | ".join(tf) + f" | {_fmt_ratio(ratio)} | {rmse_text} |")
    return lines + [""]


def kvwrite_section(data: dict, name: str) -> list[str]:
    lines = _header(data, "kv_cache_write", name) + [
        "Hkv = 8, D = 128, block 16; `%copy` = a device copy of the same bytes / our time; `torch` = "
        "plain PyTorch indexing (and RoPE); FlashInfer's `append_paged_kv_cache` for bf16.", "",
        "| T | KV | mode | ours µs | GB/s | %copy | torch µs | ×torch | FlashInfer µs | ×FI |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['tokens']} | {r['fmt']} | {r['mode']} | {r['ours_us']:.1f} | {r['ours_GBps']:.0f} | "
                     f"{r['pct_copy']:.0f} | {_us(r, 'torch')} | {_fmt_ratio(r.get('vs_torch'))} | "
                     f"{_us(r, 'flashinfer')} | {_fmt_ratio(r.get('vs_flashinfer'))} |")
    return lines + [""]


def cascade_section(data: dict, name: str) -> list[str]:
    hq, hkv = data["heads"]
    lines = _header(data, "cascade decode over shared prefixes", name) + [
        f"B sequences in G groups, each group sharing a `prefix`-token prefix, each sequence owning "
        f"`own` more tokens; Hq/Hkv = {hq}/{hkv}, D = {data['head_dim']}, block {data['block_size']}, bf16. "
        "`full` = our paged_decode over each sequence's whole block table, FI = FlashInfer's "
        "tensor-core decode over the same tables; `GB/s` = the KV bytes the cascade must read / its time.", "",
        "| B | G | prefix | own | full µs | FI µs | cascade µs | ×full | ×FI | GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['batch']} | {r['groups']} | {r['prefix']} | {r['own']} | {r['full_us']:.1f} | "
                     f"{_us(r, 'flashinfer')} | {r['cascade_us']:.1f} | {_fmt_ratio(r.get('speedup_vs_full'))} | "
                     f"{_fmt_ratio(r.get('speedup_vs_flashinfer'))} | {r['cascade_GBps']:.0f} |")
    return lines + [""]


def cache_attention_section(data: dict, name: str) -> list[str]:
    lines = _header(data, "cache_attention (PPL contract) vs our separate ops", name) + [
        "`ours` = one cache_attention call (its metadata kernel, kv_cache_write, then paged_decode or one "
        "paged_prefill); `w+dec`/`w+pre` = kv_cache_write + paged_decode/paged_prefill on an equivalent NHD "
        "paged cache; `w+split` = the mixed batch's decode and prefill parts as separate calls. "
        "`ours/best` > 1: slower than the best separate composition. Hq/Hkv = 32/8, D = 128.", "",
        "| case | quant bits | cache mode | ours µs | meta µs | w+dec µs | w+pre µs | w+split µs | ours/best | err ok |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        cells = [f"{r[k]:.1f}" if r.get(k) else "-" for k in ("meta_us", "write_decode_us", "write_prefill_us", "write_split_us")]
        lines.append(f"| {r['kind']} {r['params']} | {r['quant_bit']} | {('offset', 'paged')[r['cache_mode']]} | "
                     f"{r['ours_us']:.1f} | " + " | ".join(cells) + f" | {r['ratio']:.2f} | "
                     f"{'yes' if r.get('check', {}).get('ok') else '-'} |")
    return lines + [""]


def e2e_compile_section(data: dict, name: str) -> list[str]:
    lines = _header(data, "torch.compile end to end (random 1B Llama)", name) + [
        "Model: {num_hidden_layers} layers, hidden {hidden_size}, {num_attention_heads}/{num_key_value_heads} "
        "heads of dim {head_dim}, bf16. ".format(**data["model"]) + "`passes` = `torch.compile` after `fx_passes.enable()`; "
        "`×compile` = stock compile time / this time (> 1: faster); compile time in seconds. "
        + ("Inductor freezing on (weights as constants). " if data.get("freezing") else "")
        + ("Times: CUDA-graph replays." if data.get("graphs") else "Times: eager launches (do_bench)."), "",
        "| case | variant | mode | µs | ×compile | compile s | breaks | recompiles | passes |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        passes = ", ".join(f"{k} {v}" for k, v in r.get("passes", {}).items())
        lines.append(f"| {r['case']} {r['shape']} | {r['variant']} | {r['mode']} | {r['time_us']:.0f} | "
                     f"{_fmt_ratio(r.get('speedup_vs_compile'))} | "
                     f"{r['compile_s']:.1f} | " if r.get("compile_s") else
                     f"| {r['case']} {r['shape']} | {r['variant']} | {r['mode']} | {r['time_us']:.0f} | - | - | ")
        lines[-1] += f"{r.get('graph_breaks', '-')} | {r.get('recompiles', '-')} | {passes or '-'} |"
    return lines + [""]


def _metadata_table(rows: list[dict]) -> list[str]:
    lines = ["| kind | seqs | tokens | prepare µs | append µs | total µs | host µs |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['num_seqs']} | {r.get('num_tokens', '-')} | {_us(r, 'prepare')} | "
                     f"{_us(r, 'append')} | {_us(r, 'total')} | {_us(r, 'host')} |")
    return lines + [""] + _failures([(f"{r['kind']} {r['num_seqs']}", r.get("error")) for r in rows])


def _failures(errors: list[tuple[str, str | None]]) -> list[str]:
    """A bullet per (what, error) with an error, then a blank line; nothing if none failed."""
    bullets = [f"- {what} failed: {error}" for what, error in errors if error]
    return bullets + [""] if bullets else []


def serving_metadata_section(data: dict, name: str) -> list[str]:
    return _header(data, "serving: host time per step", name) + [
        "CPU µs per step (medians) of the host work between scheduling and launch, called as `Engine.step` "
        "calls it: `append` = `KVCacheManager.append_batch` of the step's new tokens, `prepare` = "
        "`AttentionBackend.prepare` (the metadata build and its one host-to-device copy), `total` = their "
        "per-step sum. decode: 1 new token per sequence; prefill: 4096 tokens split evenly; mixed: half "
        "decodes, half prefill chunks. `engine decode` = the same work inside `Engine.step` with CUDA-graph "
        "decode steps (`append` = the whole scheduler, `host` = step start to launch). Issue 7 target: "
        "metadata build (`prepare`) ≤ 50 µs per step at 256 sequences.", ""] + _metadata_table(data["metadata"])


def serving_section(data: dict, name: str) -> list[str]:
    m = data["model"]
    lines = _header(data, "serving: engine decode vs transformers", name) + [
        f"Random-weight Llama ({m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']}/"
        f"{m['num_kv_heads']} heads of dim {m['head_dim']}, bf16), B requests of {data['prompt_len']} prompt "
        f"tokens and {data['new_tokens']} new tokens. `ours` = the engine's decode steps (triton backend, a "
        "CUDA graph per batch size); medians per step of the wall time, GPU time, host time (step start to "
        f"launch) and metadata build (`prepare`). `hf` = transformers {data['env'].get('transformers', '-')} "
        '`generate` with a static cache and `torch.compile(mode="reduce-overhead")` on the same shapes '
        f"(median of {data['hf_reps']}). Issue 7 targets: `×hf` ≥ 2 at batch 64; a replayed decode step "
        "≤ 1.05× the sum of its kernels' times.", "",
        "| B | ours tok/s | step µs | GPU µs | host µs | metadata µs | hf tok/s | ×hf |",
        "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        hf = r.get("hf_tokens_per_s")
        lines.append(f"| {r['batch']} | {r['ours_tokens_per_s']:.0f} | {_us(r, 'ours_step_wall')} | "
                     f"{_us(r, 'ours_step_gpu')} | {_us(r, 'ours_host')} | {_us(r, 'ours_metadata')} | "
                     f"{f'{hf:.0f}' if hf else '-'} | {_fmt_ratio(r.get('speedup'))} |")
    lines += [""] + _failures([(f"transformers at B = {r['batch']}", r.get("hf_error")) for r in data["rows"]])
    replay = data.get("replay")
    if replay:
        # Files from before `replay_us` timed replays one at a time only; their `ratio` is that one.
        ratios = ((replay.get("ratio"), replay.get("ratio_isolated")) if "replay_us" in replay
                  else (None, replay.get("ratio")))
        lines += [f"One decode step replayed {replay['replays']} times at B = {replay['batch']}, back to back "
                  "(GPU time per replay between two events: the target's ratio) and one at a time after a sync "
                  "(the host's graph launch included), against the median sum of its kernels' durations "
                  "(torch.profiler).", "",
                  "| B | back to back µs | one at a time µs | kernel sum µs | kernels | ratio | one at a time |",
                  "|---|---|---|---|---|---|---|",
                  f"| {replay['batch']} | {_us(replay, 'replay')} | {_us(replay, 'replay_wall')} | "
                  f"{_us(replay, 'kernel_sum')} | {replay['kernels_per_replay']:.0f} | "
                  + " | ".join(f"{r:.3f}" if r else "-" for r in ratios) + " |", ""]
        lines += _failures([("replay timing", replay.get("error"))])
    if data.get("metadata"):
        lines += ["Host time per step, as in the `serving_metadata` section:", ""] + _metadata_table(data["metadata"])
    return lines


def host_section(data: dict, name: str) -> list[str]:
    sh = data["shape"]
    lines = _header(data, "host time per eager call", name) + [
        f"µs of host time per call (back-to-back calls, median of {data['repeats']} loops of {data['iters']}; "
        f"`benchmarks/bench_host.py`): B = {sh['batch']} sequences of {sh['ctx']} keys, {sh['hq']}/{sh['hkv']} heads, "
        f"D = {sh['d']}, {sh['page']}-token pages; prefill {sh['prefill_seqs']} x {sh['prefill_q']} queries. Tiny problems: "
        "every row is bound by the host, not the GPU (`device µs`: the same call replayed in a CUDA graph). "
        "`auto` is the automatic choice (the backend it took in parentheses), `pinned` the fastest backend pinned with "
        "`use_backend`; `first ms` is the first call of the row in the process (planning, and compiling or loading "
        "kernels not compiled for an earlier row). Peers ran in the same process on the same shapes.", "",
        "| op | variant | auto µs | pinned µs | device µs | first ms | FlashInfer µs | SDPA µs |",
        "|---|---|---|---|---|---|---|---|"]
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in data["rows"]:
        if "host_us" in r:
            cases.setdefault((r["op"], r["variant"]), {})[r["backend"]] = r
    for (op, variant), by in cases.items():
        auto = by.get("auto", {})
        pinned = [(r["host_us"], b) for b, r in by.items() if b not in ("auto", "flashinfer", "sdpa")]
        best = f"{min(pinned)[0]:.1f} ({min(pinned)[1]})" if pinned else "-"
        peers = [f"{by[p]['host_us']:.1f}" if p in by else "-" for p in ("flashinfer", "sdpa")]
        lines.append(f"| {op} | {variant} | {auto.get('host_us', 0):.1f} ({auto.get('chosen', '-')}) | {best} | "
                     f"{auto.get('device_us', 0):.1f} | {auto.get('first_ms', 0):.0f} | " + " | ".join(peers) + " |")
    return lines + [""]


SECTIONS = {"e2e_compile": e2e_compile_section, "decode": decode_section, "prefill": prefill_section, "kvwrite": kvwrite_section,
            "fp8": fp8_section,
            "cascade": cascade_section, "cache_attention": cache_attention_section, "serving": serving_section,
            "serving_grid": serving_section, "serving_metadata": serving_metadata_section, "bench_host": host_section}
NEWEST_ONLY = ("serving", "serving_grid", "serving_metadata", "bench_host")  # later runs supersede earlier ones


def _date(data: dict) -> datetime.datetime:
    return datetime.datetime.fromisoformat(data["env"]["date"])


def main() -> None:
    out = ["# Performance", "",
           "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; each "
           "table is one run on one GPU, peers measured in the same run.", ""]
    notes = ROOT / "docs" / "performance_notes.md"
    runs = []  # (kind, file name, data), by file name
    for path in sorted(RESULTS.glob("*.json")):
        # The longest matching prefix: serving_metadata_* is not a serving_* file.
        kind = max((k for k in SECTIONS if path.stem.startswith(k + "_")), key=len, default=None)
        if kind is not None and not path.stem.endswith("_partial"):
            runs.append((kind, path.name, json.loads(path.read_text())))
    dated = sorted((r for r in runs if r[0] in NEWEST_ONLY), key=lambda r: _date(r[2]))
    newest = {kind: name for kind, name, _ in dated}  # the last one of each kind stays
    for kind, name, data in runs:
        if kind not in NEWEST_ONLY or newest[kind] == name:
            out += SECTIONS[kind](data, name)
    if notes.exists():
        out += [notes.read_text()]
    (ROOT / "docs" / "performance.md").write_text("\n".join(out))


if __name__ == "__main__":
    main()
