"""The CUDA stand-in: build it, run a command on it, and read its counters from a test.

    python tests/cuda_standin/standin.py build        # prints the library folder, or why not
    python tests/cuda_standin/standin.py env          # the environment a process needs
    python tests/cuda_standin/standin.py run -- CMD   # CMD with that environment

The libraries are built with the system C++ compiler against the CUDA headers that setup.py
finds (CUDA_HOME, the toolkit of the nvcc on PATH, /usr/local/cuda*), into build/cuda_standin/,
once per change of their sources (a stamp of the sources and flags). Nothing of it ships with
graphtrees. See README.md in this folder for what it models.
"""

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# CUDA_STANDIN_DIR: where the libraries are built (a second checkout can share the first's).
DEFAULT_OUT = os.environ.get("CUDA_STANDIN_DIR") or os.path.join(ROOT, "build", "cuda_standin")
RUNTIME_SOURCES = [
    "state.cpp",
    "memory.cpp",
    "streams.cpp",
    "capture.cpp",
    "kernels.cpp",
    "driver.cpp",
]
HEADERS = ["standin.h", "standin_api.h"]
FLAGS = [
    "-std=c++17",
    "-O1",
    "-g0",
    "-fPIC",
    "-shared",
    "-Wall",
    "-Wno-unused-parameter",
    "-fvisibility=default",
]
# The real CUDA libraries need only the C library (libc, libm, libdl, libpthread, librt): the
# stand-in's carry their own C++ runtime, hidden, so that preloading them puts no libstdc++.so.6
# or libgcc_s.so.1 in the process-wide lookup scope. One there would hide what a private C++
# runtime inside an extension does beside the process's own (the first GPU run's crash: an
# extension's static libstdc++ copy, whose locale broke only where no preloaded library bound it
# to the process's): tests/test_standin.py checks their NEEDED entries.
LINK_FLAGS = ["-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL"]
# The libraries, in the order LD_PRELOAD names them.
LIBRARIES = [
    "libcudart.so.13",
    "libcuda.so.1",
    "libcublasLt.so.13",
    "libcublas.so.13",
    "libnvidia-ml.so.1",
    "libnvrtc.so.13",
]


