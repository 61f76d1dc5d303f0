"""The first GPU run's crash (../shared/reference/gpu-run-2026-12-04.md), reproduced on the CUDA
stand-in and guarded against: an extension linked with a private copy of libstdc++ (GCC 13's
libstdc++.a, -Wl,-Bsymbolic-functions, as the GPU machine's /opt/gcc/bin/g++ and Python did) in a
process whose libstdc++.so.6 is another (GCC 14's) reads a wrong facet at the first number it
formats through a stream. Note [The process's C++ runtime] in setup.py.

The builds here relink the objects of this checkout's build folder (the compile commands are
unchanged, so ninja compiles nothing) with compiler drivers that link libstdc++ statically
(tests/toolchain_repro.py), into folders of their own; the packages come from Debian's archive,
and the tests are skipped with the reason where they cannot be fetched."""

import glob
import os
import shutil
import subprocess
import sys

import pytest
import toolchain_repro

from helpers import ROOT, STANDIN

pytestmark = [
    pytest.mark.needs_cuda,
    pytest.mark.skipif(
        STANDIN is None,
        reason="reproduces the GPU machine's crash on the CUDA stand-in, which is not loaded",
    ),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux toolchain"),
]

sys.path.insert(0, ROOT)  # graphtrees/_toolchain.py, plain Python
from graphtrees import _toolchain  # noqa: E402

# After the first recording: INFO logging formats the recording's message, and tree_to_dot()
# formats numbers through a std::ostringstream.
RECORD = """
import logging
logging.basicConfig(level=logging.INFO)
import torch, graphtrees
g = graphtrees.cudagraphify(lambda x: x * 2 + 1)
x = torch.ones(1 << 18, device="cuda")
for _ in range(3):
    g(x)
info = graphtrees.tree_info("cuda")
assert info["num_recordings"] == 1 and info["num_replays"] == 1, info
print("DOT", graphtrees.tree_to_dot("cuda").replace("\\n", " "), flush=True)
"""
# graphtrees as it was before its import check: nothing asks whether _C carries a runtime.
WITHOUT_IMPORT_CHECK = """
import ctypes
class _NoCheck(ctypes.CDLL):
    def __getattr__(self, name):
        if name == "graphtrees_private_cxx_runtime":
            raise AttributeError(name)
        return super().__getattr__(name)
ctypes.CDLL = _NoCheck
"""


@pytest.fixture(scope="module")
def gpu_toolchain():
    try:
        return toolchain_repro.fetch(os.path.join(ROOT, "build", "toolchain-repro"))
    except toolchain_repro.Unavailable as e:
        pytest.skip(f"the GPU machine's libstdc++ versions cannot be fetched here: {e}")


