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
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"not runnable: {e}"
    return os.path.realpath(path) if os.path.exists(path) else path, version


def process_cxx_runtime():
    """The libstdc++.so.6 this process loaded (call it after `import torch`, which loads it),
    or None where the runtime is another (libc++, a platform without /proc)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)  # the path, the sixth field, may hold spaces
                if len(fields) < 6:
                    continue
                path = fields[5].rstrip("\n").removesuffix(" (deleted)")
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


# The C++ standard library's own code, as a private copy defines it: strong (T, D, B, R) or
# unique (u) definitions in namespace std (its substitutions: St, So, Si, Sa, Ss, Sd), its
# typeinfo and vtables, and the C++ ABI's __cxa_/__gxx_ functions. A build that uses the
# process's libstdc++.so.6 defines none: what it instantiates from the headers is weak (W, V).
PRIVATE_RUNTIME_TYPES = frozenset("TDBRu")
PRIVATE_RUNTIME_SYMBOLS = re.compile(r"^(_ZN?K?S[toiasd]|_ZT[VIS]N?S[toiasd]|__cxa_|__gxx_)")


def private_runtime_symbols(so_path):
    """The standard library's symbols that `so_path` defines itself (none in a build that uses
    the process's libstdc++.so.6), or None when nm is unavailable or fails."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    r = subprocess.run([nm, "-D", "--defined-only", so_path], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    found = []
    for line in r.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] in PRIVATE_RUNTIME_TYPES:
            if PRIVATE_RUNTIME_SYMBOLS.search(fields[2]):
                found.append(fields[2])
    return found


def _objdump_versions(so_path, section):
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    r = subprocess.run([objdump, "-p", so_path], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return r.stdout.split(section, 1)[1] if section in r.stdout else ""


def runtime_versions_missing(so_path, runtime):
    """The GLIBCXX_/CXXABI_ versions `so_path` needs from libstdc++.so.6 that `runtime` (a
    libstdc++.so.6 file) does not define: a compiler newer than the runtime links fine and fails
    at import (`version GLIBCXX_3.4.32 not found`). [] when all are there, None when unknown."""
    needs = _objdump_versions(so_path, "Version References:")
    defs = _objdump_versions(runtime, "Version definitions:") if runtime else None
    if needs is None or defs is None:
        return None
    wanted, within = set(), False
    for line in needs.splitlines():
        if line.strip().startswith("required from "):
            within = line.strip().startswith("required from libstdc++.so")
        elif within and line.split():
            wanted.add(line.split()[-1])
    defs = defs.split("Version References:", 1)[0]
    defined = {line.split()[-1] for line in defs.splitlines() if line.split()}
    return sorted(v for v in wanted if v not in defined)


def needed_libraries(so_path):
    """The DT_NEEDED entries of a shared object (readelf -d), or [] when readelf is missing."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return []
    out = subprocess.run([readelf, "-d", so_path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
