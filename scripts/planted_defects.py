"""Planted defects (issue 46): does the CUDA suite on the CUDA stand-in catch a wrong value?

Each defect is a temporary patch of graphtrees' C++ applied to a copy of this checkout (its own
build folder under build/planted-src, kept between runs), never to the checkout itself and never
shipped. For each one the copy is patched, built in place, and the chosen CUDA tests run on the
stand-in twice: with its value mode (the default) and with it off (CUDA_STANDIN_VALUES=0), so the
table says what the value mode adds. The tests that failed are listed with what failed them (a
value compared by helpers.assert_close or torch.equal, graphtrees' own checks, or a crash).

    python scripts/planted_defects.py [--tests tests/test_seed_story.py ...] [--only NAME]

Needs the stand-in built (tests/cuda_standin/standin.py build). Writes
benchmarks/results/planted-defects-DATE.md.
"""

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "build" / "planted-src"

# name: (what it plants, file, the exact text, its replacement)
DEFECTS = {
    "placeholder-offset": (
        "a replay copies each contiguous copied input one element off the placeholder the graph "
        "reads (a placeholder at the wrong address)",
        "csrc/Backend.cpp",
        "  backend.copyInputs(dst, src);\n",
        "  backend.copyInputs(dst, src);\n"
        "  for (size_t i = 0; i < dst.size(); ++i) {  // PLANTED DEFECT\n"
        "    const int64_t n = dst[i].numel();\n"
        "    if (!dst[i].is_contiguous() || !src[i].is_contiguous() || n < 2) continue;\n"
        "    dst[i].view(-1).narrow(0, 1, n - 1).copy_(src[i].reshape(-1).narrow(0, 0, n - 1)"
        ".clone());\n"
        "  }\n",
    ),
    "skipped-input-copy": (
        "a replay skips the copy of its last copied input (the graph reads the last call's value)",
        "csrc/Backend.cpp",
        "  backend.copyInputs(dst, src);\n",
        "  if (dst.empty()) return;  // PLANTED DEFECT\n"
        "  backend.copyInputs(std::vector<at::Tensor>(dst.begin(), dst.end() - 1),\n"
        "                     std::vector<at::Tensor>(src.begin(), src.end() - 1));\n",
    ),
    "checkpoint-frees-live-block": (
        "a restore frees the block of the first live output it re-adopts, and keeps the output "
        "readable (the next run reuses the block under it)",
        "csrc/LiveOutputs.cpp",
        "        auto found = by_ptr.find(e.ptr);\n"
        "        if (found == by_ptr.end()) return true;  // not expected: be safe, never hand out a "
        "block\n",
        "        auto found = by_ptr.find(e.ptr);\n"
        "        if (found == by_ptr.end()) return true;  // not expected: be safe, never hand out a "
        "block\n"
        "        if (!planted) {  // PLANTED DEFECT: the DataPtr dies with `restored`\n"
        "          planted = true;\n"
        "          return false;\n"
        "        }\n",
    ),
}
# The checkpoint defect's flag, one per restore.
EXTRA = {
    "checkpoint-frees-live-block": (
        "csrc/LiveOutputs.cpp",
        "  std::unordered_map<uintptr_t, c10::DataPtr*> by_ptr;\n",
        "  std::unordered_map<uintptr_t, c10::DataPtr*> by_ptr;\n  bool planted = false;\n",
    )
}
TESTS = [
    "tests/test_seed_story.py",
    "tests/test_tree_behaviour.py",
    "tests/test_cuda.py",
    "tests/test_write_back.py",
]


def sh(cmd, **kw):
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def standin_env():
    out = sh([sys.executable, "tests/cuda_standin/standin.py", "env"], cwd=ROOT, check=True).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        env[k] = v.strip("'\"")
    env["GRAPHTREES_CUDA"] = "1"
    return env


