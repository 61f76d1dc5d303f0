"""The examples run as README says and check themselves against eager execution; README's set-up
commands and quick start are the ones that work."""

import os
import re
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


def _readme_blocks(section, lang):
    """The ```lang code blocks of README's `## section`."""
    text = open(os.path.join(ROOT, "README.md")).read()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"^```{lang}\n(.*?)^```", body, re.M | re.S)


def test_readme_set_up_commands_are_the_ones_that_run():
    # Command 1 installs the torch run_tests.sh pins and runs the main example (whose run on CPU
    # test_seed_tree_example checks); command 2 is what .ci/run runs.
    install, tests = _readme_blocks("Set-up: two commands", "bash")
    assert install.strip().endswith(
        "python -m pip install --no-build-isolation --no-deps -e . && python examples/seed_tree.py"
    )
    assert "torch==2.14.1" in install
    assert "torch==2.14.1" in open(os.path.join(ROOT, "scripts", "run_tests.sh")).read()
    assert tests == "bash scripts/run_tests.sh\n"
    assert "\nbash scripts/run_tests.sh\n" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_readme_quick_start_runs_as_written():
    quick, compile_line = _readme_blocks("Quick start", "python")
    assert 'torch.compile(model, backend="graphtrees")' in compile_line
    out = _run("-c", quick + compile_line)
    assert out.strip() == "8"  # 10 calls: a warmup, a recording, 8 replays, as its comment says
