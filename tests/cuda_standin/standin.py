"""The CUDA stand-in: build it, run a command on it, and read its counters from a test.

    python tests/cuda_standin/standin.py build        # prints the library folder, or why not
    python tests/cuda_standin/standin.py env          # the environment a process needs
    python tests/cuda_standin/standin.py run -- CMD   # CMD with that environment
    python tests/cuda_standin/standin.py build-values # the value engine for this Python's torch

On the stand-in, the value mode is on unless CUDA_STANDIN_VALUES=0: a value engine built for the
running torch (values.cpp, Note [Stand-in values]) computes every aten op's values on the host.

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
        # Into a temporary file, then renamed: a process running on the previous build keeps
        # its mapping of the old file (writing over a loaded library would crash it).
        args = list(args)
        target = args[args.index("-o") + 1]
        tmp = f"{target}.{os.getpid()}.tmp"
        args[args.index("-o") + 1] = tmp
        cmd = [cxx, *FLAGS, f"-I{inc}", f"-I{HERE}", *args, *LINK_FLAGS]
        r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
        if r.returncode != 0:
            raise RuntimeError(
                "building the CUDA stand-in failed:\n" + " ".join(cmd) + "\n" + r.stderr
            )
        os.replace(tmp, target)

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


# ---- the value engine (Note [Stand-in values] in values.cpp) ------------------------------------

VALUES_SOURCES = ["values.cpp", "values_host.cpp"]
VALUES_LIB = "libstandin_values.so"


def _torch_install():
    """(version, package folder) of the torch this Python would import, without importing it."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("no torch in this Python")
    return importlib.metadata.version("torch"), os.path.dirname(spec.origin)


def values_dir(out=DEFAULT_OUT, torch_version=None):
    """The per-torch folder of the value engine built against `torch_version` (default: the
    torch this Python imports)."""
    if torch_version is None:
        torch_version = _torch_install()[0]
    return os.path.join(out, "values-torch" + torch_version.split("+")[0])


