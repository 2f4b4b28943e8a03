"""The `cutlass` backend (torch_ops/cutlass.py and cutlass_build.py, csrc/fmha_sm90.cu).

CPU: build-command construction, the C ABI mirror, the JIT cache, the persistent-grid knob and
grid size, the registry's reasons. GPU (marked; needs an sm_90 GPU, nvcc and the nvidia-cutlass
wheel; the first call builds the library, about a minute on 16 cores): `context_attention` on the
plain and the persistent kernels, and `paged_prefill` on the paged ones, against the float64
reference with the error-ratio rule. FP8
kernels round the softmax probabilities P to e4m3 before the PV product (as FA3/FlashInfer FP8
do), so their baseline is a PyTorch computation that does the same.
"""

from __future__ import annotations

import ctypes
import logging
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import torch_ops
from torch_ops import cutlass, cutlass_build, gpu, quant, reference
from torch_ops.nvcc import sources_with_headers
from torch_ops.testing import assert_error_ratio, assert_replays_match_eager, poison_

E4M3, BF16, FP16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
HEADER = cutlass_build.CSRC / "fmha_sm90.h"


def fmha_source() -> str:
    """csrc/fmha_sm90.cu and the csrc headers it includes, as one text."""
    return "".join((cutlass_build.CSRC / name).read_text()
                   for name in sources_with_headers(("fmha_sm90.cu",), cutlass_build.CSRC))


# ---- build and ABI (CPU) -------------------------------------------------------------------------


def test_compile_command_targets_sm90a_and_selects_the_instantiation(tmp_path):
    cmd = cutlass_build.compile_command("/opt/nvcc", "e4m3", 256, tmp_path / "x.o", [Path("/inc/a"), Path("/inc/b")],
                                        ("X=1",))
    assert cmd[0] == "/opt/nvcc"
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert {"-DATTN_ELEMENT_E4M3", "-DATTN_HEAD_DIM=256", "-DATTN_PERSISTENT=0", "-DX=1", "-I/inc/a", "-I/inc/b",
            f"-I{cutlass_build.CSRC}"} <= set(cmd)
    assert cmd[-4:] == ["-c", str(cutlass_build.CSRC / "fmha_sm90.cu"), "-o", str(tmp_path / "x.o")]
    assert "-DATTN_PAGED=0" in cmd
    persistent = cutlass_build.compile_command("/opt/nvcc", "e4m3", 256, tmp_path / "x.o", [], variant="persistent")
    assert "-DATTN_PERSISTENT=1" in persistent and "-DATTN_PERSISTENT=0" not in persistent
    paged = cutlass_build.compile_command("/opt/nvcc", "bf16", 128, tmp_path / "x.o", [], variant="paged")
    assert {"-DATTN_PAGED=1", "-DATTN_PERSISTENT=0"} <= set(paged)
    paged16 = cutlass_build.compile_command("/opt/nvcc", "bf16", 128, tmp_path / "x.o", [], variant="paged16")
    assert {"-DATTN_PAGED=2", "-DATTN_PERSISTENT=0"} <= set(paged16)
    link = cutlass_build.link_command("/opt/nvcc", [tmp_path / "a.o", tmp_path / "b.o"], tmp_path / "lib.so")
    assert "-shared" in link and "-cudart=static" in link and link[-2:] == ["-o", str(tmp_path / "lib.so")]


