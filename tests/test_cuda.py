"""CUDA-only checks of the CUDA backend (skipped without a GPU and GRAPHTREES_CUDA=1)."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_invariants, info, live_pool_blocks

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

pytestmark = pytest.mark.needs_cuda
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_replay_runs_no_python():
    calls = []

    def f(x):
        calls.append(1)
        return torch.relu(x @ x) + 1

    g = cudagraphify(f)
    x = torch.randn(64, 64, device="cuda")
    for _ in range(5):
        out = g(x)
    torch.testing.assert_close(out, torch.relu(x @ x) + 1)
    assert len(calls) == 2  # warmup and recording only
    assert info("cuda")["backend"] == "cuda-graphs"


def test_seed_story_pool_matches_tracked_outputs_every_step():
    lin = [torch.nn.Linear(256, 256).cuda() for _ in range(3)]
    g1, g2, g3 = (cudagraphify(m) for m in lin)
    x = torch.randn(128, 256, device="cuda")
    for branch in (g2, g2, g2, g3, g3, g3, g2, g3):
        mark_step_begin()
        h = g1(x)
        assert_invariants("cuda")  # checkPoolLiveAllocations against the tracked outputs
        y = branch(h)
        assert_invariants("cuda")
        torch.testing.assert_close(y, branch.__wrapped__(lin[0](x)))
    del h, y
    graphtrees.reset()
    torch.cuda.synchronize()
    assert live_pool_blocks() == 0


def test_transformer_block_replays_bit_identically():
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True).cuda().eval()
    g = cudagraphify(block)
    x = torch.randn(4, 32, 256, device="cuda")
    ref = block(x)
    for _ in range(4):
        out = g(x)
    assert torch.equal(out, ref)
    assert info("cuda")["num_replays"] == 2


def _run_suite_with_env(env_extra, selection):
    env = dict(os.environ, GRAPHTREES_CUDA="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-k", "cuda", *selection],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )


@pytest.mark.skipif(os.environ.get("GRAPHTREES_IN_SUBPROCESS") == "1", reason="no recursion")
def test_behaviour_suite_with_expandable_segments():
    r = _run_suite_with_env(
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GRAPHTREES_IN_SUBPROCESS": "1"},
        ["tests/test_tree_behaviour.py", "tests/test_seed_story.py", "tests/test_property.py"],
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " passed" in r.stdout


def test_cuda_malloc_async_backend_is_refused_with_a_reason():
    code = (
        "import logging, torch, graphtrees\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "g = graphtrees.cudagraphify(lambda x: x + 1)\n"
        "x = torch.ones(4, device='cuda')\n"
        "with torch.no_grad():\n"
        "    for _ in range(3): assert torch.equal(g(x), x + 1)\n"
        "print(graphtrees.tree_info('cuda')['num_fallbacks'])\n"
    )
    env = dict(os.environ, GRAPHTREES_CUDA="1", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "cudaMallocAsync" in r.stderr
