"""Build script for graphtrees' C++ extension, graphtrees._C.

Environment switches (read once, printed at build time):
  USE_CUDA=0        build the CPU-only extension even with a CUDA build of torch
  FORCE_CUDA=1      build the CUDA backend even if torch or nvcc look CUDA-less
  DEBUG=1           -O0 -g
  GRAPHTREES_EXTRA_CFLAGS="..."   more compile and link flags (e.g. "-g", or
                    "-fsanitize=address,undefined"); each set of flags builds in its own folder
  MAX_JOBS=N        parallel compile jobs (ninja)
  TORCH_CUDA_ARCH_LIST="9.0"      the GPU architectures of csrc/cuda/*.cu (default: the visible
                    GPUs', or with none visible torch's own list, PTX for the newest)
"""

# Note [The process's C++ runtime]
# The extension must use the C++ standard library the process has loaded (torch's libstdc++.so.6),
# never a copy of its own: a compiler that links libstdc++ statically (a GCC installed under /opt,
# a conda or cluster-module toolchain) gives _C.so a private copy of the locale and stream code, and
# in a process whose libstdc++.so.6 is another version, its facet numbering disagrees with the
# process's and the first number it formats reads a wrong facet (the first GPU run's crash,
# ../shared/reference/gpu-run-2026-12-04.md). So the link line names the runtime that a torch
# process loads (found in /proc/self/maps after `import torch`) explicitly: symbols bind to it
# before any static archive the compiler adds. After linking, the build fails with the reason if
# _C.so still defines standard library code itself (nm -D --defined-only: strong definitions in
# namespace std or of the C++ ABI), or needs GLIBCXX_ versions the runtime lacks (a compiler
# newer than the runtime); graphtrees/_ext.py checks at import, without formatting anything.

import glob
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import sysconfig

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
TORCH_PIN = torch.__version__.split("+")[0]
USE_CUDA = os.environ.get("USE_CUDA", "1") != "0"
FORCE_CUDA = os.environ.get("FORCE_CUDA", "0") == "1"
DEBUG = os.environ.get("DEBUG", "0") == "1"
EXTRA_CFLAGS = shlex.split(os.environ.get("GRAPHTREES_EXTRA_CFLAGS", ""))


