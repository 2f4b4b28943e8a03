"""Install hook for the CUDA code in csrc/ (the rest of the package is declared in pyproject.toml).

With `ATTN_BUILD_CUDA=1`, the CUTLASS kernels are compiled at install into
`torch_ops/_fmha_sm90.so` and the CUDA decode kernel into `torch_ops/_decode_sm90.so` (needs
nvcc, torch and nvidia-cutlass in the build environment:
`ATTN_BUILD_CUDA=1 python -m pip install --no-build-isolation -e ".[cutlass]"`). Without it nothing is
compiled, and the kernels are built on first use instead (torch_ops/kernels/cuda/fmha_sm90_build.py,
torch_ops/kernels/cuda/decode_sm90.py).
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        if os.environ.get("ATTN_BUILD_CUDA") != "1":
            return
        # the build modules come from a stand-in package over torch_ops/: importing torch_ops itself
        # would register its ops during the build
        package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("attn_build", None, is_package=True))
        package.__path__ = [str(ROOT / "torch_ops")]
        sys.modules["attn_build"] = package
        package_dir = ROOT / "torch_ops" if getattr(self, "editable_mode", False) else Path(self.build_lib) / "torch_ops"
        for name in ("kernels.cuda.fmha_sm90_build", "kernels.cuda.decode_sm90"):
            module = importlib.import_module(f"attn_build.{name}")
            module.build(package_dir / module.PREBUILT.name)


setup(cmdclass={"build_py": BuildPyWithCuda})