def cuda_include_dir():
    """The CUDA toolkit's include folder holding cuda_runtime_api.h and cuda.h, or None."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        inc = os.path.join(c, "include")
        if all(os.path.exists(os.path.join(inc, h)) for h in ("cuda_runtime_api.h", "cuda.h")):
            return inc
    return None


def why_not_buildable():
    """None if the stand-in can be built here, else the reason."""
    if sys.platform != "linux":
        return "the CUDA stand-in is Linux-only"
    if cuda_include_dir() is None:
        return (
            "no CUDA headers (cuda_runtime_api.h, cuda.h) in CUDA_HOME, nvcc's toolkit or "
            "/usr/local/cuda*"
        )
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        return "no C++ compiler (g++, or $CXX)"
    return None


def _stamp(inc, cxx):
    h = hashlib.sha256()
    for name in sorted(RUNTIME_SOURCES + HEADERS + ["cublas.cpp", "nvml.cpp", "nvrtc.cpp"]):
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    h.update(" ".join(FLAGS + LINK_FLAGS + [inc, cxx]).encode())
    return h.hexdigest()


def _version_script(out, soname, patterns):
    path = os.path.join(out, soname + ".map")
    globals_ = "".join(f"    {p};\n" for p in patterns)
    with open(path, "w") as f:
        f.write(f"{soname} {{\n  global:\n{globals_}  local: *;\n}};\n")
    return path


def build(out=DEFAULT_OUT, verbose=True):
    """Builds the libraries into `out` (skipped when the stamp matches); returns `out`."""
    why = why_not_buildable()
    if why:
        raise RuntimeError(why)
    inc = cuda_include_dir()
    cxx = os.environ.get("CXX", "g++")
    os.makedirs(out, exist_ok=True)
    stamp = _stamp(inc, cxx)
    stamp_file = os.path.join(out, "stamp")
    if os.path.exists(stamp_file) and all(
        os.path.exists(os.path.join(out, lib)) for lib in LIBRARIES
    ):
        with open(stamp_file) as f:
            if f.read() == stamp:
                return out
    if verbose:
        print(f"[cuda stand-in] building into {out} against {inc}", file=sys.stderr, flush=True)

    def cc(args):
        cmd = [cxx, *FLAGS, f"-I{inc}", f"-I{HERE}", *args, *LINK_FLAGS]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
        if r.returncode != 0:
            raise RuntimeError(
                "building the CUDA stand-in failed:\n" + " ".join(cmd) + "\n" + r.stderr
            )

    rpath = "-Wl,-rpath,$ORIGIN"
    cc(
        [
            *[os.path.join(HERE, s) for s in RUNTIME_SOURCES],
            "-o",
            os.path.join(out, "libcudart.so.13"),
            "-Wl,-soname,libcudart.so.13",
            "-Wl,--version-script="
            + _version_script(out, "libcudart.so.13", ["cuda*", "__cuda*", "cu*", "standin_*"]),
            "-lpthread",
        ]
    )
    # libcuda.so.1: empty; its dependency on the runtime is where dlsym finds the driver.
    empty = os.path.join(out, "empty.cpp")
    with open(empty, "w") as f:
        f.write(
            "// The stand-in's libcuda.so.1: the driver lives in its dependency, libcudart.so.13.\n"
        )
    cc(
        [
            empty,
            "-o",
            os.path.join(out, "libcuda.so.1"),
            "-Wl,-soname,libcuda.so.1",
            "-Wl,--no-as-needed",
            f"-L{out}",
            "-l:libcudart.so.13",
            "-Wl,--as-needed",
            rpath,
        ]
    )
    link = os.path.join(out, "libcuda.so")
    if not os.path.lexists(link):
        os.symlink("libcuda.so.1", link)
    for lib, defines, pattern in (
        ("libcublas.so.13", [], "cublas*"),
        ("libcublasLt.so.13", ["-DSTANDIN_CUBLASLT"], "cublasLt*"),
    ):
        cc(
            [
                *defines,
                os.path.join(HERE, "cublas.cpp"),
                "-o",
                os.path.join(out, lib),
                f"-Wl,-soname,{lib}",
                "-Wl,--version-script=" + _version_script(out, lib, [pattern]),
                "-Wl,--no-as-needed",
                f"-L{out}",
                "-l:libcudart.so.13",
                "-Wl,--as-needed",
                rpath,
            ]
        )
    cc(
        [
            os.path.join(HERE, "nvml.cpp"),
            "-o",
            os.path.join(out, "libnvidia-ml.so.1"),
            "-Wl,-soname,libnvidia-ml.so.1",
        ]
    )
    cc(
        [
            os.path.join(HERE, "nvrtc.cpp"),
            "-o",
            os.path.join(out, "libnvrtc.so.13"),
            "-Wl,-soname,libnvrtc.so.13",
            "-Wl,--version-script=" + _version_script(out, "libnvrtc.so.13", ["nvrtc*"]),
        ]
    )
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return out


def _clean_env():
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def environment(out=DEFAULT_OUT, base=None):
    """The environment variables a process needs to run on the stand-in built in `out`."""
    base = dict(os.environ if base is None else base)
    preload = [os.path.join(out, lib) for lib in LIBRARIES]
    if base.get("LD_PRELOAD"):
        preload.append(base["LD_PRELOAD"])
    paths = [out] + ([base["LD_LIBRARY_PATH"]] if base.get("LD_LIBRARY_PATH") else [])
    base.update(
        LD_PRELOAD=":".join(preload),
        LD_LIBRARY_PATH=":".join(paths),
        TRITON_LIBCUDA_PATH=out,
        TRITON_CACHE_DIR=os.path.join(out, "triton-cache"),
        # The images the stand-in's NVRTC makes stay beside it, out of torch's kernel cache.
        PYTORCH_KERNEL_CACHE_PATH=os.path.join(out, "kernel-cache"),
        CUDA_STANDIN="1",
        CUDA_STANDIN_DIR=out,  # where the libraries are (tests read their NEEDED entries)
    )
    return base


# ---- inside a process running on the stand-in --------------------------------------------------


class Stats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "mallocs",
            "frees",
            "bytes_in_use",
            "peak_bytes",
            "oom",
            "kernel_launches",
            "kernel_nodes",
            "copies",
            "captures_begun",
            "captures_ended",
            "captures_invalidated",
            "graph_launches",
            "unsafe_calls",
            "device_faults",
            "sticky_error",
            "deferred",
            "capacity",
            "live_graphs",
            "live_execs",
            "vmm_mapped_bytes",
        )
    ]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class Standin:
    """The stand-in's control functions (standin_api.h) in this process."""

    def __init__(self, lib):
        self._lib = lib
        lib.standin_kernel_count.restype = ctypes.c_int64
        lib.standin_kernel_count.argtypes = [ctypes.c_char_p]
        lib.standin_last_message.restype = ctypes.c_size_t
        lib.standin_set_capacity.argtypes = [ctypes.c_int64]
        lib.standin_fail_allocation.argtypes = [ctypes.c_int64, ctypes.c_int64]

    def stats(self):
        s = Stats()
        self._lib.standin_stats(ctypes.byref(s))
        return s.as_dict()

    def set_capacity(self, nbytes):
        self._lib.standin_set_capacity(int(nbytes))

    def fail_allocation(self, n=1, count=2):
        """The n-th device allocation from now and the `count - 1` after it fail as out of
        memory (0 disarms). c10 retries a failed cudaMalloc once after emptying its cache, so the
        default count=2 is one allocation that fails for c10."""
        self._lib.standin_fail_allocation(int(n), int(count))

    def last_message(self):
        buf = ctypes.create_string_buffer(4096)
        self._lib.standin_last_message(buf, len(buf))
        return buf.value.decode(errors="replace")

    def is_device_memory(self, ptr, nbytes):
        self._lib.standin_is_device_memory.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return bool(self._lib.standin_is_device_memory(ptr, nbytes))

    def kernel_count(self, substring=""):
        return self._lib.standin_kernel_count(substring.encode())

    def fail_next(self, call, error):
        """The next call of `call` (cudaGraphInstantiateWithFlags, cudaGraphLaunch,
        cudaStreamEndCapture, cudaStreamSynchronize, cudaMemcpyAsync) fails with cudaError_t
        `error`."""
        self._lib.standin_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        if self._lib.standin_fail_next(call.encode(), int(error)) != 0:
            raise ValueError(f"the stand-in cannot make {call} fail")

    def clear_sticky_error(self):
        self._lib.standin_clear_sticky_error()

    def reset_counters(self):
        self._lib.standin_reset_counters()


def current():
    """The stand-in this process runs on, or None (a real GPU, or no CUDA at all)."""
    if os.environ.get("CUDA_STANDIN") != "1":
        return None
    try:
        lib = ctypes.CDLL("libcudart.so.13", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    if not hasattr(lib, "standin_stats"):
        return None
    return Standin(lib)


def main(argv):
    if not argv or argv[0] not in ("build", "env", "run"):
        print(__doc__)
        return 2
    why = why_not_buildable()
    if why:
        print(f"[cuda stand-in] not available: {why}", file=sys.stderr)
        return 3
    out = build()
    if argv[0] == "build":
        print(out)
        return 0
    env = environment(out)
    if argv[0] == "env":
        for k in (
            "LD_PRELOAD",
            "LD_LIBRARY_PATH",
            "TRITON_LIBCUDA_PATH",
            "TRITON_CACHE_DIR",
            "CUDA_STANDIN",
            "CUDA_STANDIN_DIR",
        ):
            print(f"export {k}={env[k]}")
        return 0
    cmd = argv[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("run: no command given")
        return 2
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
