"""The examples run as README says and check themselves against eager execution."""

import subprocess
import sys

from helpers import ROOT


def _run(*args):
    r = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_seed_tree_example():
    out = _run("examples/seed_tree.py", "--device", "cpu", "--batch", "64", "--width", "256")
    assert "nodes 3, roots 1" in out and "digraph graphtrees" in out
    assert "+0.0 MiB for the second branch" in out


def test_train_mlp_example():
    out = _run("examples/train_mlp.py", "--device", "cpu", "--steps", "6")
    assert "parameters match eager" in out and "graph0.backward" in out


def test_llm_decode_example():
    out = _run("examples/llm_decode.py", "--device", "cpu", "--tokens", "16")
    assert "16 tokens equal to generate()" in out and "digraph graphtrees" in out


def test_diffusion_cfg_example():
    out = _run("examples/diffusion_cfg.py", "--device", "cpu")
    assert "samples equal to eager" in out and "digraph graphtrees" in out


def test_ddp_train_example():
    # Two ranks through torchrun (--standalone: a free port, not the fixed 29500), gloo on CPU.
    out = _run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/ddp_train.py",
        "--steps",
        "6",
    )
    assert "parameters agree across 2 ranks" in out
    for rank in (0, 1):  # each rank printed its own tree: three pieces, forward and backward
        assert f"[rank {rank}] tree on cpu (cpu-emulation): 6 nodes" in out
        assert f"[rank {rank}]   #5 graph0.backward" in out
    assert "replays, 0 eager fallbacks" in out
