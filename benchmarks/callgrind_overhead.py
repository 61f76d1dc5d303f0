"""Instructions per call of the host-cost variants (benchmarks/bench_standin.py, section overhead)
under callgrind: the machine-independent side of the host-cost claim (a measurement, not a test).

Wall time per call depends on the machine (its caches, its clock, what else runs); instruction
counts do not. This counts, for each variant, the instructions executed by the whole process
(Python, dynamo's guards, AOTAutograd's wrappers, the tree managers, the stand-in's runtime) over
N calls, collected only inside the timed loop, and prints them per call, with each recorded
variant's part above the dynamo + AOTAutograd floor:

    python tests/cuda_standin/standin.py run -- env GRAPHTREES_CUDA=1 CUDA_STANDIN_VALUES=0 \\
        python benchmarks/callgrind_overhead.py [--calls 200] [--json FILE]

It starts itself again under valgrind (`--tool=callgrind --instr-atstart=no`: the import, the
compilations and the warm-up run uninstrumented) and switches collection on and off around each
loop with callgrind's client requests, from a small library it compiles with the C compiler
against valgrind's headers (valgrind/callgrind.h). Without valgrind or its headers it says so and
exits 3. A stand-in run: CUDA stand-in: host-side cost, kernels not executed.
"""

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNDER_VALGRIND = "GRAPHTREES_CALLGRIND_CHILD"

SHIM = r"""
#include <valgrind/callgrind.h>
void gt_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void gt_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void gt_dump(const char* name) { CALLGRIND_DUMP_STATS_AT(name); }
"""

# The variants whose part above the floor the claim is about, and the floor.
FLOOR = "dynamo + AOTAutograd alone"
OURS = 'torch.compile(backend="graphtrees")'
THEIRS = 'torch.compile(mode="reduce-overhead")'


def why_not():
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (Debian: apt-get install valgrind)"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler to build the client-request library"
    if not os.path.exists("/usr/include/valgrind/callgrind.h"):
        return "valgrind's headers are missing (/usr/include/valgrind/callgrind.h)"
    return None


def build_shim(folder):
    src = os.path.join(folder, "shim.c")
    lib = os.path.join(folder, "libgtcallgrind.so")
    with open(src, "w") as fh:
        fh.write(SHIM)
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O1", "-shared", "-fPIC", "-o", lib, src], check=True
    )
    return lib


def child(calls, lib, only):
    """Runs under valgrind: builds the variants, warms them up, then measures each."""
    import ctypes

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_standin
    import torch

    import graphtrees

    print(f"graphtrees from {os.path.dirname(graphtrees.__file__)}", flush=True)
    shim = ctypes.CDLL(lib)
    shim.gt_dump.argtypes = [ctypes.c_char_p]
    variants = bench_standin.overhead_variants(torch.ones(64, device="cuda"))
    variants = {k: v for k, v in variants.items() if only is None or k in only}
    with torch.no_grad():
        for fn in variants.values():  # warm up, record, compile
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        shim.gt_start()
        for name, fn in variants.items():
            fn()  # the first instrumented call fills callgrind's caches of translations
            shim.gt_toggle()
            for _ in range(calls):
                fn()
            shim.gt_toggle()
            shim.gt_dump(name.encode())
    torch.cuda.synchronize()


def totals(folder):
    """name -> {event: count} (Ir: instructions; with --cache-sim, the simulated cache's reads,
    writes and misses), from the dumps callgrind wrote (one per variant)."""
    out = {}
    paths = glob.glob(os.path.join(folder, "callgrind.out.*.*"))  # the dumps: <pid>.<part>
    for path in sorted(paths, key=lambda p: int(p.rsplit(".", 1)[1])):
        name = events = total = None
        with open(path, errors="replace") as fh:
            for line in fh:
                if line.startswith("desc: Trigger: Client Request: "):
                    name = line.split("Client Request: ", 1)[1].strip()
                elif line.startswith("events:"):
                    events = line.split()[1:]
                elif line.startswith(("totals:", "summary:")):
                    total = [int(v) for v in line.split()[1:]]
        if name is not None and events and total is not None:
            out[name] = dict(zip(events, total))
    return out