@pytest.mark.parametrize("persistent", [None, True])
def test_build_compiles_every_instantiation_in_the_chosen_grids_and_links_them(monkeypatch, tmp_path, persistent):
    """The plain and paged kernels (paged16: D = 128), alone and in clusters, always; the persistent
    ones of PERSISTENT_SHORT and PAGED_PERSISTENT_KERNELS, or all of them, the paged ones too, when the
    persistent grid is forced on."""
    monkeypatch.setattr(cutlass, "PERSISTENT", persistent)
    commands = []

    def fake_tool(cmd):
        commands.append(cmd)
        Path(cmd[-1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cutlass_build, "_run_tool", fake_tool)
    monkeypatch.setattr(cutlass_build, "cutlass_include_dirs", lambda: [Path("/inc")])
    library = cutlass_build.build(tmp_path / "out" / "lib.so", nvcc="/opt/nvcc", jobs=1)
    *compiles, link = commands
    defines = {tuple(a for a in c if a.startswith(("-DATTN_ELEMENT", "-DATTN_HEAD_DIM", "-DATTN_PERSISTENT",
                                                   "-DATTN_PAGED", "-DATTN_CLUSTER")))
               for c in compiles}
    short = {key: cutlass.KERNELS[key] for key in cutlass.PERSISTENT_SHORT}
    paged16 = {key: e for key, e in cutlass.PAGED_KERNELS.items() if key[1] == 128}
    paged = {(1, 1): cutlass.PAGED_KERNELS, (2, 1): paged16, (1, 2): cutlass.PAGED_KERNELS, (2, 2): paged16}
    grids = {(0, 0, 1): cutlass.KERNELS, (1, 0, 1): cutlass.KERNELS if persistent else short,
             **{(0, g, c): kernels for (g, c), kernels in paged.items()},
             **({(1, g, c): kernels for (g, c), kernels in paged.items()} if persistent
                else {(1, 1, 2): cutlass.PAGED_PERSISTENT_KERNELS})}
    expected = {(f"-DATTN_ELEMENT_{e.upper()}", f"-DATTN_HEAD_DIM={d}", f"-DATTN_PERSISTENT={p}", f"-DATTN_PAGED={g}",
                 f"-DATTN_CLUSTER={c}") for (p, g, c), kernels in grids.items() for (_, d), e in kernels.items()}
    assert defines == expected and len(compiles) == len(expected) == (40 if persistent else 27)
    objects = [c[-1] for c in compiles]
    assert len(set(objects)) == len(objects) and set(objects) <= set(link)
    assert library.exists()


def test_every_shipped_element_is_defined_in_the_source():
    source = fmha_source()
    for element in set(cutlass.KERNELS.values()):
        assert f"defined(ATTN_ELEMENT_{element.upper()})" in source
    assert {d for _, d in cutlass.KERNELS} <= {int(d) for d in re.findall(r"kHeadDim == (\d+)", source)}


def test_ctypes_struct_mirrors_the_c_header():
    body = re.search(r"typedef struct \{(.*?)\} AttnFmhaArgs;", HEADER.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    scalars = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        base, pointer, names = re.match(r"(?:const\s+)?(\w+)\s*(\*?)\s*(.*)", decl).groups()
        ctype = ctypes.c_void_p if pointer else scalars[base]
        fields += [(n.strip(), ctype) for n in names.split(",")]
    assert cutlass_build.FmhaArgs._fields_ == fields


def test_build_key_follows_sources_flags_and_toolchain(monkeypatch):
    monkeypatch.setattr(cutlass_build, "_cutlass_version", lambda: "4.2.0")
    monkeypatch.setattr(cutlass_build, "_nvcc_version", lambda nvcc: "release 13.0")
    key = cutlass_build.build_key("nvcc")
    assert key == cutlass_build.build_key("nvcc")
    assert key != cutlass_build.build_key("nvcc", ("ATTN_SOMETHING=1",))
    monkeypatch.setattr(cutlass_build, "_nvcc_version", lambda nvcc: "release 13.1")
    assert key != cutlass_build.build_key("nvcc")


def test_build_key_follows_every_header_the_source_includes(monkeypatch, tmp_path):
    monkeypatch.setattr(cutlass_build, "_cutlass_version", lambda: "4.2.0")
    monkeypatch.setattr(cutlass_build, "_nvcc_version", lambda nvcc: "release 13.0")
    csrc = tmp_path / "csrc"
    shutil.copytree(cutlass_build.CSRC, csrc)
    monkeypatch.setattr(cutlass_build, "CSRC", csrc)
    headers = sources_with_headers(cutlass_build.SOURCES, csrc)[len(cutlass_build.SOURCES):]
    assert set(headers) == {p.name for p in csrc.glob("fmha_sm90_*.cuh")}
    for header in headers:
        key = cutlass_build.build_key("nvcc")
        with open(csrc / header, "a") as f:
            f.write("\n")
        assert cutlass_build.build_key("nvcc") != key, header


def test_sources_with_headers_follows_local_includes_through_headers(tmp_path):
    (tmp_path / "a.cu").write_text('#include <cuda.h>\n#include "cute/tensor.hpp"\n'
                                   '#include "a.h"\n  #  include "b.cuh"\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "c.cuh"  // c\n')
    (tmp_path / "b.cuh").write_text('#include "a.h"\n#include "b.cuh"\n')
    (tmp_path / "c.cuh").write_text("")
    (tmp_path / "unused.cuh").write_text("")
    assert sources_with_headers(("a.cu",), tmp_path) == ["a.cu", "a.h", "b.cuh", "c.cuh"]


def test_entry_points_in_the_source_match_the_names_python_looks_up():
    source = fmha_source()
    assert "attn_fmha_sm90_##a##_d##b##c##d##e" in source

    def defined(macro):
        return {line.split()[2] if len(line.split()) > 2 else "" for line in source.splitlines()
                if line.startswith(f"#define {macro}")}
    # the entry's suffix: family, cluster, grid
    suffixes = {f + c + g for f in defined("ATTN_FAMILY") for c in defined("ATTN_CLUSTERED") for g in defined("ATTN_GRID")}
    families = {suffix.removesuffix("_persistent").removesuffix("x2") for suffix in cutlass_build.VARIANTS.values()}
    assert families == defined("ATTN_FAMILY")
    assert set(cutlass_build.VARIANTS.values()) <= suffixes
    assert cutlass_build.VARIANTS["plain"] == ""
    assert re.search(rf"Shape<_128, _{cutlass.PAGED_KEY_TILE}, _128>", source)  # the paged kernels' key tile
    # the host sizes the persistent grid with BLOCK_M query rows per work tile: every tile shape's M
    tile_shapes = source[source.index("using TileShape = "):source.index("#endif", source.index("using TileShape = "))]
    assert set(re.findall(r"Shape<_(\d+), ", tile_shapes)) == {str(cutlass.BLOCK_M)}


def test_jit_builds_once_into_the_cache_and_logs(monkeypatch, tmp_path, caplog):
    builds = []

    def fake_build(target, nvcc, variants):
        builds.append(target)
        target.parent.mkdir(parents=True)
        target.write_bytes(b"\0" * 1000)
        return target

    monkeypatch.setattr(cutlass_build, "PREBUILT", tmp_path / "missing.so")
    monkeypatch.setenv("ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cutlass_build, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(cutlass_build, "build_key", lambda nvcc, variants: "abc123")
    monkeypatch.setattr(cutlass_build, "build", fake_build)
    with caplog.at_level(logging.WARNING, logger="torch_ops.cutlass_build"):
        first = cutlass_build.library_path()
        second = cutlass_build.library_path()
    assert first == second == tmp_path / "cache" / "fmha_sm90-abc123" / cutlass_build.LIBRARY_NAME
    assert builds == [first]
    assert any("compiling the CUTLASS FMHA kernels" in r.message for r in caplog.records)
    assert any(re.search(r"built .* in \d+ s", r.message) for r in caplog.records)


def test_without_nvcc_or_prebuilt_the_reason_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(cutlass_build, "PREBUILT", tmp_path / "missing.so")
    monkeypatch.setattr(cutlass_build, "find_nvcc", lambda: None)
    cutlass_build._build_unavailable.cache_clear()
    try:
        assert "no nvcc" in cutlass_build._build_unavailable()
        with pytest.raises(RuntimeError, match="no nvcc"):
            cutlass_build.library_path()
    finally:
        cutlass_build._build_unavailable.cache_clear()


# ---- persistent grid (CPU) -----------------------------------------------------------------------


@pytest.fixture
def knob(monkeypatch):
    """Clears the PERSISTENT knob and its environment variable; returns monkeypatch."""
    monkeypatch.setattr(cutlass, "PERSISTENT", None)
    monkeypatch.delenv("ATTN_CUTLASS_PERSISTENT", raising=False)
    return monkeypatch


def test_persistent_knob_defaults_to_automatic_and_reads_the_environment(knob):
    assert cutlass.persistent_mode() is None
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "1")
    assert cutlass.persistent_mode() is True
    knob.setenv("ATTN_CUTLASS_PERSISTENT", " 0 ")
    assert cutlass.persistent_mode() is False
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "auto")
    assert cutlass.persistent_mode() is None
    knob.setattr(cutlass, "PERSISTENT", True)   # the attribute wins over the environment
    assert cutlass.persistent_mode() is True
    knob.setenv("ATTN_CUTLASS_PERSISTENT", "1")
    knob.setattr(cutlass, "PERSISTENT", False)
    assert cutlass.persistent_mode() is False


@pytest.mark.parametrize("value", ["yes", "true", "2", ""])
def test_persistent_environment_value_must_be_0_1_or_auto(knob, value):
    knob.setenv("ATTN_CUTLASS_PERSISTENT", value)
    with pytest.raises(ValueError, match="ATTN_CUTLASS_PERSISTENT must be 0, 1 or auto"):
        cutlass.persistent_mode()


def test_persistent_attribute_must_be_a_bool_or_none(knob):
    knob.setattr(cutlass, "PERSISTENT", 1)
    with pytest.raises(TypeError, match="PERSISTENT must be True, False or None"):
        cutlass.persistent_mode()


def test_automatic_grid_is_persistent_for_short_prompts_where_it_measured_faster(knob):
    fp8, bf16, fp16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
    run = cutlass.runs_persistent
    assert run(fp8, 128, False, 16384, 8) and run(fp8, 128, True, 16384, 8)             # mean 2k
    assert not run(fp8, 128, False, 16384, 4) and not run(fp8, 128, True, 16384, 4)     # mean 4k
    assert run(fp8, 128, True, 5000, 3)                                                 # ragged, mean under 2k
    assert not run(fp8, 256, False, 1024, 2)                                            # not in the default build
    assert run(bf16, 128, True, 16384, 16) and not run(bf16, 128, True, 16384, 8)       # causal: mean 1k and 2k
    assert run(bf16, 128, False, 16384, 32) and not run(bf16, 128, False, 16384, 16)    # non-causal: 512 and 1k
    assert run(bf16, 64, False, 16384, 8) and not run(bf16, 64, True, 16384, 4)          # D = 64: mean <= 2k
    assert run(fp16, 128, True, 16384, 16) and run(fp16, 64, True, 16384, 8)           # fp16 as bf16
    assert not run(fp16, 128, False, 16384, 16) and not run(fp16, 64, False, 16384, 4)
    knob.setattr(cutlass, "PERSISTENT", False)
    assert not run(fp8, 128, True, 16384, 32)
    knob.setattr(cutlass, "PERSISTENT", True)
    assert run(fp8, 128, False, 16384, 1) and run(fp16, 64, False, 16384, 1)


def test_automatic_paged_grid_is_persistent_for_d64_cluster_kernels_on_long_chunks(knob):
    bf16, fp16 = torch.bfloat16, torch.float16
    run = cutlass.paged_runs_persistent
    assert run("pagedx2", bf16, 64, 2048, 4) and run("pagedx2", fp16, 64, 4096, 1)       # mean 512 and 4k
    assert not run("pagedx2", bf16, 64, 4096, 16)                                        # 16 x 256: plain
    assert not run("paged", bf16, 64, 8192, 4) and not run("paged16x2", bf16, 128, 8192, 4)
    assert not run("pagedx2", bf16, 128, 8192, 4)                                        # D = 128: plain
    knob.setattr(cutlass, "PERSISTENT", True)
    assert run("paged16", bf16, 128, 16, 16)
    knob.setattr(cutlass, "PERSISTENT", False)
    assert not run("pagedx2", bf16, 64, 8192, 1)


def test_persistent_grid_is_one_cta_per_sm_at_most_one_per_work_tile():
    # S = 8k x 2 sequences, H = 32: (16384 // 128 + 2) * 32 work tiles >> 132 SMs
    assert cutlass.persistent_ctas(16384, 2, 32, 132) == 132
    # 300 query rows in 3 sequences, 2 heads: (300 // 128 + 3) * 2 = 10 work tiles
    assert cutlass.persistent_ctas(300, 3, 2, 132) == 10


@pytest.mark.parametrize("dtype,d,variant,layout", [
    (torch.bfloat16, 128, "plain", cutlass.V_TOKENS), (torch.float16, 64, "persistent", cutlass.V_TOKENS),
    (torch.float8_e4m3fn, 128, "persistent", cutlass.V_TOKENS),   # tiles transposed in shared memory
    (torch.float8_e4m3fn, 128, "plain", cutlass.V_TRANSPOSED_INTERLEAVED),
    (torch.float8_e4m3fn, 256, "plain", cutlass.V_TRANSPOSED),
])
def test_value_layout_follows_the_kernel(kernel_device, dtype, d, variant, layout):
    assert cutlass.value_layout(dtype, d, variant) == layout
    value = torch.randn(37, 2, d, device=kernel_device).to(dtype)
    v, fields = cutlass.value_operand(value, layout)
    assert fields["v_layout"] == layout
    if layout == cutlass.V_TOKENS:
        assert v.data_ptr() == value.data_ptr() and (fields["v_row_stride"], fields["v_head_stride"]) == (2 * d, d)
        return
    tokens = 48 if layout == cutlass.V_TRANSPOSED_INTERLEAVED else 37   # whole groups of 16, zero-padded
    assert v.shape == (2, d, tokens) and fields["v_dim_stride"] == 48 and fields["v_head_stride"] == 48 * d
    order = torch.tensor(transpose_positions(tokens, layout == cutlass.V_TRANSPOSED_INTERLEAVED))
    expected = value.view(torch.uint8)[order.clamp(max=36)].permute(1, 2, 0)
    expected[..., order >= 37] = 0
    assert torch.equal(v.view(torch.uint8), expected)


def transpose_positions(tokens: int, interleaved: bool) -> list[int]:
    """The token at each position along vt's last dim."""
    from torch_ops.kernels.transpose import INTERLEAVE16
    return [p - p % 16 + INTERLEAVE16[p % 16] if interleaved else p for p in range(tokens)]


@pytest.mark.parametrize("hq,hkv,keys,d,size,heads", [
    (32, 32, 8192, 128, 1, 16),     # FP8 8k: 2 MiB of K/V per head, 16 heads in 32 MiB
    (32, 32, 8192, 128, 2, 8),      # bf16: 4 MiB per head
    (32, 8, 8192, 128, 2, 32),      # GQA: 4 query heads share each 4 MiB KV head
    (16, 16, 8192, 256, 1, 8),      # D = 256
    (32, 32, 2048, 128, 1, 32),     # 2k keys: everything fits
    (12, 12, 8192, 128, 2, 6),      # a divisor of hq, not a power of two
    (32, 32, 1 << 20, 256, 2, 1),   # one head's K/V alone exceeds the budget
])
def test_sections_are_the_largest_head_divisor_whose_kv_fits_l2(hq, hkv, keys, d, size, heads):
    section = cutlass.section_heads(hq, hkv, keys, d, size)
    assert section == heads and hq % section == 0


def test_sections_only_for_causal_grids_of_few_waves():
    # 2k causal queries x 32 heads: 16 tiles x 32 = 512 CTAs, under 16 waves of 132
    assert cutlass.sectioned(True, 2048, 32, 132)
    assert not cutlass.sectioned(False, 2048, 32, 132)      # non-causal: head by head
    assert cutlass.sectioned(True, 8448, 32, 132)           # 66 x 32 = 2112 CTAs: 16 waves
    assert not cutlass.sectioned(True, 8576, 32, 132)       # 67 x 32: more


def test_paged_sections_come_from_the_block_table_capacity(monkeypatch):
    """The lengths are on the device: the sections assume every sequence fills its table row."""
    seen = {}
    monkeypatch.setattr(cutlass, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, _, cu_q, lens = _paged_problem_cpu(hq=32, hkv=8, tq=300, seqs=2)
    tables = torch.zeros(2, 2048, dtype=torch.int32)   # 32k keys: 16 MiB of bf16 K/V per KV head

    def section(q=q, **options):
        cutlass.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q),
                          lse=torch.empty(q.shape[:2]), **options)
        return seen["variant"], seen["args"]["section_heads"]

    assert section() == ("paged16x2", cutlass.section_heads(32, 8, 2048 * 16, 128, 2)) == ("paged16x2", 8)   # 2 KV heads
    # one head per section, but a cluster's two CTAs run two heads of one section
    assert section(causal=False) == ("paged16x2", 2)
    assert section(q[:, :24], causal=False) == ("paged16", 1)   # 3 query heads per KV head: no clusters
    monkeypatch.setattr(cutlass, "L2_SECTION_BYTES", 0)   # nothing fits: one head per section
    assert section() == ("paged16x2", 2)