def build_values(out=DEFAULT_OUT, verbose=True):
    """Builds the value engine (a torch C++ extension, values.cpp) against the torch this Python
    imports, into values_dir(out) (skipped when the stamp matches; torch is imported only to
    build); returns the library's path. Needs the stand-in's libraries in `out` (build()
    first): the engine links its libcudart."""
    inc = cuda_include_dir()
    cxx = os.environ.get("CXX", "g++")
    version, torch_dir = _torch_install()
    vdir = values_dir(out, version)
    lib = os.path.join(vdir, VALUES_LIB)
    major, minor = (int(x) for x in version.split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"
    torch_inc = os.path.join(torch_dir, "include")
    torch_lib = os.path.join(torch_dir, "lib")
    flags = [
        std,
        "-O1",
        "-g0",
        "-fPIC",
        "-shared",
        "-Wall",
        "-Wno-unused-parameter",
        "-Wno-unused-variable",
        f"-I{torch_inc}",
        f"-I{os.path.join(torch_inc, 'torch', 'csrc', 'api', 'include')}",
        f"-I{inc}",
        f"-I{HERE}",
    ]
    libs = [
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-lc10_cuda",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_cuda",
        f"-L{out}",
        "-l:libcudart.so.13",
    ]
    h = hashlib.sha256()
    for name in VALUES_SOURCES + HEADERS + ["values.h"]:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    h.update(" ".join(flags + libs + [cxx, version]).encode())
    stamp = h.hexdigest()
    stamp_file = os.path.join(vdir, "stamp")
    if os.path.exists(lib) and os.path.exists(stamp_file):
        with open(stamp_file) as f:
            if f.read() == stamp:
                return lib
    os.makedirs(vdir, exist_ok=True)
    if verbose:
        print(f"[cuda stand-in] building the value engine into {vdir}", file=sys.stderr, flush=True)
    # The C++ ABI torch was built with: asked of torch itself, in a clean process.
    abi = (
        subprocess.run(
            [sys.executable, "-c", "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"],
            capture_output=True,
            text=True,
            env=dict(_clean_env(), CUDA_STANDIN_VALUES="0"),
        ).stdout.strip()
        or "1"
    )
    tmp = f"{lib}.{os.getpid()}.tmp"
    cmd = [cxx, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [*[os.path.join(HERE, s) for s in VALUES_SOURCES], "-o", tmp, *libs]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if r.returncode != 0:
        raise RuntimeError("building the value engine failed:\n" + " ".join(cmd) + "\n" + r.stderr)
    os.replace(tmp, lib)
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return lib


# How the engine gets into every process on the stand-in: torch's own plug-in hook. At the end of
# `import torch`, torch calls each entry point of the group "torch.backends" that an installed
# distribution declares (torch._import_device_backends; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns
# them all off). environment() puts a folder on PYTHONPATH holding one such declaration (a
# dist-info folder, written here) whose entry point is load_values() below: so any Python that
# imports torch under `standin.py run` or `standin.py env` (a test, a subprocess, a script) loads
# the engine built for its own torch, before it makes a CUDA call. No sitecustomize (which would
# hide one the environment has) and nothing for the project's code to know.
AUTOLOAD_DIST = "cuda_standin_values-1.0.dist-info"


def autoload_dir(out=DEFAULT_OUT):
    """The PYTHONPATH folder that makes `import torch` load the value engine (written if needed)."""
    d = os.path.join(out, "values-autoload")
    files = {
        os.path.join(d, AUTOLOAD_DIST, "METADATA"): (
            "Metadata-Version: 2.1\nName: cuda-standin-values\nVersion: 1.0\n"
        ),
        os.path.join(d, AUTOLOAD_DIST, "entry_points.txt"): (
            "[torch.backends]\ncuda_standin_values = cuda_standin_values_autoload:load\n"
        ),
        os.path.join(d, "cuda_standin_values_autoload.py"): (
            '"""Loads the CUDA stand-in\'s value engine at torch import (tests/cuda_standin/'
            'standin.py, load_values)."""\n'
            "import importlib.util\n\n"
            f"STANDIN_PY = {os.path.join(HERE, 'standin.py')!r}\n\n\n"
            "def load():\n"
            "    name = '_cuda_standin_autoload'\n"
            "    spec = importlib.util.spec_from_file_location(name, STANDIN_PY)\n"
            "    module = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(module)\n"
            "    module.load_values()\n"
        ),
    }
    for path, text in files.items():
        try:
            with open(path) as f:
                if f.read() == text:
                    continue
        except OSError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return d


def values_requested(env=None):
    """Whether the value mode is asked for: on wherever the stand-in runs, CUDA_STANDIN_VALUES=0
    turns it off."""
    env = os.environ if env is None else env
    return env.get("CUDA_STANDIN") == "1" and env.get("CUDA_STANDIN_VALUES", "1") != "0"


def load_values():
    """Loads the value engine into this process (the autoload hook calls it at torch import):
    the one built for this torch in values_dir(), built first (in a subprocess, under a file
    lock) if it is missing. Returns the library's path, or None where the value mode is off or
    this process is not on the stand-in. A failure to build or load is reported and leaves the
    value mode off (values_enabled() says so), never half on."""
    if not values_requested() or current() is None:
        return None
    import fcntl

    from torch.torch_version import __version__ as torch_version

    out = os.environ.get("CUDA_STANDIN_DIR") or DEFAULT_OUT
    vdir = values_dir(out, str(torch_version))
    lib = os.path.join(vdir, VALUES_LIB)
    try:
        if not os.path.exists(lib):
            os.makedirs(vdir, exist_ok=True)
            with open(os.path.join(vdir, "lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not os.path.exists(lib):
                    env = _clean_env()
                    env["CUDA_STANDIN_VALUES"] = "0"
                    env["CUDA_STANDIN_DIR"] = out
                    subprocess.run(
                        [sys.executable, os.path.join(HERE, "standin.py"), "build-values"],
                        check=True,
                        env=env,
                        stdout=subprocess.DEVNULL,
                    )
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except (OSError, subprocess.CalledProcessError) as e:
        print(
            f"[cuda stand-in] value mode off: the value engine did not load: {e}", file=sys.stderr
        )
        return None
    return lib


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
    if values_requested(dict(base, CUDA_STANDIN="1")):
        pythonpath = [autoload_dir(out)] + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])
        base.update(PYTHONPATH=":".join(pythonpath), CUDA_STANDIN_VALUES="1")
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
            "host_nodes",
            "unknown_reads",
            "host_waits",
            "conditional_nodes",
            "conditional_runs",
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

    # ---- the value mode (Note [Stand-in values] in values.cpp) ----

    def values_enabled(self):
        """Whether a value engine computes this process's CUDA ops."""
        return values_enabled()

    def values_known(self, tensor):
        """(known, reason) for a CUDA tensor: see values_known()."""
        return values_known(tensor)

    def values_uncomputed(self):
        """(count, last): launches no engine op computed, and ops it could not compute; the
        name of the last one."""
        return values_uncomputed()


def _runtime():
    try:
        lib = ctypes.CDLL("libcudart.so.13", mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    return lib if hasattr(lib, "standin_values_active") else None


def values_enabled():
    """Whether this process runs on the stand-in with its value engine loaded: its CUDA ops
    compute values (Note [Stand-in values])."""
    lib = _runtime()
    return (
        lib is not None
        and os.environ.get("CUDA_STANDIN") == "1"
        and bool(lib.standin_values_active())
    )


def values_uncomputed():
    """(count, last name): kernels launched while no engine op computed them and ops it could
    not compute, since the process started."""
    lib = _runtime()
    if lib is None:
        return 0, ""
    buf = ctypes.create_string_buffer(512)
    lib.standin_values_uncomputed.restype = ctypes.c_int64
    n = lib.standin_values_uncomputed(buf, len(buf))
    return int(n), buf.value.decode(errors="replace")


def values_known(tensor):
    """(known, reason): whether every byte a CUDA tensor's view spans holds a value the stand-in
    computed or copied (reason is "" then), or why not: the value mode is off, or bytes of it
    were written by a kernel that nothing computed (a Triton kernel, a raw launch) or by an op
    without a host kernel, or computed from such bytes. Waits for the tensor's stream work
    first. A CPU tensor is always known."""
    if tensor.device.type != "cuda":
        return True, ""
    if not values_enabled():
        return False, "the CUDA stand-in's value mode is off (kernels not executed)"
    if tensor.numel() == 0:
        return True, ""
    import torch

    torch.cuda.current_stream(tensor.device).synchronize()
    extent = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        extent += (size - 1) * stride
    nbytes = extent * tensor.element_size()
    lib = _runtime()
    lib.standin_values_unknown.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if lib.standin_values_unknown(tensor.data_ptr(), nbytes):
        n, last = values_uncomputed()
        return False, (
            f"its values are unknown to the CUDA stand-in: written by work nothing computed "
            f"({n} such launches or ops so far, the last: {last})"
        )
    return True, ""


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
    if argv and argv[0] == "build-values":
        print(build_values(os.environ.get("CUDA_STANDIN_DIR") or DEFAULT_OUT))
        return 0
    if not argv or argv[0] not in ("build", "env", "run"):
        print(__doc__)
        return 2
    why = why_not_buildable()
    if why:
        print(f"[cuda stand-in] not available: {why}", file=sys.stderr)
        return 3
    out = build()
    if values_requested(dict(os.environ, CUDA_STANDIN="1")):
        # The value engine for this Python's torch (another torch builds its own on first use).
        try:
            build_values(out)
        except Exception as e:  # noqa: BLE001 - reported; the stand-in itself still works
            print(f"[cuda stand-in] value engine not built: {e}", file=sys.stderr)
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
            "CUDA_STANDIN_VALUES",
            "PYTHONPATH",
        ):
            if k in env:
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
