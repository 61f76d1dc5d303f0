"""The C++ toolchain facts of a build: which runtime the process loaded, which compiler a name
runs, and whether a built extension carries a private copy of the C++ standard library.

Plain Python with no import of graphtrees or torch: setup.py loads this file by path before the
package can be imported (Note [The process's C++ runtime] in setup.py), and the tests use it too.
"""

import os
import re
import shutil
import subprocess


def resolve_program(program):
    """The file a compiler name runs, and the first line of its --version."""
    path = shutil.which(program) or program
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
        version = out.splitlines()[0] if out else "unknown version"
    except OSError as e:
        version = f"not runnable: {e}"
    return os.path.realpath(path) if os.path.exists(path) else path, version


def process_cxx_runtime():
    """The libstdc++.so.6 this process loaded (call it after `import torch`, which loads it),
    or None where the runtime is another (libc++, a platform without /proc)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


# Locale and stream code of the C++ standard library (mangled: std::locale, std::ostream's
# _M_insert, the num_put/numpunct facets): none of it may be defined in _C.so itself.
PRIVATE_RUNTIME_SYMBOLS = re.compile(
    r"^_ZNSt6locale|^_ZNSo9_M_insert|^_ZNKSt7num_put|^_ZNSt8numpunct"
)


def private_runtime_symbols(so_path):
    """The standard library's locale/stream symbols that `so_path` defines itself (none in a
    build that uses the process's libstdc++.so.6), or None when nm is unavailable."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run(
        [nm, "-D", "--defined-only", so_path], capture_output=True, text=True, check=True
    ).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.split()]
    return [n for n in names if PRIVATE_RUNTIME_SYMBOLS.search(n)]


def needed_libraries(so_path):
    """The DT_NEEDED entries of a shared object (readelf -d), or [] when readelf is missing."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return []
    out = subprocess.run([readelf, "-d", so_path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
