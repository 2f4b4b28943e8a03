"""Building the `cutlass` backend's library (torch_ops/kernels/cuda/fmha_sm90_build.py, csrc/fmha_sm90.cu), on
the CPU: build-command construction, the instantiations built, the C ABI mirror, the build key,
the entry points' names and the JIT cache.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import re
import subprocess
from pathlib import Path

import pytest

from torch_ops import csrc_build
from torch_ops.csrc_build import sources_with_headers
from torch_ops.kernels.cuda import fmha_sm90, fmha_sm90_build

HEADER = fmha_sm90_build.CSRC / "fmha_sm90.h"


def fmha_source() -> str:
    """csrc/fmha_sm90.cu and the csrc headers it includes, as one text."""
    return "".join((fmha_sm90_build.CSRC / name).read_text()
                   for name in sources_with_headers(("fmha_sm90.cu",), fmha_sm90_build.CSRC))


def test_compile_command_targets_sm90a_and_selects_the_instantiation(tmp_path):
    cmd = fmha_sm90_build.compile_command("/opt/nvcc", "e4m3", 256, tmp_path / "x.o", [Path("/inc/a"), Path("/inc/b")],
                                        ("X=1",))
    assert cmd[0] == "/opt/nvcc"
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert {"-DATTN_ELEMENT_E4M3", "-DATTN_HEAD_DIM=256", "-DATTN_PERSISTENT=0", "-DX=1", "-I/inc/a", "-I/inc/b",
            f"-I{fmha_sm90_build.CSRC}"} <= set(cmd)
    assert cmd[-4:] == ["-c", str(fmha_sm90_build.CSRC / "fmha_sm90.cu"), "-o", str(tmp_path / "x.o")]
    assert "-DATTN_PAGED=0" in cmd
    persistent = fmha_sm90_build.compile_command("/opt/nvcc", "e4m3", 256, tmp_path / "x.o", [], variant="persistent")
    assert "-DATTN_PERSISTENT=1" in persistent and "-DATTN_PERSISTENT=0" not in persistent
    paged = fmha_sm90_build.compile_command("/opt/nvcc", "bf16", 128, tmp_path / "x.o", [], variant="paged")
    assert {"-DATTN_PAGED=1", "-DATTN_PERSISTENT=0"} <= set(paged)
    paged16 = fmha_sm90_build.compile_command("/opt/nvcc", "bf16", 128, tmp_path / "x.o", [], variant="paged16")
    assert {"-DATTN_PAGED=2", "-DATTN_PERSISTENT=0"} <= set(paged16)
    link = fmha_sm90_build.link_command("/opt/nvcc", [tmp_path / "a.o", tmp_path / "b.o"], tmp_path / "lib.so")
    assert "-shared" in link and "-cudart=static" in link and link[-2:] == ["-o", str(tmp_path / "lib.so")]


@pytest.mark.parametrize("persistent", [None, True])
def test_build_compiles_every_instantiation_in_the_chosen_grids_and_links_them(monkeypatch, tmp_path, persistent):
    """The plain and paged kernels (paged16: D = 128), alone and in clusters, always; the persistent
    ones of PERSISTENT_SHORT and PAGED_PERSISTENT_KERNELS, or all of them, the paged ones too, when the
    persistent grid is forced on."""
    monkeypatch.setattr(fmha_sm90, "PERSISTENT", persistent)
    commands = []

    def fake_tool(cmd):
        commands.append(cmd)
        Path(cmd[-1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fmha_sm90_build, "_run_tool", fake_tool)
    monkeypatch.setattr(fmha_sm90_build, "cutlass_include_dirs", lambda: [Path("/inc")])
    library = fmha_sm90_build.build(tmp_path / "out" / "lib.so", nvcc="/opt/nvcc", jobs=1)
    *compiles, link = commands
    defines = {tuple(a for a in c if a.startswith(("-DATTN_ELEMENT", "-DATTN_HEAD_DIM", "-DATTN_PERSISTENT",
                                                   "-DATTN_PAGED", "-DATTN_CLUSTER")))
               for c in compiles}
    short = {key: fmha_sm90.KERNELS[key] for key in fmha_sm90.PERSISTENT_SHORT}
    paged16 = {key: e for key, e in fmha_sm90.PAGED_KERNELS.items() if key[1] == 128}
    paged = {(1, 1): fmha_sm90.PAGED_KERNELS, (2, 1): paged16, (1, 2): fmha_sm90.PAGED_KERNELS, (2, 2): paged16}
    grids = {(0, 0, 1): fmha_sm90.KERNELS, (1, 0, 1): fmha_sm90.KERNELS if persistent else short,
             **{(0, g, c): kernels for (g, c), kernels in paged.items()},
             **({(1, g, c): kernels for (g, c), kernels in paged.items()} if persistent
                else {(1, 1, 2): fmha_sm90.PAGED_PERSISTENT_KERNELS})}
    expected = {(f"-DATTN_ELEMENT_{e.upper()}", f"-DATTN_HEAD_DIM={d}", f"-DATTN_PERSISTENT={p}", f"-DATTN_PAGED={g}",
                 f"-DATTN_CLUSTER={c}") for (p, g, c), kernels in grids.items() for (_, d), e in kernels.items()}
    assert defines == expected and len(compiles) == len(expected) == (40 if persistent else 27)
    objects = [c[-1] for c in compiles]
    assert len(set(objects)) == len(objects) and set(objects) <= set(link)
    assert library.exists()


def test_every_shipped_element_is_defined_in_the_source():
    source = fmha_source()
    for element in set(fmha_sm90.KERNELS.values()):
        assert f"defined(ATTN_ELEMENT_{element.upper()})" in source
    assert {d for _, d in fmha_sm90.KERNELS} <= {int(d) for d in re.findall(r"kHeadDim == (\d+)", source)}


def test_ctypes_struct_mirrors_the_c_header():
    body = re.search(r"typedef struct \{(.*?)\} AttnFmhaArgs;", HEADER.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    scalars = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        base, pointer, names = re.match(r"(?:const\s+)?(\w+)\s*(\*?)\s*(.*)", decl).groups()
        ctype = ctypes.c_void_p if pointer else scalars[base]
        fields += [(n.strip(), ctype) for n in names.split(",")]
    assert fmha_sm90_build.FmhaArgs._fields_ == fields


def test_build_key_follows_sources_flags_and_toolchain(monkeypatch):
    monkeypatch.setattr(fmha_sm90_build, "_cutlass_version", lambda: "4.2.0")
    monkeypatch.setattr(csrc_build, "nvcc_version", lambda nvcc: "release 13.0")
    key = fmha_sm90_build.build_key("nvcc")
    assert key == fmha_sm90_build.build_key("nvcc")
    assert key != fmha_sm90_build.build_key("nvcc", ("ATTN_SOMETHING=1",))
    monkeypatch.setattr(csrc_build, "nvcc_version", lambda nvcc: "release 13.1")
    assert key != fmha_sm90_build.build_key("nvcc")


def test_entry_points_in_the_source_match_the_names_python_looks_up():
    source = fmha_source()
    assert "attn_fmha_sm90_##a##_d##b##c##d##e" in source

    def defined(macro):
        return {line.split()[2] if len(line.split()) > 2 else "" for line in source.splitlines()
                if line.startswith(f"#define {macro}")}
    # the entry's suffix: family, cluster, grid
    suffixes = {f + c + g for f in defined("ATTN_FAMILY") for c in defined("ATTN_CLUSTERED") for g in defined("ATTN_GRID")}
    families = {suffix.removesuffix("_persistent").removesuffix("x2") for suffix in fmha_sm90_build.VARIANTS.values()}
    assert families == defined("ATTN_FAMILY")
    assert set(fmha_sm90_build.VARIANTS.values()) <= suffixes
    assert fmha_sm90_build.VARIANTS["plain"] == ""
    assert re.search(rf"Shape<_128, _{fmha_sm90.PAGED_KEY_TILE}, _128>", source)  # the paged kernels' key tile
    # the host sizes the persistent grid with BLOCK_M query rows per work tile: every tile shape's M
    tile_shapes = source[source.index("using TileShape = "):source.index("#endif", source.index("using TileShape = "))]
    assert set(re.findall(r"Shape<_(\d+), ", tile_shapes)) == {str(fmha_sm90.BLOCK_M)}


def test_jit_builds_once_into_the_cache_and_logs(monkeypatch, tmp_path, caplog):
    builds = []

    def fake_build(target, nvcc, variants):
        builds.append(target)
        target.parent.mkdir(parents=True)
        target.write_bytes(b"\0" * 1000)
        return target

    monkeypatch.setattr(fmha_sm90_build, "LIBRARY", dataclasses.replace(fmha_sm90_build.LIBRARY, prebuilt=tmp_path / "missing.so",
                                                                      requirement=lambda: None))   # the fake build needs no headers
    monkeypatch.setenv("ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(csrc_build, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(fmha_sm90_build, "build_key", lambda nvcc, variants: "abc123")
    monkeypatch.setattr(fmha_sm90_build, "build", fake_build)
    with caplog.at_level(logging.WARNING, logger="torch_ops.kernels.cuda.fmha_sm90_build"):
        first = fmha_sm90_build.library_path()
        second = fmha_sm90_build.library_path()
    assert first == second == tmp_path / "cache" / "fmha_sm90-abc123" / fmha_sm90_build.LIBRARY_NAME
    assert builds == [first]
    assert any("compiling the CUTLASS FMHA kernels" in r.message for r in caplog.records)
    assert any(re.search(r"built .* in \d+ s", r.message) for r in caplog.records)


def test_without_nvcc_or_prebuilt_the_reason_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(fmha_sm90_build, "LIBRARY", dataclasses.replace(fmha_sm90_build.LIBRARY, prebuilt=tmp_path / "missing.so"))
    monkeypatch.setattr(csrc_build, "find_nvcc", lambda: None)
    fmha_sm90_build.build_unavailable.cache_clear()
    try:
        assert "no nvcc" in fmha_sm90_build.build_unavailable()
        with pytest.raises(RuntimeError, match="no nvcc"):
            fmha_sm90_build.library_path()
    finally:
        fmha_sm90_build.build_unavailable.cache_clear()