def test_paged_persistent_grid_where_forced_or_chosen(monkeypatch):
    """The paged families run the persistent grid when it is forced (one CTA per SM, in sections of
    heads, even ones for the cluster kernels), or where `paged_runs_persistent` picks it (D = 64), the
    plain one otherwise."""
    seen = {}
    monkeypatch.setattr(cutlass, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(hq=32, hkv=8, tq=300, seqs=2)

    def launch(q=q):
        cutlass.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]))
        return seen["variant"], seen["args"]["num_ctas"], seen["args"]["section_heads"]

    assert launch()[:2] == ("paged16x2", 0)
    monkeypatch.setattr(cutlass, "PERSISTENT", True)
    ctas = cutlass.persistent_ctas(300, 2, 32, 132)
    variant, num_ctas, section = launch()
    assert (variant, num_ctas) == ("paged16x2_persistent", ctas) and section % 2 == 0 and 32 % section == 0
    assert launch(q[:, :24])[:2] == ("paged16_persistent", cutlass.persistent_ctas(300, 2, 24, 132))
    assert "paged16x2_persistent" in cutlass_build.built_variants()
    monkeypatch.setattr(cutlass, "PERSISTENT", None)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(d=64, hq=32, hkv=8, tq=1024, seqs=2)
    assert launch(q)[:2] == ("pagedx2_persistent", cutlass.persistent_ctas(1024, 2, 32, 132))
    assert launch(q[:1000])[:2] == ("pagedx2", 0)   # mean 500 queries


