"""The GPU check's plumbing, rehearsed without a GPU: every stage reported, results written, at
most 8 files back (the device machine returns no more)."""

import json
import os
import subprocess

import pytest
from helpers import ROOT


def test_gpu_check_rehearsal(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_REHEARSAL="1", GPU_CHECK_SKIP_BUILD="1")
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    summary = (out / "summary.md").read_text()
    for stage in ("build", "CUDA backend on", "CUDA tests", "expandable segments",
                  "experiments (dry run)", "benchmarks (dry run)"):
        assert f"| {stage} |" in summary, summary
    assert "REHEARSAL" in summary and "exit status 0" in summary
    assert summary.count("EXP ") >= 8  # one verdict line per experiment
    (result,) = [f for f in files if f.startswith("gpu-") and f.endswith(".json")]
    data = json.loads((out / result).read_text())
    assert data["meta"]["dry_run"] is True
    assert data["skipped"] == ["overhead", "end_to_end", "memory", "capture"]


@pytest.mark.parametrize("deadline", [3])
def test_gpu_check_stops_stages_at_its_deadline(tmp_path, deadline):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_REHEARSAL="1", GPU_CHECK_SKIP_BUILD="1",
               GPU_CHECK_DEADLINE=str(deadline))
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    summary = (out / "summary.md").read_text()
    assert r.returncode != 0
    assert "not run (no time left)" in summary