def _relink(driver, out):
    """setup.py build_ext into `out` with the compiler drivers of `driver` first on PATH;
    returns the completed process. The source tree's graphtrees/_built_with.py, which setup.py
    rewrites with the drivers' names, is put back."""
    built_with = os.path.join(ROOT, "graphtrees", "_built_with.py")
    saved = open(built_with).read() if os.path.exists(built_with) else None
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "LDSHARED")}
    env["PATH"] = driver + os.pathsep + env["PATH"]
    for k in ("LD_PRELOAD", "LD_LIBRARY_PATH"):  # the build runs off the stand-in
        env.pop(k, None)
    try:
        r = subprocess.run(
            [sys.executable, "setup.py", "build_ext", "--build-lib", out],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        if saved is not None:
            with open(built_with, "w") as f:
                f.write(saved)
    return r


def _package(out):
    """Completes `out`/graphtrees (setup.py build_ext wrote only the extension and
    _built_with.py) with the package's Python files; returns the extension's path."""
    pkg = os.path.join(out, "graphtrees")
    os.makedirs(pkg, exist_ok=True)
    for f in glob.glob(os.path.join(ROOT, "graphtrees", "*.py")):
        if os.path.basename(f) != "_built_with.py" or not os.path.exists(
            os.path.join(pkg, "_built_with.py")
        ):
            shutil.copy(f, pkg)
    so = glob.glob(os.path.join(pkg, "_C*.so"))
    return so[0] if so else None


def _run_under_gcc14(tc, out, code):
    """`code` in a fresh interpreter importing graphtrees from `out`, on the stand-in, with GCC
    14's libstdc++.so.6 as the process's C++ runtime (the GPU machine's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = out
    env["LD_LIBRARY_PATH"] = tc["lib14"] + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    env["LD_PRELOAD"] = ":".join(tc["preload"] + [env.get("LD_PRELOAD", "")]).strip(":")
    env["GRAPHTREES_CUDA"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=out, env=env, capture_output=True, text=True, timeout=300
    )


def _loaded_runtime(tc, out):
    code = (
        f"import sys, torch\nsys.path.insert(0, {os.path.join(ROOT, 'graphtrees')!r})\n"
        "import _toolchain\nprint(_toolchain.process_cxx_runtime())"
    )
    r = _run_under_gcc14(tc, out, code)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()[-1]


def test_the_standin_does_not_hide_a_private_runtime():
    # Preloaded libraries that need libstdc++.so.6 put it in the process-wide scope, where a
    # private copy binds to it and no crash shows: the real CUDA libraries need only libc.
    for lib in glob.glob(os.path.join(os.environ["CUDA_STANDIN_DIR"], "lib*.so*")):
        needed = _toolchain.needed_libraries(lib)
        assert not [n for n in needed if n.startswith(("libstdc++", "libgcc_s"))], (lib, needed)


def test_a_static_runtime_is_linked_to_the_process_runtime_and_records(gpu_toolchain, tmp_path):
    driver = toolchain_repro.static_driver(str(tmp_path / "driver"), gpu_toolchain["gcc13"])
    out = str(tmp_path / "fixed")
    r = _relink(driver, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The "graphtrees build:" lines name the compiler, the link driver and the runtime.
    assert f"link driver {driver}/" in r.stdout, r.stdout[-3000:]
    assert "uses the C++ runtime libstdc++.so.6 dynamically" in r.stdout, r.stdout[-3000:]
    assert "it defines no standard library code of its own" in r.stdout
    so = _package(out)
    assert "libstdc++.so.6" in _toolchain.needed_libraries(so)
    assert _toolchain.private_runtime_symbols(so) == []
    assert _loaded_runtime(gpu_toolchain, out).startswith(gpu_toolchain["lib14"])
    run = _run_under_gcc14(gpu_toolchain, out, RECORD)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    # The numbers are formatted, by the process's runtime: "4.0 MiB written", not "( written)".
    assert "MiB written)" in run.stderr, run.stderr[-2000:]
    assert "pool reserved 4.0 MiB" in run.stdout and "#0 <lambda>" in run.stdout, run.stdout


def test_a_private_runtime_is_refused_by_the_build_and_the_import(gpu_toolchain, tmp_path):
    # A driver that drops the runtime setup.py names (a toolchain the build cannot mend): the
    # build refuses what it linked and leaves no extension behind.
    driver = toolchain_repro.static_driver(
        str(tmp_path / "driver"), gpu_toolchain["gcc13"], hostile=True
    )
    out = str(tmp_path / "static")
    r = _relink(driver, out)
    assert r.returncode != 0
    assert "symbols of the C++ standard library's own code itself" in r.stderr, (
        r.stdout[-2000:] + r.stderr[-3000:]
    )
    assert f"the link driver {driver}/" in r.stderr
    assert _package(out) is None
    # The same link line, run by hand: the GPU machine's extension.
    link = [line for line in r.stdout.splitlines() if " -shared " in line and " -o " in line]
    assert len(link) == 1, r.stdout[-3000:]
    env = dict(os.environ, PATH=driver + os.pathsep + os.environ["PATH"])
    for k in ("LD_PRELOAD", "LD_LIBRARY_PATH"):
        env.pop(k, None)
    subprocess.run(link[0], shell=True, cwd=ROOT, env=env, check=True, timeout=300)
    so = _package(out)
    assert len(_toolchain.private_runtime_symbols(so)) > 0  # the build's check sees the copy
    # The import refuses it, naming the compiler and the fix, before anything formats.
    run = _run_under_gcc14(gpu_toolchain, out, RECORD)
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    assert "ImportError: graphtrees' C++ extension" in run.stderr
    assert "carries its own copy of the C++ standard library" in run.stderr
    assert "CXX=/usr/bin/g++" in run.stderr
    # Before the import check, the same extension ran, and the first number its stream code
    # formatted after the recording read a wrong facet: the process died by SIGSEGV, as on the
    # GPU machine (there in the recording's own log message, since formatted without a stream).
    run = _run_under_gcc14(gpu_toolchain, out, WITHOUT_IMPORT_CHECK + RECORD)
    assert run.returncode == -11, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    assert "DOT" not in run.stdout
