"""The GPU check's plumbing, rehearsed without a GPU: every stage reported, results written, at
most 8 files back (the device machine returns no more), a crash's native backtrace taken."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT


def run_gpu_check(tmp_path, *args, **env_extra):
    out = tmp_path / "out"
    env = dict(
        os.environ, OUT=str(out), GPU_CHECK_REHEARSAL="1", GPU_CHECK_SKIP_BUILD="1", **env_extra
    )
    env.pop("GPU_CHECK_CRASH_TEST", None)
    r = subprocess.run(
        ["bash", "scripts/gpu_check.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, out


def test_gpu_check_rehearsal(tmp_path):
    # Everything the GPU run does, on CPU: the toolchain facts, the anchors' plumbing, the sanity
    # on the CPU backend, the suite stage, and a crash on purpose whose native backtrace (gdb)
    # lands in the summary.
    r, out = run_gpu_check(tmp_path, GPU_CHECK_CRASH="1")
    assert r.returncode == 0, r.stdout + r.stderr  # the crash on purpose does not count
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files  # the device tool returns no more
    assert not [f for f in files if f.startswith(".")], files
    summary = (out / "summary.md").read_text()
    assert "REHEARSAL" in summary and "exit status 0" in summary
    # The toolchain facts come first, before any stage.
    facts = summary[summary.index("## Toolchain") : summary.index("## Stages")]
    for fact in (
        "command -v g++: ",
        "file: ",
        "--version: ",
        "-print-file-name=libstdc++.so: ",
        "-print-file-name=libstdc++.a: ",
        "libstdc++ loaded after import torch: ",
        "debugger: ",
    ):
        assert fact in facts, facts
    # Every stage, in order, each with its row.
    rows = [
        "| anchor: eager (dry run) | passed",
        "| anchor: hand-written CUDAGraph (dry run) | passed",
        "| anchor: PyTorch's trees (dry run) | passed",
        "| build | skipped",
        "| sanity (cpu) | passed",
        "| crash on purpose (GPU_CHECK_CRASH=1) | ",
        "| backtrace: crash on purpose | ",
        "| suite (CPU selection) | passed",
        "| benchmarks (dry run) | passed",
    ]
    positions = [summary.find(row) for row in rows]
    assert -1 not in positions and positions == sorted(positions), (rows, summary)
    crash_row = summary[positions[5] :].splitlines()[0]
    assert "crashed (SIGSEGV)" in crash_row or "pytest workers crashed" in crash_row, crash_row
    # The built extension's check, the anchors (never importing graphtrees), the sanity verdict.
    assert "_ZNSt6locale|_ZNSo9_M_insert': 0 (0 expected" in summary, summary
    assert "NEEDED" in summary
    assert "ANCHOR eager chain_x1: skipped (dry run)" in summary
    assert "ANCHOR pytorch_trees: graphtrees imported in this process: no" in summary
    assert "SANITY: passed (backend cpu-emulation, 2 recordings, 4 replays" in summary
    assert 'TREE_INFO {"device":"cpu"' in summary
    # The crash's native backtrace: the frames of the test that crashed, rerun under gdb.
    traces = summary[summary.index("## Native backtraces") : summary.index("## Stage logs")]
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        assert "test_crashes_on_purpose_for_the_gpu_check" in traces, traces
        assert "received signal SIGSEGV" in traces and "#0 " in traces and "#1 " in traces, traces
        assert "string_at" in traces, traces  # ctypes' native frame, under the crash
        assert (out / "gdb.log").exists()
    else:  # said, not hidden
        assert "no debugger (neither cuda-gdb nor gdb)" in traces, traces
    assert "### suite (CPU selection): passed" in summary  # each stage's log tail
    data = json.loads((out / "anchors.json").read_text())
    assert data["meta"]["dry_run"] is True
    assert set(data["anchors"]) == {"eager", "hand_written", "pytorch_trees"}
    (result,) = [f for f in files if f.startswith("gpu-") and f.endswith(".json")]
    data = json.loads((out / result).read_text())
    assert data["meta"]["dry_run"] is True
    assert data["skipped"] == ["overhead", "memory", "capture", "end_to_end"]


def test_gpu_check_extra_rehearsal(tmp_path):
    r, out = run_gpu_check(tmp_path, "extra")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = (out / "summary.md").read_text()
    for row in ("| build | skipped", "| sanity (cpu) | passed", "| experiments (dry run) | passed"):
        assert row in summary, summary
    for n in range(1, 13):  # one verdict line per experiment of the third review, E1-E12
        assert f"EXP E{n} " in summary, summary
    for key in ("G1", "G4", "G14"):  # and of the fourth's
        assert f"EXP {key} " in summary, summary
    assert "## Anchors" not in summary  # part 1's alone


def test_crashes_on_purpose_for_the_gpu_check():
    """gpu_check's backtrace path, rehearsed: a native crash (SIGSEGV reading address 0), run by
    `GPU_CHECK_CRASH=1 bash scripts/gpu_check.sh` alone."""
    if os.environ.get("GPU_CHECK_CRASH_TEST") != "1":
        pytest.skip("crashes on purpose: set GPU_CHECK_CRASH_TEST=1 (gpu_check's rehearsal does)")
    import ctypes

    ctypes.string_at(0)


@pytest.mark.parametrize("deadline", [3])
def test_gpu_check_stops_stages_at_its_deadline(tmp_path, deadline):
    r, out = run_gpu_check(tmp_path, GPU_CHECK_DEADLINE=str(deadline))
    summary = (out / "summary.md").read_text()
    assert r.returncode != 0
    assert "not run (no time left)" in summary


def test_gpu_check_stops_a_stage_with_sigint_so_pytest_prints_its_summary(tmp_path):
    # The stage helper uses `timeout -s INT`: pytest interrupted that way still prints its
    # failures and its summary line (SIGTERM would lose them). The signal is sent once the hanging
    # test has begun (a marker file), as `timeout` sends it to a stage stuck in a test: a fixed
    # deadline landed inside pytest's start-up on a loaded machine.
    assert "timeout -s INT" in open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    marker = tmp_path / "hanging"
    script = tmp_path / "slow_test.py"
    script.write_text(
        "import pathlib, time\n\ndef test_fails():\n    assert False\n\n"
        f"def test_hangs():\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(120)\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-p", "no:cacheprovider"]
    # SIGINT at its default in the child, as `timeout` leaves it for the command it starts: a run
    # of this suite started in the background by a shell without job control (`cmd &`) ignores
    # SIGINT, which the child would inherit, and Python then installs no KeyboardInterrupt.
    p = subprocess.Popen(
        [*cmd, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the hanging test never began"
        p.send_signal(signal.SIGINT)
        stdout, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout)
    assert "KeyboardInterrupt" in r.stdout or "Interrupted" in r.stdout
    assert "FAILED" in r.stdout and "test_fails" in r.stdout  # the failure survived the stop
