"""Install hook for the CUDA code in csrc/ (the rest of the package is declared in pyproject.toml).

With `ATTN_BUILD_CUDA=1`, the CUTLASS kernels are compiled at install into
`torch_ops/_fmha_sm90.so` (needs nvcc, torch and nvidia-cutlass in the build environment:
`ATTN_BUILD_CUDA=1 pip install --no-build-isolation -e ".[cutlass]"`). Without it nothing is
compiled, and the kernels are built on first use instead (torch_ops/cutlass.py).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        if os.environ.get("ATTN_BUILD_CUDA") != "1":
            return
        # loaded by path: importing the torch_ops package would register its ops during the build
        spec = importlib.util.spec_from_file_location("attn_cutlass_build", ROOT / "torch_ops" / "cutlass.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        package_dir = ROOT / "torch_ops" if getattr(self, "editable_mode", False) else Path(self.build_lib) / "torch_ops"
        module.build(package_dir / module.PREBUILT.name)


setup(cmdclass={"build_py": BuildPyWithCuda})
