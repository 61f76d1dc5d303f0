"""Streams: what the CUDA backend does with the caller's streams (issue 39, section 2).

The pool is shared by every stream a graphed function is called on. The backend orders the
pool's users with one event of its own (Note [Streams of the pool] in csrc/cuda/PoolStreams.cpp),
never keeps a caller's stream, never synchronises the legacy default stream, and never destroys
the tree's own stream. On the CUDA stand-in these run in its stricter modes: a destroyed stream
ends the process (so the scenarios that name one run in a process of their own), and deferred
execution turns a missing stream dependency into a wrong value.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import ROOT, assert_invariants, info

pytestmark = [pytest.mark.needs_cuda, pytest.mark.usefixtures("no_grad")]

# A stream of another library: made and destroyed through the CUDA runtime, wrapped by torch.
RAW_STREAMS = (
    "import ctypes, os\n"
    "_rt = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
    "def raw_stream(flags):\n"
    "    h = ctypes.c_void_p()\n"
    "    assert _rt.cudaStreamCreateWithFlags(ctypes.byref(h), ctypes.c_uint(flags)) == 0\n"
    "    return h.value\n"
    "def destroy_stream(h):\n"
    "    assert _rt.cudaStreamDestroy(ctypes.c_void_p(h)) == 0\n"
)


def _run(code, **env):
    """Runs `code` in a fresh interpreter (graphtrees' CUDA backend on); the finished process."""
    return subprocess.run(
        [sys.executable, "-c", RAW_STREAMS + code],
        env=dict(os.environ, GRAPHTREES_CUDA="1", **env),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )


def _raw_stream(flags):
    namespace = {}
    exec(RAW_STREAMS, namespace)
    return namespace["raw_stream"](flags), namespace["destroy_stream"]


def test_an_external_stream_destroyed_between_rounds_is_never_used_again():
    # A stream of another library (an ExternalStream), used for a record and a replay, then
    # destroyed by its owner: graphtrees kept its raw handle and synchronised it at every later
    # warmup, capture, checkpoint, restore and reset, which a real driver may crash on (the
    # stand-in ends the process) -- and the list of such handles grew without bound.
    code = (
        "import torch, graphtrees\n"
        "from graphtrees import cudagraphify, mark_step_begin\n"
        "x = torch.arange(1 << 16, dtype=torch.float32).cuda()\n"
        "with torch.no_grad():\n"
        "    for round in range(3):\n"
        "        g = cudagraphify(lambda x: x.clone())\n"
        "        h = cudagraphify(lambda x: x[1:].clone())\n"
        "        handle = raw_stream(1)  # cudaStreamNonBlocking\n"
        "        s = torch.cuda.ExternalStream(handle)\n"
        "        s.wait_stream(torch.cuda.current_stream())\n"
        "        with torch.cuda.stream(s):\n"
        "            for _ in range(3):  # warmup, record, replay\n"
        "                mark_step_begin()\n"
        "                y = g(x)\n"
        "            assert torch.equal(y.cpu(), x.cpu())\n"
        "        del y\n"
        "        s.synchronize()\n"
        "        destroy_stream(handle)  # its owner is done with it\n"
        "        for _ in range(3):  # a warmup, a capture and a checkpoint on the default stream\n"
        "            mark_step_begin()\n"
        "            z = h(x)\n"
        "        assert torch.equal(z.cpu(), x[1:].cpu())\n"
        "        del z\n"
        "        graphtrees.reset()\n"
        "        print('round', round, 'done')\n"
    )
    r = _run(code)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "round 2 done" in r.stdout, r.stdout


@pytest.mark.skipif(
    os.environ.get("CUDA_STANDIN") != "1", reason="needs the CUDA stand-in's deferred execution"
)
def test_replays_on_two_streams_are_ordered_in_deferred_mode():
    # Two paths share the pool: g1 -> g2 and g1 -> g3, where g3's output takes memory g2 uses.
    # `with torch.cuda.stream(s1): g2(g1(x))`, then `with torch.cuda.stream(s2): g3(g1(x))`:
    # unordered, s1's replays may run after s2's and overwrite g3's output. In deferred mode the
    # stand-in runs s2 first when it is synchronised first; s2's calls must wait for s1's. (The
    # values move by copies only: x is static, filled by a host copy, and each function clones.)
    code = (
        "import torch, graphtrees\n"
        "from graphtrees import cudagraphify, mark_step_begin\n"
        "n = 1 << 16\n"
        "x = torch.arange(n, dtype=torch.float32).cuda()\n"
        "g1 = cudagraphify(lambda x: x.clone(), static_argnums=(0,))\n"
        "def chain(h):\n"
        "    a = h.clone()\n"
        "    b = a.clone()\n"
        "    return b.clone()\n"
        "g2 = cudagraphify(chain)\n"
        "g3 = cudagraphify(lambda h: h[n // 2 :].clone())\n"
        "with torch.no_grad():\n"
        "    for branch in (g2, g3) * 3:  # both paths warmed up and recorded\n"
        "        mark_step_begin()\n"
        "        branch(g1(x))\n"
        "    torch.cuda.synchronize()\n"
        "    replays = graphtrees.tree_info('cuda')['num_replays']\n"
        "    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()\n"
        "    with torch.cuda.stream(s1):\n"
        "        mark_step_begin()\n"
        "        y = g2(g1(x))\n"
        "    with torch.cuda.stream(s2):\n"
        "        mark_step_begin()\n"
        "        z = g3(g1(x))\n"
        "    s2.synchronize()  # runs s2's work and what it waits for\n"
        "    s1.synchronize()\n"
        "    print('replays', graphtrees.tree_info('cuda')['num_replays'] - replays)\n"
        "    want = torch.arange(n // 2, n, dtype=torch.float32)\n"
        "    print('z right', torch.equal(z.cpu(), want))\n"
    )
    r = _run(code, CUDA_STANDIN_DEFERRED="1")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "replays 4" in r.stdout, r.stdout
    assert "z right True" in r.stdout, r.stdout


def test_a_migration_outside_a_call_follows_the_pools_last_use_in_deferred_mode():
    # Design review 6, H4: an output kept with on_overwrite="copy" is migrated out of the pool
    # outside any call -- at graphtrees.reset(), or when another signature's call evicts its
    # recording (TreeManager::evictFunction, the same order). The migration's copy ran on the
    # current stream without waiting for the replay that writes the output on another stream (in
    # deferred mode the stand-in runs s2 first when it is synchronised first), so the migrated
    # output held an earlier replay's values. (Copies only: the values are real without the value
    # mode. The block the migration takes is cached on s2 beforehand: a cudaMalloc would let the
    # stand-in run every queue.)
    code = (
        "import torch, graphtrees\n"
        "from graphtrees import cudagraphify, mark_step_begin\n"
        "n = 1 << 16\n"
        "g = cudagraphify(lambda t: t.clone(), on_overwrite='copy')\n"
        "x = torch.arange(n, dtype=torch.float32).cuda()\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):  # warmup, record, replay\n"
        "        mark_step_begin()\n"
        "        g(x)\n"
        "    x2 = torch.arange(n, 2 * n, dtype=torch.float32).cuda()\n"
        "    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()\n"
        "    with torch.cuda.stream(s2):\n"
        "        tmp = torch.empty(n, device='cuda')\n"
        "        del tmp\n"
        "    torch.cuda.synchronize()\n"
        "    replays = graphtrees.tree_info('cuda')['num_replays']\n"
        "    with torch.cuda.stream(s1):\n"
        "        mark_step_begin()\n"
        "        y = g(x2)  # a replay, queued on s1\n"
        "    print('replayed', graphtrees.tree_info('cuda')['num_replays'] - replays)\n"
        "    s2.wait_stream(torch.cuda.current_stream())\n"
        "    with torch.cuda.stream(s2):\n"
        "        graphtrees.reset()  # y is copied out of the pool\n"
        "    s2.synchronize()  # runs s2's work and what it waits for\n"
        "    s1.synchronize()\n"
        "    print('y right', torch.equal(y.cpu(), x2.cpu()))\n"
    )
    r = _run(code, CUDA_STANDIN_DEFERRED="1")
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "replayed 1" in r.stdout, r.stdout
    assert "y right True" in r.stdout, r.stdout


def test_the_trees_stream_outlives_the_tree():
    # Objects made during a warmup may name the tree's own stream: a torch.cuda.Stream taken
    # there, a record_stream() of the caller's tensor on it (c10 records an event on that stream
    # when the tensor is freed). The stream was destroyed with the tree at reset().
    code = (
        "import gc, torch, graphtrees\n"
        "seen = []\n"
        "def f(x):\n"
        "    seen.append(torch.cuda.current_stream())  # the tree's stream\n"
        "    x.record_stream(torch.cuda.current_stream())  # x is used on it too\n"
        "    return x.clone()\n"
        "g = graphtrees.cudagraphify(f)\n"
        "x = torch.ones(1 << 16).cuda()\n"
        "with torch.no_grad():\n"
        "    y = g(x)  # a warmup\n"
        "del y\n"
        "graphtrees.reset(); gc.collect()\n"
        "del x  # c10 records an event on every stream the block was used on\n"
        "seen[0].synchronize()\n"
        "torch.cuda.synchronize(); torch.cuda.empty_cache()\n"
        "h = graphtrees.cudagraphify(lambda x: x.clone())\n"
        "with torch.no_grad():\n"
        "    for _ in range(3): h(torch.ones(8).cuda())\n"
        "print('survived', graphtrees.tree_info('cuda')['num_replays'])\n"
    )
    r = _run(code)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "survived 1" in r.stdout, r.stdout


def test_a_blocking_stream_capturing_in_another_thread_is_left_alone():
    # The legacy default stream was noted as a stream of the pool (the first calls ran on it),
    # so later warmups synchronised it: cudaStreamSynchronize(0) waits for every blocking stream,
    # which is illegal while another thread captures on one (thread-local mode), and broke that
    # capture. Calls made from a non-blocking stream meanwhile must leave it alone.
    handle, destroy = _raw_stream(0)  # a blocking stream
    try:
        blocking = torch.cuda.ExternalStream(handle)
        g = cudagraphify(lambda x: x.clone())
        x = torch.ones(1 << 16, device="cuda")
        for _ in range(3):  # on the legacy default stream: warmup, record, replay
            mark_step_begin()
            g(x)
        torch.cuda.synchronize()
        started, release = threading.Event(), threading.Event()
        errors = []
        graph = torch.cuda.CUDAGraph()
        a = torch.ones(1 << 10, device="cuda")

        def capture():
            try:
                with (
                    torch.no_grad(),
                    torch.cuda.graph(graph, stream=blocking, capture_error_mode="thread_local"),
                ):
                    a.clone()
                    started.set()
                    release.wait(60)
            except Exception as e:  # noqa: BLE001 -- reported by the assertion below
                errors.append(e)
            finally:
                started.set()

        side = torch.cuda.Stream()  # non-blocking
        side.wait_stream(torch.cuda.current_stream())
        t = threading.Thread(target=capture)
        t.start()
        assert started.wait(60)
        try:
            h = cudagraphify(lambda x: x[1:].clone())
            with torch.cuda.stream(side):
                mark_step_begin()
                h(x)  # a warmup: the pool's streams are waited for
        finally:
            release.set()
            t.join(60)
        assert not errors, errors
        graph.replay()
        torch.cuda.synchronize()
        assert info("cuda")["num_warmups"] == 2
        assert_invariants("cuda")
    finally:
        torch.cuda.synchronize()
        destroy(handle)


def test_sync_debug_mode_error_around_a_cycle():
    # torch.cuda.set_sync_debug_mode("error") is the user's check of the user's code; the syncs
    # graphtrees needs for its own bookkeeping (a warmup, a capture, a checkpoint, a restore, a
    # reset) must not raise under it.
    g = cudagraphify(lambda x: x.clone())
    h = cudagraphify(lambda x: x[1:].clone())
    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(6):  # g -> h twice, then g -> g: a second branch, a restore
            mark_step_begin()
            y = g(x)
            z = (h if step < 4 else g)(y)
            del y, z
        t = info("cuda")
        graphtrees.reset()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert t["num_recordings"] == 3 and t["num_replays"] > 0, t
    assert t["num_checkpoints"] >= 1, t  # the second branch restored the pool


def test_a_sync_debug_mode_set_during_graphtrees_own_syncs_is_kept():
    # graphtrees turns the mode off around its own syncs and puts the user's back afterwards;
    # a mode set meanwhile (by the user, on another thread) is the newer word and must stay.
    # Before, the scope's end put back the mode from before it, undoing the user's.
    within = graphtrees._ext.get_ext()._in_own_sync_scope
    torch.cuda.set_sync_debug_mode("warn")
    try:
        assert within(torch.cuda.get_sync_debug_mode) == 0  # off inside
        assert torch.cuda.get_sync_debug_mode() == 1  # the user's "warn" is back
        within(lambda: torch.cuda.set_sync_debug_mode("error"))
        assert torch.cuda.get_sync_debug_mode() == 2  # set inside: kept
    finally:
        torch.cuda.set_sync_debug_mode(0)
