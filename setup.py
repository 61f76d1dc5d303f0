"""Build script for graphtrees' C++ extension, graphtrees._C.

Environment switches (read once, printed at build time):
  USE_CUDA=0        build the CPU-only extension even with a CUDA build of torch
  FORCE_CUDA=1      build the CUDA backend even if torch or nvcc look CUDA-less
  DEBUG=1           -O0 -g
  MAX_JOBS=N        parallel compile jobs (ninja)
"""

import glob
import os
import re
import shutil

from setuptools import find_packages, setup


def _find_cuda_home():
    """torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script outside the
    toolkit (e.g. /usr/local/bin/nvcc): prefer a directory that really holds the toolkit."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = c
            return


_find_cuda_home()

import torch  # noqa: E402 - after CUDA_HOME is set
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(ROOT, "graphtrees", "_version.py")) as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)
# The torch this build compiles against, written into the package: graphtrees._ext refuses to load
# the extension under another torch (its C++ ABI and headers are that torch's), and a wheel's
# metadata pins it (install_requires below).
BUILT_WITH = os.path.join(ROOT, "graphtrees", "_built_with.py")
_built_with = (
    '"""Written by setup.py: the torch graphtrees._C was compiled against."""\n\n'
    f"TORCH = {torch.__version__!r}\n"
)
if not os.path.exists(BUILT_WITH) or open(BUILT_WITH).read() != _built_with:
    with open(BUILT_WITH, "w") as f:
        f.write(_built_with)
TORCH_PIN = torch.__version__.split("+")[0]
USE_CUDA = os.environ.get("USE_CUDA", "1") != "0"
FORCE_CUDA = os.environ.get("FORCE_CUDA", "0") == "1"
DEBUG = os.environ.get("DEBUG", "0") == "1"


class IncrementalBuildExtension(BuildExtension):
    """Builds in one persistent folder per torch and Python (build/temp-torch<version>-py<ver>),
    also under `pip install -e .`, which would otherwise compile every file again in a fresh
    temporary folder: ninja then rebuilds only what changed. GRAPHTREES_BUILD_TEMP overrides it."""

    def finalize_options(self):
        super().finalize_options()
        import sys

        self.build_temp = os.environ.get("GRAPHTREES_BUILD_TEMP") or os.path.join(
            ROOT,
            "build",
            f"temp-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}",
        )


def get_extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    with_cuda = FORCE_CUDA or (
        USE_CUDA and torch.version.cuda is not None and CUDA_HOME is not None
    )
    cxx = ["-O0", "-g"] if DEBUG else ["-O2"]
    cxx += ["-fvisibility=hidden"]
    define_macros = []
    if with_cuda and cuda_sources:
        define_macros.append(("GRAPHTREES_WITH_CUDA", None))
        sources += cuda_sources
    print(
        f"graphtrees build: torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"CUDA_HOME={CUDA_HOME}, extension={'CUDAExtension' if with_cuda else 'CppExtension'}, "
        f"CUDA backend={'yes' if with_cuda and cuda_sources else 'no'}, DEBUG={int(DEBUG)}"
    )
    ext = CUDAExtension if with_cuda else CppExtension
    return [
        ext(
            name="graphtrees._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O2"]},
        )
    ]


setup(
    name="graphtrees",
    version=VERSION,
    description="CUDA Graph Trees for any PyTorch callable, with a C++ tree manager",
    packages=find_packages(include=["graphtrees", "graphtrees.*"]),
    package_data={"graphtrees": ["py.typed", "_C.pyi"]},
    ext_modules=get_extensions(),
    cmdclass={"build_ext": IncrementalBuildExtension},
    # torch.compile(model, backend="graphtrees") finds the backend through this entry point.
    entry_points={
        "torch_dynamo_backends": ["graphtrees = graphtrees._dynamo_backend:graphtrees_backend"]
    },
    python_requires=">=3.10",
    # The one torch the extension was compiled against (its local tag, +cu130, is not pinned).
    install_requires=[f"torch=={TORCH_PIN}"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6"]},
    zip_safe=False,
)