def patch(name):
    what, path, old, new = DEFECTS[name]
    edits = [(path, old, new)] + ([EXTRA[name]] if name in EXTRA else [])
    for path, old, new in edits:
        f = SRC / path
        text = f.read_text()
        assert text.count(old) == 1, f"{name}: the text to patch is not in {path} once"
        f.write_text(text.replace(old, new))


def sync():
    """The copy back to the checkout's code (only changed files rewritten)."""
    sh([sys.executable, "scripts/sync_tree.py", str(SRC)], cwd=ROOT, check=True)


def compile_copy():
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    lock = os.environ.get("GRAPHTREES_BUILD_LOCK")  # one build at a time on a shared machine
    r = sh(["flock", lock, *cmd] if lock else cmd, cwd=SRC)
    if r.returncode != 0:
        raise SystemExit(f"building the patched copy failed:\n{r.stderr[-3000:]}")
    # The copy's graphtrees is what its tests import (the checkout's editable install comes after
    # the working folder on the path).
    where = sh([sys.executable, "-c", "import graphtrees; print(graphtrees.__file__)"], cwd=SRC)
    assert where.stdout.startswith(str(SRC)), where.stdout + where.stderr


def run_tests(tests, env):
    """{test id: what failed it} for the tests that failed."""
    r = sh(
        [
            sys.executable,
            "-m",
            "pytest",
            *tests,
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "needs_cuda",
            "-rf",
            "--tb=line",
        ],
        cwd=SRC,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    failed = {}
    for line in r.stdout.splitlines():
        m = re.match(r"FAILED (\S+)(?: - (.*))?", line)
        if m:
            failed[m.group(1)] = kind_of(m.group(2) or "")
    summary = [x for x in r.stdout.splitlines() if re.search(r"\d+ (passed|failed)", x)]
    return failed, (summary[-1] if summary else r.stdout[-300:]), r.returncode


def kind_of(message):
    if "not close" in message or "Mismatched elements" in message or "torch.equal" in message:
        return "wrong value"
    if "overwritten" in message:
        return "graphtrees raised: overwritten output"
    if "invariant" in message.lower():
        return "graphtrees' pool invariant check"
    return (message[:120] or "failed").replace("|", "/")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tests", nargs="*", default=TESTS)
    p.add_argument("--only", action="append", choices=sorted(DEFECTS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    env_values = standin_env()
    env_off = dict(env_values, CUDA_STANDIN_VALUES="0")
    rows = []
    for name in a.only or list(DEFECTS):
        t = time.time()
        sync()
        patch(name)
        compile_copy()
        results = {}
        for mode, env in (("values", env_values), ("values off", env_off)):
            results[mode] = run_tests(a.tests, env)
            print(f"[planted] {name}, {mode}: {results[mode][1]}", file=sys.stderr, flush=True)
        rows.append((name, results, time.time() - t))
    sync()
    date = datetime.date.today().isoformat()
    lines = [
        f"# Planted defects on the CUDA stand-in ({date})",
        "",
        "`scripts/planted_defects.py`: each defect is a temporary patch of graphtrees' C++ in a "
        "copy of the checkout (never shipped), built, and the CUDA tests of "
        + ", ".join(f"`{t}`" for t in a.tests)
        + " run on the CUDA stand-in with its value mode and with it off "
        "(`CUDA_STANDIN_VALUES=0`). A stand-in run, not a GPU run.",
        "",
    ]
    for name, results, seconds in rows:
        lines += [f"## {name}", "", DEFECTS[name][0] + f" ({seconds:.0f} s).", ""]
        for mode, (failed, summary, _rc) in results.items():
            lines.append(f"* {mode}: {summary}")
            for test, kind in sorted(failed.items()):
                lines.append(f"  * `{test}`: {kind}")
        lines.append("")
    out = pathlib.Path(a.out) / f"planted-defects-{date}.md"
    out.write_text("\n".join(lines))
    print(out)
    caught = all(rows_failed(r) for _, r, _ in rows)
    return 0 if caught else 1


def rows_failed(results):
    return bool(results["values"][0])


if __name__ == "__main__":
    sys.exit(main())