def report(counts, calls, cache_sim):
    """Prints, per call, each variant's instructions (and with the cache model its first-level
    instruction-cache misses), then the recorded variants' parts above the floor; returns them."""
    per = {k: {e: n / calls for e, n in v.items()} for k, v in counts.items()}
    res = {
        "calls": calls,
        "per_call": {k: {e: round(n, 1) for e, n in v.items()} for k, v in per.items()},
    }
    head = "instructions" + ("   I1 misses" if cache_sim else "")
    print(f"per call under callgrind ({calls} calls each; CUDA stand-in, kernels not executed):")
    print(f"  {'variant':40s} {head}")
    for k, v in per.items():
        print(f"  {k:40s} {v['Ir']:12,.0f}" + (f" {v.get('I1mr', 0):11,.0f}" if cache_sim else ""))
    if not {FLOOR, OURS, THEIRS} <= per.keys():
        return res
    above = {}
    for event in ("Ir", "I1mr") if cache_sim else ("Ir",):
        ours = per[OURS][event] - per[FLOOR][event]
        theirs = per[THEIRS][event] - per[FLOOR][event]
        above[event] = {"graphtrees": round(ours), "pytorch_trees": round(theirs)}
        what = "instructions" if event == "Ir" else "first-level instruction-cache misses"
        print(
            f"  above the floor: graphtrees {ours:,.0f} vs PyTorch's trees {theirs:,.0f} {what} "
            f"per call ({theirs / ours:.1f}x)"
        )
    res["above_floor"] = above
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--only", default=None, help="comma-separated variant names")
    p.add_argument("--keep", default=None, help="keep callgrind's dumps in this folder")
    p.add_argument(
        "--cache-sim",
        action="store_true",
        help="also simulate the caches (callgrind's model of a first-level and last-level cache: "
        "misses per call, which weigh more on a machine with less cache or memory bandwidth)",
    )
    p.add_argument(
        "--valgrind-arg",
        action="append",
        default=[],
        help="passed to valgrind (repeatable), e.g. --valgrind-arg=--LL=1048576,16,64",
    )
    args = p.parse_args()
    only = set(args.only.split(",")) | {FLOOR} if args.only else None
    if os.environ.get(UNDER_VALGRIND):
        child(args.calls, os.environ[UNDER_VALGRIND], only)
        return
    if os.environ.get("GRAPHTREES_CUDA") != "1":
        sys.exit("callgrind_overhead.py needs GRAPHTREES_CUDA=1 (see its docstring)")
    reason = why_not()
    if reason:
        print(f"callgrind_overhead: not measured: {reason}")
        sys.exit(3)
    folder = args.keep or tempfile.mkdtemp(prefix="gt-callgrind-")
    os.makedirs(folder, exist_ok=True)
    lib = build_shim(folder)
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--cache-sim={'yes' if args.cache_sim else 'no'}",
        f"--callgrind-out-file={folder}/callgrind.out.%p",
        *args.valgrind_arg,
        sys.executable,
        os.path.abspath(__file__),
        "--calls",
        str(args.calls),
    ]
    if args.only:
        cmd += ["--only", args.only]
    env = dict(os.environ, **{UNDER_VALGRIND: lib})
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout[-4000:])
        sys.exit(f"callgrind_overhead: valgrind exited {r.returncode}")
    counts = totals(folder)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    print(next((ln for ln in r.stdout.splitlines() if ln.startswith("graphtrees from")), ""))
    res = report(counts, args.calls, args.cache_sim)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_standin import machine

    res["machine"] = machine()
    res["date"] = datetime.date.today().isoformat()
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True)
    res["commit"] = git.stdout.decode().strip() or None
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
