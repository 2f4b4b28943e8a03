"""The csrc build helpers shared by the CUDA libraries (torch_ops/csrc_build.py), on the CPU: which
files a build reads and the cache key they give."""

from __future__ import annotations

import shutil

import pytest

from torch_ops import csrc_build
from torch_ops.csrc_build import sources_with_headers
from torch_ops.kernels.cuda import decode_sm90, fmha_sm90_build


def test_sources_with_headers_follows_local_includes_through_headers(tmp_path):
    (tmp_path / "a.cu").write_text('#include <cuda.h>\n#include "cute/tensor.hpp"\n'
                                   '#include "a.h"\n  #  include "b.cuh"\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "c.cuh"  // c\n')
    (tmp_path / "b.cuh").write_text('#include "a.h"\n#include "b.cuh"\n')
    (tmp_path / "c.cuh").write_text("")
    (tmp_path / "unused.cuh").write_text("")
    assert sources_with_headers(("a.cu",), tmp_path) == ["a.cu", "a.h", "b.cuh", "c.cuh"]


@pytest.mark.parametrize("library,headers", [(decode_sm90, "decode_sm90_*.cuh"), (fmha_sm90_build, "fmha_sm90_*.cuh")],
                         ids=["decode_sm90", "fmha_sm90"])
def test_build_key_follows_every_header_the_source_includes(monkeypatch, tmp_path, library, headers):
    monkeypatch.setattr(csrc_build, "nvcc_version", lambda nvcc: "release 13.0")
    monkeypatch.setattr(fmha_sm90_build, "_cutlass_version", lambda: "4.2.0")
    csrc = tmp_path / "csrc"
    shutil.copytree(csrc_build.CSRC, csrc)
    monkeypatch.setattr(library, "CSRC", csrc)
    included = sources_with_headers(library.SOURCES, csrc)[len(library.SOURCES):]
    assert set(included) == {p.name for p in csrc.glob(headers)}
    for header in included:
        key = library.build_key("nvcc")
        with open(csrc / header, "a") as f:
            f.write("\n")
        assert library.build_key("nvcc") != key, header