@pytest.mark.parametrize("block_size,d,variant,box_rows", [
    (16, 128, "paged16", 16), (48, 128, "paged16", 16), (8, 128, "paged", 8), (32, 128, "paged", 32),
    (256, 128, "paged", 128), (64, 64, "paged", 64), (8, 64, "paged", 8)])
@pytest.mark.parametrize("layout", ["own", "halves", "padded"])
@pytest.mark.parametrize("hq", [2, 4, 6])
def test_paged_kernel_by_box_rows_head_dim_and_cache_layout(monkeypatch, block_size, d, variant, box_rows, layout, hq):
    """Boxes of up to the key tile's tokens x the whole head dim; at D = 128 the paged16 kernels take
    16-token boxes, and the larger boxes of caches that TMA cannot see as one line of tokens (here
    blocks padded by a token; K and V as halves of one [blocks, 2, block_size, Hkv, D] tensor are one).
    An even number of query heads per KV head takes the family's cluster kernels."""
    seen = {}
    monkeypatch.setattr(cutlass, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q, k_cache, v_cache, tables, cu_q, lens = _paged_problem_cpu(d=d, block_size=block_size, hq=hq, hkv=2)
    if layout == "halves":
        k_cache, v_cache = torch.stack((k_cache, v_cache), dim=1).unbind(1)
    elif layout == "padded":
        k_cache, v_cache = (torch.zeros(c.shape[0], block_size + 1, *c.shape[2:], dtype=c.dtype)[:, :block_size]
                            for c in (k_cache, v_cache))
    cutlass.paged_run(q, k_cache, v_cache, tables, cu_q, lens, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]))
    if layout == "padded" and d == 128 and box_rows > 16:
        variant, box_rows = "paged16", 16
    if hq == 4 and box_rows <= 32:
        variant += "x2"
    assert (seen["variant"], seen["args"]["box_rows"]) == (variant, box_rows)


@pytest.mark.parametrize("check,define", [("paged_layout_check.cu", 1), ("block_boxes_check.cu", 2)])
def test_paged_stage_layouts_match_the_tma_boxes(tmp_path, check, define):
    """Host programs built from the kernel source: every element of every TMA box lands where the K
    and V stage layouts put its key and dim (PagedLayouts), and (BlockBoxes, permuted key orders) the
    masks see each accumulator element's key and step k of the PV product pairs P and V at the same keys."""
    pytest.importorskip("cutlass_library", reason="needs the nvidia-cutlass headers (pip install '.[cutlass]')")
    nvcc = cutlass_build.find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    exe = tmp_path / "check"
    cmd = [nvcc, "-std=c++17", "-O1", f"-gencode=arch=compute_{cutlass_build.ARCH},code=sm_{cutlass_build.ARCH}",
           "--expt-relaxed-constexpr", "-DATTN_ELEMENT_BF16", "-DATTN_HEAD_DIM=128", "-DATTN_PERSISTENT=0",
           f"-DATTN_PAGED={define}", *(f"-I{p}" for p in cutlass_build.cutlass_include_dirs()),
           f"-I{cutlass_build.CSRC}",
           str(Path(__file__).with_name(check)), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(exe)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stdout


def test_context_sections_follow_the_rule_at_the_mean_key_length(monkeypatch):
    """Causal launches of few waves run in sections sized at the mean key length; the rest head by head."""
    seen = {}
    monkeypatch.setattr(cutlass, "_kernel", lambda op, variant, *rest: seen.update(variant=variant, args=rest[-1]) or _no_launch)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    q = torch.randn(4096, 32, 128).to(BF16)       # 2k queries per sequence: the plain grid
    kv = torch.randn(2 * 8192, 32, 128).to(BF16)   # two sequences of 8k keys: 4 MiB of K/V per head
    cu_q, cu_k = torch.tensor([0, 2048, 4096], dtype=torch.int32), torch.tensor([0, 8192, 16384], dtype=torch.int32)

    def section(causal):
        cutlass.run(q, kv, kv, cu_q, cu_k, out=torch.empty_like(q), lse=torch.empty(q.shape[:2]), causal=causal)
        assert seen["variant"] == "plain"
        return seen["args"]["section_heads"]

    assert section(True) == cutlass.section_heads(32, 32, 8192, 128, 2) == 8
    assert section(False) == 1


# ---- registry (CPU) ------------------------------------------------------------------------------


def _problem(device="cpu", *, dtype=BF16, d=128, tq=5, tk=7, hq=4, hkv=2):
    q = torch.randn(tq, hq, d, device=device).to(dtype)
    k = torch.randn(tk, hkv, d, device=device).to(dtype)
    v = torch.randn(tk, hkv, d, device=device).to(dtype)
    cu_q = torch.tensor([0, tq], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, tk], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k


def test_backend_is_chosen_ahead_of_triton_on_cuda():
    for op in ("context_attention", "paged_prefill"):
        names = torch_ops.backends.PRIORITY[op]
        assert names.index("cutlass") < names.index("triton")
    assert cutlass.CutlassBackend.auto_devices == ("cuda",)


def test_cpu_tensors_are_not_served_and_an_explicit_request_says_why():
    problem = _problem()
    assert torch_ops.backend_for("context_attention", *problem) != "cutlass"
    with torch_ops.use_backend("cutlass"), pytest.raises(ValueError, match="cutlass.*need CUDA tensors"):
        torch.ops.attn.context_attention(*problem)
    with torch_ops.use_backend("cutlass"), pytest.raises(ValueError, match="no CUTLASS kernel for attn::merge_states"):
        out = torch.randn(3, 2, 8)
        torch.ops.attn.merge_states(out, torch.randn(3, 2), out, torch.randn(3, 2))


@pytest.mark.parametrize("options,reason", [
    ({"alibi_slopes": torch.ones(4)}, "ALiBi"),
    ({"window_left": 16}, "sliding windows"),
    ({"sink_tokens": 4}, "sink tokens"),
    ({"sinks": torch.zeros(4)}, "learned sinks"),
    ({"softcap": 30.0}, "soft-capping"),
    ({"positions": torch.arange(5), "cos_sin_cache": torch.ones(8, 128)}, "fused RoPE"),
    ({"out_dtype": torch.float32}, "epilogue writes bf16, fp16 or float8_e4m3fn"),
])
def test_unsupported_options_are_named(options, reason):
    q, k, *_ = _problem()
    why = cutlass.problem_reasons(q, k, **options)
    assert len(why) == 1 and reason in why[0]
    assert cutlass.problem_reasons(q, k, out_scale=torch.tensor(1.0)) == []


@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (BF16, 96), (E4M3, 64), (E4M3, 96), (torch.float8_e5m2, 128)])
def test_unsupported_dtypes_and_head_dims_are_named(dtype, d):
    q, k, *_ = _problem(dtype=dtype, d=d)
    (why,) = cutlass.problem_reasons(q, k)
    assert "no CUTLASS kernel for" in why and f"head dim {d}" in why


