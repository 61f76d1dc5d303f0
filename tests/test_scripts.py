"""The GPU check's plumbing, rehearsed without a GPU: every stage reported, results written, at
most 8 files back (the device machine returns no more)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def test_gpu_check_rehearsal(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_REHEARSAL="1", GPU_CHECK_SKIP_BUILD="1")
    r = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    summary = (out / "summary.md").read_text()
    for stage in (
        "build",
        "CUDA backend on",
        "priority tests",
        "CUDA tests",
        "expandable segments",
        "experiments (dry run)",
        "benchmarks (dry run)",
    ):
        assert f"| {stage} |" in summary, summary
    assert "REHEARSAL" in summary and "exit status 0" in summary
    for n in range(1, 13):  # one verdict line per experiment of the third review, E1-E12
        assert f"EXP E{n} " in summary, summary
    for key in ("G1", "G4", "G14"):  # and of the fourth's
        assert f"EXP {key} " in summary, summary
    assert "### experiments (dry run): passed" in summary  # each stage's log tail
    assert not (out / ".tails").exists()
    (result,) = [f for f in files if f.startswith("gpu-") and f.endswith(".json")]
    data = json.loads((out / result).read_text())
    assert data["meta"]["dry_run"] is True
    assert data["skipped"] == ["overhead", "memory", "capture", "end_to_end"]


@pytest.mark.parametrize("deadline", [3])
def test_gpu_check_stops_stages_at_its_deadline(tmp_path, deadline):
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        GPU_CHECK_REHEARSAL="1",
        GPU_CHECK_SKIP_BUILD="1",
        GPU_CHECK_DEADLINE=str(deadline),
    )
    r = subprocess.run(
        ["bash", "scripts/gpu_check.sh"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (out / "summary.md").read_text()
    assert r.returncode != 0
    assert "not run (no time left)" in summary


def test_gpu_check_stops_a_stage_with_sigint_so_pytest_prints_its_summary(tmp_path):
    # The stage helper uses `timeout -s INT`: pytest interrupted that way still prints its
    # failures and its summary line (SIGTERM would lose them).
    script = tmp_path / "slow_test.py"
    script.write_text(
        "import time\n\ndef test_fails():\n    assert False\n\n"
        "def test_hangs():\n    time.sleep(60)\n"
    )
    r = subprocess.run(
        [
            "timeout",
            "-s",
            "INT",
            "--kill-after=15",
            "8",
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "--tb=short",
            "-rfE",
            "-p",
            "no:cacheprovider",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "KeyboardInterrupt" in r.stdout or "Interrupted" in r.stdout
    assert "FAILED" in r.stdout and "test_fails" in r.stdout  # the failure survived the stop