# Note [The process's C++ runtime]: the runtime, the compiler and the checks of the built
# extension live in graphtrees/_toolchain.py (plain Python: loaded here by path, before the
# package can be imported; the tests and scripts/run_tests.sh use the same functions).
_spec = importlib.util.spec_from_file_location(
    "graphtrees_toolchain", os.path.join(ROOT, "graphtrees", "_toolchain.py")
)
toolchain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toolchain)
CXX_RUNTIME = toolchain.process_cxx_runtime()
# The compile driver (torch's: $CXX or c++) and the link driver (setuptools': $CXX or Python's).
COMPILER = "{} ({})".format(*toolchain.resolve_program(os.environ.get("CXX", "c++")))
LINKER = "{} ({})".format(
    *toolchain.resolve_program(
        (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
    )
)

# Written into the package (the source tree, so that `pip install -e .` and a wheel's build_py
# both see it; and beside the extension when that is built elsewhere): the torch the extension
# is compiled against, refused by graphtrees._ext under another torch (its C++ ABI and headers
# are that torch's; a wheel's metadata pins it too: install_requires below), and the compiler and
# runtime it is built with, named when graphtrees._ext refuses a build.
BUILT_WITH = os.path.join(ROOT, "graphtrees", "_built_with.py")


def write_built_with(path):
    text = (
        '"""Written by setup.py: the torch graphtrees._C was compiled against, and the compiler '
        'and\nC++ runtime it was built with."""\n\n'
        f"TORCH = {torch.__version__!r}\n"
        f"COMPILER = {COMPILER!r}\n"
        f"LINKER = {LINKER!r}\n"
        f"CXX_RUNTIME = {CXX_RUNTIME!r}\n"
    )
    if not os.path.exists(path) or open(path).read() != text:
        tmp = f"{path}.{os.getpid()}.tmp"  # replaced whole: a reader never sees it half written
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


write_built_with(BUILT_WITH)


class IncrementalBuildExtension(BuildExtension):
    """Builds in one persistent folder per torch and Python (build/temp-torch<version>-py<ver>),
    also under `pip install -e .`, which would otherwise compile every file again in a fresh
    temporary folder: ninja then rebuilds only what changed. GRAPHTREES_BUILD_TEMP overrides it."""

    def finalize_options(self):
        super().finalize_options()
        flavour = ""
        if EXTRA_CFLAGS:  # another set of flags builds apart (objects of both are kept)
            flavour = "-" + hashlib.sha256(" ".join(EXTRA_CFLAGS).encode()).hexdigest()[:8]
        self.build_temp = os.environ.get("GRAPHTREES_BUILD_TEMP") or os.path.join(
            ROOT,
            "build",
            f"temp-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}{flavour}",
        )

    def build_extensions(self):
        # Two builds of one folder at once (a test building a wheel while another relinks)
        # would run two ninjas over the same objects: the second waits for the first.
        import fcntl

        os.makedirs(self.build_temp, exist_ok=True)
        with open(os.path.join(self.build_temp, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            super().build_extensions()

    def build_extension(self, ext):
        # Note [The process's C++ runtime]: say which compilers and which runtime, link, check.
        print(
            f"graphtrees build: compiler {COMPILER}, link driver {LINKER}, C++ runtime "
            f"{CXX_RUNTIME or 'the compiler default (no libstdc++.so.6 loaded by torch)'}",
            flush=True,
        )
        super().build_extension(ext)
        so_path = self.get_ext_fullpath(ext.name)
        missing = toolchain.runtime_versions_missing(so_path, CXX_RUNTIME)
        if missing:
            os.remove(so_path)  # it would fail at import with "version ... not found"
            raise RuntimeError(
                f"graphtrees build: {os.path.basename(so_path)} needs {', '.join(missing)} of "
                f"libstdc++.so.6, which this process's C++ runtime ({CXX_RUNTIME}) does not "
                f"define: the compiler {COMPILER} is newer than that runtime. Build with a "
                "compiler no newer than it (e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc), or run "
                "with a newer libstdc++.so.6."
            )
        private = toolchain.private_runtime_symbols(so_path)
        if private:
            os.remove(so_path)  # never leave a build that crashes at its first formatted number
            raise RuntimeError(
                f"graphtrees build: {os.path.basename(so_path)} defines {len(private)} symbols of "
                f"the C++ standard library's own code itself (e.g. {private[0]}): "
                f"the link driver {LINKER} linked a private copy of "
                "libstdc++, which crashes inside a torch process (the Note on the process's "
                "C++ runtime in setup.py). Build with a compiler that links libstdc++.so.6 "
                "dynamically (e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc)."
            )
        needed = [
            n for n in toolchain.needed_libraries(so_path) if n.startswith(("libstdc++", "libc++"))
        ]
        print(
            f"graphtrees build: {os.path.basename(so_path)} uses the C++ runtime "
            f"{', '.join(needed) or 'of the process (no NEEDED entry: none referenced)'} "
            "dynamically; "
            + (
                "nm not found, so its own standard library symbols were not checked"
                if private is None
                else "it defines no standard library code of its own"
            ),
            flush=True,
        )
        if os.path.dirname(os.path.abspath(so_path)) != os.path.dirname(BUILT_WITH):
            write_built_with(os.path.join(os.path.dirname(so_path), "_built_with.py"))


def _default_cuda_arch_list():
    """The architectures csrc/cuda/*.cu is compiled for when TORCH_CUDA_ARCH_LIST is not set and no
    GPU is visible (torch's own choice, the visible cards', fails then): torch's own (its CUDA 13
    builds': Turing to Blackwell), PTX for the newest."""
    arches = [a[3:] for a in torch.cuda.get_arch_list() if re.fullmatch(r"sm_\d+", a)]
    if not arches:
        arches = ["75", "80", "86", "90", "100", "120"]
    return ";".join(f"{a[:-1]}.{a[-1]}" for a in arches) + "+PTX"


def get_extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
    cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    with_cuda = FORCE_CUDA or (
        USE_CUDA and torch.version.cuda is not None and CUDA_HOME is not None
    )
    cxx = ["-O0", "-g"] if DEBUG else ["-O2"]
    cxx += ["-fvisibility=hidden"] + EXTRA_CFLAGS
    # Note [The process's C++ runtime]: named explicitly, so that it wins over a static archive.
    link = ([CXX_RUNTIME] if CXX_RUNTIME else []) + EXTRA_CFLAGS
    define_macros = []
    if with_cuda and cuda_sources:
        define_macros.append(("GRAPHTREES_WITH_CUDA", None))
        sources += cuda_sources
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _default_cuda_arch_list()
    print(
        f"graphtrees build: torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"CUDA_HOME={CUDA_HOME}, extension={'CUDAExtension' if with_cuda else 'CppExtension'}, "
        f"CUDA backend={'yes' if with_cuda and cuda_sources else 'no'}, DEBUG={int(DEBUG)}"
        + (f", extra flags: {' '.join(EXTRA_CFLAGS)}" if EXTRA_CFLAGS else "")
    )
    ext = CUDAExtension if with_cuda else CppExtension
    return [
        ext(
            name="graphtrees._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O2"]},
            extra_link_args=link,
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
