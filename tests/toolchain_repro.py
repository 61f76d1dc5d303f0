"""The GPU machine's toolchain, on a CPU machine: GCC 13's libstdc++.a (what /opt/gcc/bin/g++
linked into graphtrees._C there) and GCC 14's libstdc++.so.6 (the runtime torch loaded there),
fetched as Debian packages into a folder of ours; nothing is installed system-wide.

Used by tests/test_toolchain.py. See ../shared/reference/gpu-run-2026-12-04.md for the crash and
Note [The process's C++ runtime] in setup.py for the fix. fetch() raises Unavailable with the
reason when the packages cannot be had (no apt-get, no Debian mirror, no network)."""

import glob
import os
import shutil
import struct
import subprocess

PACKAGES = ["libstdc++6=14.2.0-19", "libstdc++-13-dev=13.3.0-16"]  # Debian trixie's
SUITE = "trixie"


class Unavailable(Exception):
    pass


def _debian_mirror():
    for path in ["/etc/apt/sources.list"] + glob.glob("/etc/apt/sources.list.d/*"):
        try:
            text = open(path).read()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if words[:1] in (["deb"], ["URIs:"]):
                for w in words[1:]:
                    if "://" in w and w.rstrip("/").endswith("/debian"):
                        return w
    return None


def _glibc_version():
    import ctypes

    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    major, minor = libc.gnu_get_libc_version().decode().split(".")[:2]
    return int(major), int(minor)


def _weaken_version_need(path, versions):
    """Marks the named version needs (e.g. GLIBC_2.38) of an ELF shared object weak, so that an
    older glibc loads it; the few symbols of that version come from a preloaded shim."""
    data = bytearray(open(path, "rb").read())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    for _, kind, _, _, off, _, link, info, _, _ in sections:
        if kind != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strtab = sections[link][4]
        p = off
        for _ in range(info):
            _, count, _, aux, nxt = struct.unpack_from("<HHIII", data, p)
            a = p + aux
            for _ in range(count):
                _, flags, _, name, anxt = struct.unpack_from("<IHHII", data, a)
                end = data.index(0, strtab + name)
                if data[strtab + name : end].decode() in versions:
                    struct.pack_into("<H", data, a + 4, flags | 2)  # VER_FLG_WEAK
                a += anxt
            p += nxt
    open(path, "wb").write(data)


def fetch(out):
    """Returns {"gcc13": folder holding GCC 13's libstdc++.a, "lib14": folder holding GCC 14's
    libstdc++.so.6, "preload": [shims to LD_PRELOAD]}; fetched once into `out`."""
    out = os.path.abspath(out)
    gcc13 = os.path.join(out, "root", "usr", "lib", "gcc", "x86_64-linux-gnu", "13")
    lib14 = os.path.join(out, "lib14")
    if not os.path.exists(os.path.join(gcc13, "libstdc++.a")):
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            raise Unavailable("no apt-get/dpkg to fetch Debian's libstdc++ packages")
        mirror = _debian_mirror()
        if mirror is None:
            raise Unavailable("no Debian mirror in /etc/apt/sources.list*")
        apt = os.path.join(out, "apt")
        for d in ("lists/partial", "cache/archives/partial", "etc", "debs"):
            os.makedirs(os.path.join(apt, d), exist_ok=True)
        with open(os.path.join(apt, "etc", f"{SUITE}.sources"), "w") as f:
            f.write(
                f"Types: deb\nURIs: {mirror}\nSuites: {SUITE}\nComponents: main\n"
                "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            )
        opts = [
            "-o", "Dir::Etc::SourceList=/dev/null",
            "-o", f"Dir::Etc::SourceParts={apt}/etc",
            "-o", f"Dir::State::Lists={apt}/lists",
            "-o", f"Dir::Cache={apt}/cache",
        ]  # fmt: skip
        for cmd, cwd in (
            (["apt-get", *opts, "update"], None),
            (["apt-get", *opts, "download", *PACKAGES], os.path.join(apt, "debs")),
        ):
            r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise Unavailable(f"{' '.join(cmd[:1] + cmd[-2:])} failed: {r.stderr[-500:]}")
        for deb in glob.glob(os.path.join(apt, "debs", "*.deb")):
            subprocess.run(["dpkg", "-x", deb, os.path.join(out, "root")], check=True)
        if not os.path.exists(os.path.join(gcc13, "libstdc++.a")):
            raise Unavailable("the packages held no GCC 13 libstdc++.a")
    preload = []
    so = glob.glob(os.path.join(out, "root", "usr", "lib", "x86_64-linux-gnu", "libstdc++.so.6.*"))
    if not so:
        raise Unavailable("the packages held no libstdc++.so.6")
    os.makedirs(lib14, exist_ok=True)
    target = os.path.join(lib14, "libstdc++.so.6")
    if not os.path.exists(target):
        shutil.copy(so[0], target)
        if _glibc_version() < (2, 38):  # its one GLIBC_2.38 symbol comes from a shim
            _weaken_version_need(target, {"GLIBC_2.38"})
    if _glibc_version() < (2, 38):
        shim = os.path.join(lib14, "libisoc23.so")
        if not os.path.exists(shim):
            src = os.path.join(lib14, "isoc23.c")
            with open(src, "w") as f:
                f.write(
                    "#include <stdlib.h>\nunsigned long __isoc23_strtoul(const char* s, char** e, "
                    "int b) { return strtoul(s, e, b); }\n"
                )
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", src, "-o", shim], check=True)
        preload.append(shim)
    return {"gcc13": gcc13, "lib14": lib14, "preload": preload}


def static_driver(folder, gcc13, hostile=False):
    """Writes compiler drivers named c++, g++ (and Python's CXX) into `folder` that link GCC 13's
    libstdc++ statically with -Wl,-Bsymbolic-functions, as the GPU machine's g++ and Python did.
    Compiles pass through unchanged (the same command: ninja keeps its objects). `hostile`: the
    driver also drops a libstdc++.so named on the link line (a toolchain the build cannot mend)."""
    import sysconfig

    os.makedirs(folder, exist_ok=True)
    names = {"c++", "g++", (sysconfig.get_config_var("CXX") or "g++").split()[0]}
    drop = 'case "$a" in */libstdc++.so*) continue;; esac' if hostile else ""
    for name in names:
        path = os.path.join(folder, os.path.basename(name))
        with open(path, "w") as f:
            f.write(
                f"""#!/bin/bash
PATH=${{PATH#{folder}:}}
link=0
for a in "$@"; do [[ $a == -shared ]] && link=1; done
[[ $link == 1 ]] || exec {os.path.basename(name)} "$@"
args=()
for a in "$@"; do {drop}
  args+=("$a"); done
exec {os.path.basename(name)} "${{args[@]}}" -static-libstdc++ -L{gcc13} -Wl,-Bsymbolic-functions
"""
            )
        os.chmod(path, 0o755)
    return folder