def test_empty_keys_are_not_served():
    q, k, *_ = _problem(tk=0)
    assert cutlass.problem_reasons(q, k) == ["key is empty (total_k == 0)"]


def _no_launch(*args, **kwargs) -> None:
    """A spied `_kernel`: the tests read what it was prepared with."""


_no_launch.describe = "a spy"


def _paged_problem_cpu(*, dtype=BF16, cache_dtype=None, d=128, block_size=16, hq=4, hkv=2, tq=300, seqs=2):
    q = torch.randn(tq, hq, d).to(dtype)
    k_cache = torch.zeros(8, block_size, hkv, d, dtype=cache_dtype or dtype)
    tables = torch.zeros(seqs, 4, dtype=torch.int32)
    lens = torch.full((seqs,), 40, dtype=torch.int32)
    cu_q = torch.tensor([0, *[tq] * seqs], dtype=torch.int32)
    return q, k_cache, k_cache.clone(), tables, cu_q, lens


def test_paged_prefill_reasons():
    q, k, v, tables, *_ = _paged_problem_cpu()
    assert cutlass.paged_problem_reasons(q, k, v, tables) == []
    assert cutlass.paged_problem_reasons(q, k, v, tables, out_scale=torch.tensor(1.0)) == []

    def reasons(**kw):
        q, k, v, tables, *_ = _paged_problem_cpu(**kw)
        (why,) = cutlass.paged_problem_reasons(q, k, v, tables)
        return why

    assert "no paged CUTLASS kernel for torch.bfloat16 with head dim 256" in reasons(d=256)
    assert "FP8/INT8/INT4 caches run on Triton" in reasons(cache_dtype=E4M3)
    assert "block_size 12 is not a multiple of 8" in reasons(block_size=12)
    assert "ALiBi" in cutlass.paged_problem_reasons(q, k, v, tables, alibi_slopes=torch.ones(4))[0]
    swapped = k.transpose(1, 2).contiguous().transpose(1, 2)   # [blocks, tokens, heads, D], heads outer
    assert "not ordered head <= token <= block" in cutlass.paged_problem_reasons(q, swapped, v, tables)[0]
    padded = torch.zeros(8, 16, 2, 132, dtype=BF16)[..., :128]   # head stride 264 bytes
    assert "16-byte aligned" in cutlass.paged_problem_reasons(q, padded, v, tables)[0]


def test_paged_prefill_goes_to_triton_for_decode_heavy_batches_and_small_blocks(monkeypatch):
    monkeypatch.setattr(cutlass, "library_built", lambda: True)
    backend = cutlass.CutlassBackend()
    prefill = _paged_problem_cpu(tq=300, seqs=2, block_size=16)
    assert backend.auto_declines("paged_prefill", prefill, {}) == []
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=100, seqs=64, block_size=64), {})
    assert "queries per sequence" in why
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8), {}) == []
    # 1 KB boxes: to Triton, but not where a cluster kernel shares each box between two CTAs
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=2), {})
    assert "TMA boxes of 8 tokens (block_size 8) x 64 dims, 1024 bytes for one CTA" in why
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=4), {}) == []
    assert torch_ops.backend_for("paged_prefill", *prefill) != "cutlass"   # CPU tensors


def test_mixed_backend_is_first_and_serves_batches_that_may_hold_a_long_sequence(monkeypatch):
    monkeypatch.setattr(cutlass, "library_built", lambda: True)
    names = torch_ops.backends.PRIORITY["paged_prefill"]
    assert names.index("mixed") < names.index("cutlass") < names.index("triton")
    backend = cutlass.MixedBatchBackend()
    assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=100, seqs=64, block_size=16), {}) == []
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=1), {})
    assert "one sequence" in why
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=64, seqs=8), {})
    assert "no sequence can have more than 64 queries" in why
    (why,) = backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2, block_size=8, d=64, hq=2), {})
    assert "1024 bytes for one CTA" in why
    assert "serves attn::paged_prefill only" in backend.reasons("context_attention", _problem(), {})[0]
    assert any("CUDA" in why for why in backend.reasons("paged_prefill", _paged_problem_cpu(), {}))


# ---- numerics (GPU) ------------------------------------------------------------------------------


def cumsum0(lens, device):
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def fp8_problem(device, q_lens, k_lens, hq, hkv, d, per_head):
    """Quantized packed inputs and their descales: `(q8, k8, v8, cu_q, cu_k), scales`."""
    def scale(heads):
        s = torch.rand(heads, device=device) * 0.01 + 0.02 if per_head else torch.tensor(0.025, device=device)
        return s.float()

    scales = {"q_scale": scale(hq), "k_scale": scale(hkv), "v_scale": scale(hkv)}
    raw = {"q": torch.randn(sum(q_lens), hq, d, device=device) * 4,
           "k": torch.randn(sum(k_lens), hkv, d, device=device) * 4,
           "v": torch.randn(sum(k_lens), hkv, d, device=device) * 4}
    q8, k8, v8 = (quant.quantize_fp8(raw[n], scales[f"{n}_scale"], E4M3) for n in "qkv")
    return (q8, k8, v8, cumsum0(q_lens, device), cumsum0(k_lens, device)), scales


