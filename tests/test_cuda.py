"""CUDA-only checks of the CUDA backend (skipped without a GPU and GRAPHTREES_CUDA=1)."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, assert_invariants, info, live_pool_blocks

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

pytestmark = [pytest.mark.needs_cuda, pytest.mark.usefixtures("no_grad")]


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


def _run_suite_with_env(env_extra, selection, timeout):
    env = dict(os.environ, GRAPHTREES_CUDA="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "cuda",
         *selection],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_behaviour_suite_with_expandable_segments():
    # Its own stage in scripts/gpu_check.sh (selected with -k expandable); the property test runs
    # with fewer examples there (GRAPHTREES_HYPOTHESIS_EXAMPLES).
    r = _run_suite_with_env(
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
         "GRAPHTREES_HYPOTHESIS_EXAMPLES": os.environ.get("GRAPHTREES_HYPOTHESIS_EXAMPLES", "20")},
        ["tests/test_tree_behaviour.py", "tests/test_seed_story.py", "tests/test_property.py",
         "tests/test_hardening.py"],
        timeout=int(os.environ.get("GRAPHTREES_EXPANDABLE_TIMEOUT", "900")),
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " passed" in r.stdout


def _private_pool_segments():
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]


def _use_a_tree(n=3):
    g1 = cudagraphify(lambda x: (x @ x).relu())
    g2 = cudagraphify(lambda a: a * 2 + 1)
    x = torch.randn(512, 512, device="cuda")
    for _ in range(n):
        mark_step_begin()
        out = g2(g1(x))
    torch.testing.assert_close(out, (x @ x).relu() * 2 + 1)


def test_reset_gives_the_pool_memory_back():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    _use_a_tree()
    assert torch.cuda.memory_reserved() > before
    graphtrees.reset()
    assert _private_pool_segments() == []
    # The default pool may keep what eager code cached (x, the reference); nothing of the tree.
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == before


def test_create_and_reset_cycles_do_not_grow_reserved_memory():
    reserved = []
    for _ in range(30):
        _use_a_tree()
        graphtrees.reset()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[0], reserved
    assert _private_pool_segments() == []


def test_create_and_reset_cycles_with_expandable_segments():
    code = (
        "import torch, graphtrees\n"
        "from graphtrees import cudagraphify\n"
        "res = []\n"
        "with torch.no_grad():\n"
        "    for i in range(100):\n"
        "        g = cudagraphify(lambda x: x * 2 + 1)\n"
        "        x = torch.randn(1 << 20, device='cuda')\n"
        "        for _ in range(3): g(x)\n"
        "        graphtrees.reset(); torch.cuda.empty_cache()\n"
        "        res.append(torch.cuda.memory_reserved())\n"
        "print(res[0], res[-1])\n"
        "assert res[-1] == res[0], res\n"
    )
    env = dict(os.environ, GRAPHTREES_CUDA="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rejected_capture_leaves_the_allocator_clean():
    g = cudagraphify(lambda x: x[x > 0].sum())
    x = torch.randn(64, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(g(x), x[x > 0].sum())
    (sig,) = g.signatures()
    assert "cannot be recorded" in sig["eager_reason"]
    # Later captures, graphtrees' and PyTorch's own, are unaffected.
    h = cudagraphify(lambda x: x * 3)
    for _ in range(3):
        torch.testing.assert_close(h(x), x * 3)
    assert info("cuda")["num_replays"] >= 1
    graph = torch.cuda.CUDAGraph()
    static = torch.ones(16, device="cuda")
    with torch.cuda.graph(graph):
        out = static * 2
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.full((16,), 2.0, device="cuda"))
    del graph, out
    graphtrees.reset()
    torch.cuda.empty_cache()
    assert _private_pool_segments() == []


def test_injected_capture_end_failure_is_a_real_invalidation():
    g = cudagraphify(lambda x: x.cos())
    x = torch.randn(64, device="cuda")
    g(x)
    graphtrees._ext.get_ext()._inject_failure("capture_end", 1)
    for _ in range(3):
        torch.testing.assert_close(g(x), x.cos())
    assert "cannot be recorded" in g.signatures()[0]["eager_reason"]
    k = cudagraphify(lambda x: x + 1)
    for _ in range(3):
        torch.testing.assert_close(k(x), x + 1)
    graphtrees.reset()
    torch.cuda.empty_cache()
    assert _private_pool_segments() == []


def test_device_side_assert_surfaces_as_an_exception_not_an_abort():
    code = (
        "import torch, graphtrees\n"
        "g = graphtrees.cudagraphify(lambda x, i: x[i] * 2)\n"
        "x = torch.randn(8, device='cuda')\n"
        "bad = torch.tensor([100], device='cuda')\n"
        "try:\n"
        "    with torch.no_grad(): g(x, bad); torch.cuda.synchronize()\n"
        "except RuntimeError as e:\n"
        "    print('call raised:', type(e).__name__)\n"
        "try:\n"
        "    graphtrees.reset()\n"
        "except RuntimeError as e:\n"
        "    print('reset raised:', type(e).__name__)\n"
        "print('survived')\n"
    )
    env = dict(os.environ, GRAPHTREES_CUDA="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "call raised" in r.stdout and "survived" in r.stdout


def test_warmup_runs_on_the_trees_device_and_stream():
    seen = []

    def f(x):
        seen.append((torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream))
        return torch.ones(4, device="cuda") + x  # a bare "cuda" tensor lands in the pool

    g = cudagraphify(f)
    x = torch.randn(4, device="cuda")
    out = g(x)
    default = torch.cuda.current_stream().cuda_stream
    assert seen[0][0] == x.device.index and seen[0][1] != default
    torch.testing.assert_close(out, x + 1)
    assert_invariants("cuda")


def test_autocast_weight_cache_is_not_baked_into_the_graph():
    lin = torch.nn.Linear(256, 256).cuda()
    g = cudagraphify(lin)
    other = cudagraphify(lambda x: torch.randn_like(x) * 0 + x * 2)
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        with torch.autocast("cuda", torch.bfloat16):
            g(x)
    for _ in range(3):
        other(torch.randn(1024, 1024, device="cuda"))
    with torch.autocast("cuda", torch.bfloat16):
        y = g(x)
        ref = lin(x)
    torch.testing.assert_close(y, ref)


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


def test_memory_budget_refuses_growth_and_restores_the_memory_fraction(tree_logs):
    # Note [Memory budget]: c10's per-process fraction is lowered while the pool allocates and
    # put back afterwards; a warmup that needs more than the budget runs eagerly.
    before = torch.cuda.get_per_process_memory_fraction(0)
    small = cudagraphify(lambda x: x + 1)
    x = torch.ones(1024, device="cuda")
    for _ in range(3):
        small(x)
    budget = info("cuda")["pool"]["reserved_bytes"] + (8 << 20)
    graphtrees.set_memory_budget("cuda", budget)
    big = cudagraphify(lambda x: x.repeat(64 << 10))  # 256 MiB
    for _ in range(3):
        torch.testing.assert_close(big(x), x.repeat(64 << 10))
    t = info("cuda")
    assert t["num_out_of_memory"] == 1 and t["memory_budget"] == budget
    assert t["pool"]["reserved_bytes"] <= budget
    assert "ran out of memory while warming it up" in tree_logs.text
    assert torch.cuda.get_per_process_memory_fraction(0) == before
    torch.testing.assert_close(small(x), x + 1)  # the tree still replays
    graphtrees.set_memory_budget("cuda", None)
    assert_invariants("cuda")


def _one_rank_group(tmp_path, backend):
    import torch.distributed as dist

    kwargs = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, **kwargs)
    return dist


def _double_all_reduce_plus_one(x):
    import torch.distributed as dist

    y = x * 2
    dist.all_reduce(y)  # one rank: the sum is the value
    return y + 1


def test_nccl_all_reduce_is_captured_and_replayed(tmp_path):
    # README "Distributed": NCCL collectives can be captured; the group exists (and its
    # communicator, through device_id) before the recording, and the warmup runs the first one.
    dist = _one_rank_group(tmp_path, "nccl")
    try:
        g = cudagraphify(_double_all_reduce_plus_one)
        for i in range(5):
            x = torch.full((16,), float(i), device="cuda")
            torch.testing.assert_close(g(x), x * 2 + 1)
        t = info("cuda")
        assert t["num_replays"] == 3 and t["num_fallbacks"] == 0
        assert t["backend"] == "cuda-graphs"
    finally:
        dist.destroy_process_group()
    assert_invariants("cuda")


def test_gloo_on_cuda_tensors_runs_eagerly_with_the_reason(tmp_path, tree_logs):
    # gloo copies CUDA tensors to the host and synchronises: the capture fails, the function runs
    # eagerly from then on, and the result is right.
    dist = _one_rank_group(tmp_path, "gloo")
    try:
        g = cudagraphify(_double_all_reduce_plus_one)
        for i in range(4):
            x = torch.full((16,), float(i), device="cuda")
            torch.testing.assert_close(g(x), x * 2 + 1)
        t = info("cuda")
        assert t["num_nodes"] == 0 and t["num_fallbacks"] >= 2
        assert "it cannot be recorded as a graph" in tree_logs.text
    finally:
        dist.destroy_process_group()
    assert_invariants("cuda")