def fp8_p_baseline(problem, *, causal, q_scale, k_scale, v_scale, scale=None):
    """What an FP8 attention does in PyTorch: fp32 logits and softmax, probabilities rounded to
    e4m3 for the product with the e4m3 values of V, the sum taken before rounding, the V descale
    applied last. Returns `out [Tq, Hq, D]` fp32."""
    q8, k8, v8, cu_q, cu_k = problem
    q, k = quant.dequantize_fp8(q8, q_scale, torch.float32), quant.dequantize_fp8(k8, k_scale, torch.float32)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for b in range(len(qs) - 1):
        lq, lk = qs[b + 1] - qs[b], ks[b + 1] - ks[b]
        if lq == 0 or lk == 0:
            continue
        qb = q[qs[b]:qs[b + 1]].transpose(0, 1)
        kb, vb = (x[ks[b]:ks[b + 1]].float().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v8))
        s = qb @ kb.transpose(1, 2) * (scale or q.shape[-1] ** -0.5)
        if causal:
            last = torch.arange(lq, device=q.device)[:, None] + lk - lq
            s = s.masked_fill(torch.arange(lk, device=q.device)[None, :] > last, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True).clamp_min(-1e30))
        o = (p.to(E4M3).float() @ vb) / p.sum(-1, keepdim=True).clamp_min(1e-30)
        out[qs[b]:qs[b + 1]] = o.transpose(0, 1)
    v_scale_per_q_head = v_scale.float().expand(k.shape[1]).repeat_interleave(group)
    return out * v_scale_per_q_head[:, None]


@pytest.fixture(params=[False, True], ids=["plain", "persistent"])
def grid(request, monkeypatch):
    """Runs a GPU test on the plain kernels (one CTA per work tile) and on the persistent ones."""
    monkeypatch.setattr(cutlass, "PERSISTENT", request.param)
    return request.param


def run_cutlass(problem, out_dtype, **options):
    out = torch.empty(problem[0].shape, dtype=out_dtype, device=problem[0].device)
    lse = torch.empty(problem[0].shape[:2], dtype=torch.float32, device=problem[0].device)
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.context_attention.out(*problem, out=out, lse=lse, **options)
    return out, lse


def check(problem, out, lse, baseline_out, **options):
    truth_o, truth_l = reference.context_attention(*problem, compute_dtype=torch.float64, **options)
    low = BF16 if problem[0].dtype == E4M3 else problem[0].dtype   # the Triton FP8 tests' lse baseline too
    _, base_l = reference.context_attention(*problem, compute_dtype=low, **options)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    assert_error_ratio(out, truth_o, baseline_out)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = torch.isinf(truth_l)
    assert (out.float()[empty] == 0).all() and (lse[empty] == float("-inf")).all(), "rows with no key: 0 and -inf"


# ragged batches: an empty sequence, queries without keys, fewer keys than queries (causal rows
# that see nothing), lengths off the 128-row / key-tile grid, one long sequence, and key starts
# off the 16-key grid (FP8 V is read transposed, where TMA needs 16-byte aligned box starts)
RAGGED = [([300, 0, 17, 129, 64], [300, 0, 700, 129, 0]), ([1000], [1000]), ([5, 200], [3, 1024]),
          ([1, 3, 40], [301, 7, 290])]


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (256, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("lens", RAGGED, ids=["ragged", "single", "short-q", "key-offsets"])
def test_fp8_context_attention(d, hq, hkv, causal, per_head, lens):
    problem, scales = fp8_problem("cuda", *lens, hq, hkv, d, per_head)
    assert cutlass.unsupported(*problem, causal=causal, **scales) == []
    out, lse = run_cutlass(problem, BF16, causal=causal, **scales)
    check(problem, out, lse, fp8_p_baseline(problem, causal=causal, **scales), causal=causal, **scales)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (FP16, 64), (BF16, 128), (FP16, 128), (BF16, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", RAGGED, ids=["ragged", "single", "short-q", "key-offsets"])
def test_16bit_context_attention(dtype, d, causal, lens):
    q_lens, k_lens = lens
    problem = (torch.randn(sum(q_lens), 8, d, device="cuda", dtype=dtype),
               torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
               torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
               cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
    out, lse = run_cutlass(problem, dtype, causal=causal, scale=0.1, q_scaling=1.5)
    baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal, scale=0.1, q_scaling=1.5)
    check(problem, out, lse, baseline, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,causal", [(E4M3, 128, False), (E4M3, 128, True), (BF16, 128, False), (BF16, 128, True),
                                           (BF16, 64, False), (BF16, 64, True), (FP16, 128, True), (FP16, 64, False)])
def test_automatic_grid_runs_short_batches_on_the_default_librarys_persistent_kernels(monkeypatch, dtype, d, causal):
    monkeypatch.setattr(cutlass, "PERSISTENT", None)
    monkeypatch.delenv("ATTN_CUTLASS_PERSISTENT", raising=False)
    q_lens, k_lens = RAGGED[0]
    if dtype == E4M3:
        problem, scales = fp8_problem("cuda", q_lens, k_lens, 8, 2, d, True)
        baseline = fp8_p_baseline(problem, causal=causal, **scales)
    else:
        problem, scales = (torch.randn(sum(q_lens), 8, d, device="cuda", dtype=dtype),
                           torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
                           torch.randn(sum(k_lens), 2, d, device="cuda", dtype=dtype),
                           cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda")), {}
        baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal)
    assert cutlass.runs_persistent(dtype, d, causal, sum(q_lens), len(q_lens))
    out, lse = run_cutlass(problem, BF16 if dtype == E4M3 else dtype, causal=causal, **scales)
    check(problem, out, lse, baseline, causal=causal, **scales)


def many_sequences(count, long_every, rng):
    """`count` lengths, mostly 0-40 with one of 129-400 every `long_every`: a tile search over more
    than 128 sequences takes two rounds of reads."""
    return [rng.randint(129, 400) if i % long_every == 0 else rng.randint(0, 40) for i in range(count)]


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("causal", [False, True])
def test_context_attention_over_many_sequences(causal):
    rng = random.Random(0)
    q_lens = many_sequences(700, 50, rng)
    k_lens = [q + rng.randint(0, 30) for q in q_lens]
    problem = (torch.randn(sum(q_lens), 8, 128, device="cuda", dtype=BF16),
               torch.randn(sum(k_lens), 2, 128, device="cuda", dtype=BF16),
               torch.randn(sum(k_lens), 2, 128, device="cuda", dtype=BF16),
               cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
    out, lse = run_cutlass(problem, BF16, causal=causal)
    baseline, _ = reference.context_attention(*problem, compute_dtype=BF16, causal=causal)
    check(problem, out, lse, baseline, causal=causal)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
def test_fp8_output_scale():
    problem, scales = fp8_problem("cuda", [200, 77], [300, 77], 8, 8, 128, per_head=True)
    out_scale = torch.tensor(0.05, device="cuda")
    out, lse = run_cutlass(problem, E4M3, causal=True, out_scale=out_scale, **scales)
    truth, _ = reference.context_attention(*problem, causal=True, compute_dtype=torch.float64, **scales)
    t = (truth / 0.05).clamp(-448, 448)
    base = fp8_p_baseline(problem, causal=True, **scales).double() / 0.05
    floor = 2 * (t.to(E4M3).double() - t).abs().max().item()
    assert_error_ratio(out.double(), t, base, floor=floor, name="fp8 out")


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
@pytest.mark.parametrize("pad", [64, 4], ids=["aligned", "misaligned"])
def test_strided_inputs_and_outputs(pad):
    """q/k/v as views of one fused qkv tensor, and an out buffer with a padded head stride (a
    16-byte multiple or not: the epilogue's 16-byte stores then go through a contiguous buffer)."""
    t, h, d = 333, 4, 128
    qkv = torch.randn(t, 3 * h, d, device="cuda", dtype=BF16)
    problem = (qkv[:, :h], qkv[:, h:2 * h], qkv[:, 2 * h:], cumsum0([100, 233], "cuda"), cumsum0([100, 233], "cuda"))
    out = poison_(torch.empty(t, h, d + pad, device="cuda", dtype=BF16))[..., :d]
    lse = poison_(torch.empty(t, h, device="cuda"))
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.context_attention.out(*problem, out=out, lse=lse, causal=True)
    baseline, _ = reference.context_attention(*problem, compute_dtype=BF16, causal=True)
    check(problem, out, lse, baseline, causal=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("grid")
def test_cuda_graph_replay_follows_new_lengths():
    """Lengths live in device tensors: a captured graph replays new batches without recapture."""
    d, hq, hkv, cap = 128, 8, 2, 1024
    problem, scales = fp8_problem("cuda", [cap // 2, cap // 2], [cap // 2, cap // 2], hq, hkv, d, per_head=True)
    q8, k8, v8, cu_q, cu_k = problem
    out = torch.empty(cap, hq, d, device="cuda", dtype=BF16)
    lse = torch.empty(cap, hq, device="cuda")

    def call():
        with torch_ops.use_backend("cutlass"):
            torch.ops.attn.context_attention.out(q8, k8, v8, cu_q, cu_k, out=out, lse=lse, causal=True, **scales)

    def fill(step):
        new, _ = fp8_problem("cuda", [cap // 2, cap // 2], [cap // 2, cap // 2], hq, hkv, d, per_head=True)
        for dst, src in zip((q8, k8, v8), new[:3]):
            dst.copy_(src)
        split = [cap // 2, 100, 300, 1000][step]
        cu_q.copy_(cumsum0([split, cap - split], "cuda"))
        cu_k.copy_(cu_q)

    def verify(o, l):
        check(problem, o, l, fp8_p_baseline(problem, causal=True, **scales), causal=True, **scales)

    assert_replays_match_eager(call, fill, [out, lse], verify)


@pytest.mark.gpu
@pytest.mark.parametrize("num_ctas,section_heads", [(1, 1), (7, 2), (64, 8)])
@pytest.mark.parametrize("dtype,d", [(E4M3, 128), (BF16, 64), (BF16, 128), (E4M3, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_ctas_loop_over_many_tiles(monkeypatch, num_ctas, section_heads, dtype, d, causal):
    """Few CTAs, each running many work tiles in turn (one CTA: all of them): the pipelines carry
    their state from tile to tile, spare tiles are skipped, every row of every head is written."""
    monkeypatch.setattr(cutlass, "PERSISTENT", True)
    monkeypatch.setattr(cutlass, "persistent_ctas", lambda *shape: num_ctas)
    monkeypatch.setattr(cutlass, "section_heads", lambda *shape: section_heads)
    q_lens, k_lens = [300, 0, 17, 129, 64, 1000, 255], [300, 0, 700, 129, 0, 1000, 601]
    hq, hkv = 8, 2
    if dtype == E4M3:
        problem, scales = fp8_problem("cuda", q_lens, k_lens, hq, hkv, d, per_head=True)
        baseline = fp8_p_baseline(problem, causal=causal, **scales)
    else:
        problem = (torch.randn(sum(q_lens), hq, d, device="cuda", dtype=dtype),
                   torch.randn(sum(k_lens), hkv, d, device="cuda", dtype=dtype),
                   torch.randn(sum(k_lens), hkv, d, device="cuda", dtype=dtype),
                   cumsum0(q_lens, "cuda"), cumsum0(k_lens, "cuda"))
        scales = {}
        baseline, _ = reference.context_attention(*problem, compute_dtype=dtype, causal=causal)
    out, lse = run_cutlass(problem, BF16, causal=causal, **scales)
    check(problem, out, lse, baseline, causal=causal, **scales)



# ---- paged_prefill (GPU) -------------------------------------------------------------------------


def paged_problem(q_lens, k_lens, *, dtype, d, hq, hkv, block_size):
    """`(query, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)` with shuffled blocks; every
    cache slot past a sequence's end, and the spare blocks its table points at there, hold NaN."""
    per_seq = [-(-k // block_size) for k in k_lens]
    num_blocks = sum(per_seq) + 2
    k_cache, v_cache = (torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device="cuda")
                        for _ in range(2))
    order = torch.randperm(num_blocks - 1).tolist()
    tables = torch.full((len(k_lens), max(per_seq + [1]) + 1), num_blocks - 1, dtype=torch.int32)
    for b, (k_len, n) in enumerate(zip(k_lens, per_seq)):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        for cache in (k_cache, v_cache):
            keys = torch.randn(k_len, hkv, d, dtype=dtype, device="cuda")
            slots = torch.arange(k_len)
            cache[tables[b, slots // block_size].long(), slots % block_size] = keys
    query = torch.randn(sum(q_lens), hq, d, dtype=dtype, device="cuda")
    return query, k_cache, v_cache, tables.cuda(), cumsum0(q_lens, "cuda"), torch.tensor(k_lens, device="cuda")


def run_paged(problem, backend="cutlass", **options):
    query = problem[0]
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], dtype=torch.float32, device="cuda")
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend(backend):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse, **options)
    return out, lse


def check_paged(problem, out, lse, **options):
    truth_o, truth_l = reference.paged_prefill(*problem, compute_dtype=torch.float64, **options)
    base_o, base_l = reference.paged_prefill(*problem, compute_dtype=problem[0].dtype, **options)
    assert not torch.isnan(out.float()).any() and not torch.isnan(lse).any(), "unwritten or NaN output"
    assert_error_ratio(out, truth_o, base_o)
    assert_error_ratio(lse, truth_l, base_l, name="lse")
    empty = torch.isinf(truth_l)
    assert (out.float()[empty] == 0).all() and (lse[empty] == float("-inf")).all(), "rows with no key: 0 and -inf"


# (q_lens, k_lens): chunks over cached prefixes of every length mod 8, an empty chunk, a sequence
# without keys, more queries than keys, and one sequence across many key tiles
PAGED_LENS = [([300, 0, 17, 129, 64, 5], [700, 40, 17, 1000, 0, 3]), ([1000], [1000]), ([77, 128], [1281, 1155])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (BF16, 128), (FP16, 128)])
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", PAGED_LENS, ids=["ragged", "single", "chunks"])
def test_paged_prefill(dtype, d, block_size, causal, lens):
    problem = paged_problem(*lens, dtype=dtype, d=d, hq=8, hkv=2, block_size=block_size)
    assert cutlass.paged_unsupported(*problem, causal=causal) == []
    out, lse = run_paged(problem, causal=causal, scale=0.1, q_scaling=1.5)
    check_paged(problem, out, lse, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_d64_long_chunks_on_the_automatic_persistent_grid(block_size, causal):
    q_lens, k_lens = [600, 0, 1500, 513], [900, 7, 1500, 2000]
    problem = paged_problem(q_lens, k_lens, dtype=BF16, d=64, hq=8, hkv=2, block_size=block_size)
    assert cutlass.paged_runs_persistent("pagedx2", BF16, 64, sum(q_lens), len(q_lens))
    out, lse = run_paged(problem, causal=causal)
    check_paged(problem, out, lse, causal=causal)


# (q_len, seq_len): decodes and short chunks (the Triton kernel's launches) around chunks of more than
# 64 queries (CUTLASS), 64 and 65 queries on either side of the split, an empty sequence, and more
# queries than keys
MIXED_SEQS = [(1, 900), (300, 700), (64, 64), (1, 33), (65, 1000), (0, 5), (3, 3), (129, 200), (17, 400),
              (1, 1), (70, 40), (2, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hq,hkv", [(BF16, 128, 8, 2), (FP16, 64, 8, 8), (BF16, 128, 32, 4)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_backend(csrc_libraries, dtype, d, hq, hkv, block_size, causal):
    seqs = random.sample(MIXED_SEQS, len(MIXED_SEQS))
    problem = paged_problem([q for q, _ in seqs], [k for _, k in seqs], dtype=dtype, d=d, hq=hq, hkv=hkv,
                            block_size=block_size)
    assert torch_ops.backend_for("paged_prefill", *problem, causal=causal) == "mixed"
    out, lse = run_paged(problem, "mixed", causal=causal, scale=0.1, q_scaling=1.5)
    check_paged(problem, out, lse, causal=causal, scale=0.1, q_scaling=1.5)


@pytest.mark.gpu
def test_mixed_backend_over_many_sequences():
    rng = random.Random(1)
    q_lens = [q if q > 40 else rng.choice([1, 1, 2, q]) for q in many_sequences(300, 40, rng)]
    k_lens = [q + rng.randint(0, 600) for q in q_lens]
    problem = paged_problem(q_lens, k_lens, dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    out, lse = run_paged(problem, "mixed")
    check_paged(problem, out, lse)


@pytest.mark.gpu
def test_mixed_backend_misaligned_out():
    """The CUTLASS part writes through a contiguous buffer (garbage in the other rows), the Triton part after it."""
    problem = paged_problem([1, 200, 5, 77], [300, 500, 5, 400], dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    query = problem[0]
    out = poison_(torch.empty(query.numel() + 1, dtype=BF16, device="cuda"))[1:].view(query.shape)
    lse = poison_(torch.empty(query.shape[:2], device="cuda"))
    with torch_ops.use_backend("mixed"):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse)
    check_paged(problem, out, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d,block_size,layout,kernel", [
    (128, 32, "halves", ("paged", 32)), (64, 16, "halves", ("paged", 16)), (128, 32, "padded", ("paged16", 16)),
    (128, 8, "padded", ("paged", 8)), (64, 16, "padded", ("paged", 16)), (64, 16, "k_padded", ("paged", 16))])
@pytest.mark.parametrize("hkv", [8, 2])
def test_paged_prefill_fp8_output_and_strided_cache(d, block_size, layout, kernel, hkv):
    """FP8 output through out_scale; K and V as the halves of one [blocks, 2, block, Hkv, D] tensor, or
    in blocks padded by a token (at D = 128 TMA cannot see them as one line of 8-token groups), or K
    alone padded (no line: K's and V's blocks lie differently); MHA and 4 query heads per KV head (the
    cluster kernels)."""
    problem = paged_problem([200, 77], [500, 77], dtype=BF16, d=d, hq=8, hkv=hkv, block_size=block_size)
    if layout == "halves":
        kv = torch.stack(problem[1:3], dim=1)
        problem = (problem[0], kv[:, 0], kv[:, 1], *problem[3:])
    else:
        def pad(cache):
            padded = torch.full((cache.shape[0], block_size + 1, *cache.shape[2:]), float("nan"), dtype=BF16,
                                device="cuda")
            padded[:, :block_size] = cache
            return padded[:, :block_size]
        k, v = problem[1:3]
        problem = (problem[0], pad(k), pad(v) if layout == "padded" else v, *problem[3:])
    assert cutlass.paged_kernel(*problem[1:3], 8 // hkv) == (kernel[0] + ("x2" if hkv == 2 else ""), kernel[1])
    out_scale = torch.tensor(0.02, device="cuda")
    out = torch.empty(problem[0].shape, dtype=E4M3, device="cuda")
    lse = torch.empty(problem[0].shape[:2], device="cuda")
    poison_(out)
    poison_(lse)
    with torch_ops.use_backend("cutlass"):
        torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse, out_scale=out_scale)
    truth, _ = reference.paged_prefill(*problem, compute_dtype=torch.float64)
    base, _ = reference.paged_prefill(*problem, compute_dtype=BF16)
    t = (truth / 0.02).clamp(-448, 448)
    floor = 2 * (t.to(E4M3).double() - t).abs().max().item()
    assert_error_ratio(out.double(), t, base.double() / 0.02, floor=floor, name="fp8 out")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,q_lens,k_lens", [
    ("cutlass", [[256, 256], [100, 412], [300, 212], [511, 1]],
     [[2048, 2048], [700, 1999], [2048, 301], [1024, 555]]),
    # sequences moving across the mixed backend's 64-query split
    ("mixed", [[1, 300, 100, 111], [200, 1, 1, 310], [64, 65, 250, 133], [512, 0, 0, 0]],
     [[700, 300, 900, 333], [700, 1, 900, 333], [700, 65, 900, 333], [700, 1, 900, 333]]),
])
def test_paged_prefill_cuda_graph_replay_follows_new_tables_and_lengths(backend, q_lens, k_lens):
    cap = max(map(max, k_lens))
    problem = paged_problem(q_lens[0], [cap] * len(q_lens[0]), dtype=BF16, d=128, hq=8, hkv=2, block_size=16)
    query, k_cache, v_cache, tables, cu_q, lens = problem
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device="cuda")
    blocks = -(-cap // 16)

    def call():
        with torch_ops.use_backend(backend):
            torch.ops.attn.paged_prefill.out(*problem, out=out, lse=lse)

    def fill(step):
        query.normal_()
        tables[:, :blocks].copy_(tables[:, :blocks].flip(0) if step % 2 else tables[:, :blocks])
        cu_q.copy_(cumsum0(q_lens[step], "cuda"))
        lens.copy_(torch.tensor(k_lens[step], device="cuda"))

    assert_replays_match_eager(call, fill, [out, lse], lambda o, l: check_paged(problem, o, l))



def test_the_automatic_choice_builds_nothing(monkeypatch):
    """An unbuilt library is passed over, with the way to build it; an explicit request builds it."""
    monkeypatch.setattr(cutlass, "library_built", lambda: False)
    for backend in (cutlass.CutlassBackend(), cutlass.MixedBatchBackend()):
        assert backend.auto_declines("paged_prefill", _paged_problem_cpu(tq=300, seqs=2), {}) == [cutlass.NOT_BUILT]
    assert "torch_ops.warmup()" in cutlass.NOT_BUILT
