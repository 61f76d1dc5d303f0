"""The CUDA stand-in itself (tests/cuda_standin): what it models, checked through real torch.

These run only on the stand-in; graphtrees' own CUDA tests run on it through the suite's cuda
parametrisations (`-m needs_cuda` with GRAPHTREES_CUDA=1, see scripts/run_tests.sh)."""

import ctypes
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from cuda_standin.standin import LIBRARIES

from helpers import ROOT, STANDIN

pytestmark = [
    pytest.mark.needs_cuda,
    pytest.mark.skipif(STANDIN is None, reason="checks the CUDA stand-in, which is not loaded"),
]


def cudart():
    return ctypes.CDLL("libcudart.so.13", mode=os.RTLD_NOLOAD)


def run_process(code, **env):
    """Runs `code` in a fresh interpreter on the stand-in (this process's environment, changed by
    `env`: a value of None removes the variable); returns the finished process, crashed or not."""
    environ = dict(os.environ)
    for k, v in env.items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def run_on_standin(code, **env):
    """Runs `code` in a fresh interpreter on the stand-in (this process's environment)."""
    r = run_process(code, **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def preloaded_libraries():
    """The stand-in's libraries this process runs on, as LD_PRELOAD names them."""
    paths = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    found = [p for p in paths if os.path.basename(p) in LIBRARIES]
    assert sorted(os.path.basename(p) for p in found) == sorted(LIBRARIES), paths
    return found


def test_it_is_one_device_whose_memory_is_the_hosts():
    assert torch.cuda.device_count() == 1
    assert "stand-in" in torch.cuda.get_device_name(0)
    assert torch.cuda.get_device_capability(0) == (9, 0)
    stats = STANDIN.stats()
    assert torch.cuda.get_device_properties(0).total_memory == stats["capacity"]
    before = STANDIN.stats()["bytes_in_use"]
    x = torch.empty(3 << 20, device="cuda", dtype=torch.uint8)
    assert STANDIN.stats()["bytes_in_use"] >= before  # c10 caches: at most one new segment
    assert STANDIN.is_device_memory(x.data_ptr(), x.numel())


def test_copies_move_bytes_and_kernels_do_not_run():
    host = torch.arange(12, dtype=torch.float32)
    a = host.cuda()  # a host-to-device copy: real bytes
    assert torch.equal(a.clone().cpu(), host)  # a device-to-device copy, then back
    b = a + 1  # a kernel: launched, never run
    assert STANDIN.kernel_count("") > 0
    torch.cuda.empty_cache()  # not a cached block an earlier test wrote
    fresh = torch.empty(1 << 18, device="cuda")  # new memory is poisoned (0xFF: NaN)
    assert torch.isnan(fresh.cpu()).any() or torch.isnan(b.cpu()).any()


def test_device_memory_ends_at_the_capacity():
    torch.cuda.empty_cache()
    cap = STANDIN.stats()["capacity"]
    try:
        STANDIN.set_capacity(STANDIN.stats()["bytes_in_use"] + (64 << 20))
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        torch.empty(16 << 20, dtype=torch.uint8, device="cuda")  # within it: fine
    finally:
        STANDIN.set_capacity(cap)


def test_an_allocation_can_be_made_to_fail():
    torch.cuda.empty_cache()
    STANDIN.fail_allocation(1)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a new segment: cudaMalloc
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the next one succeeds
    assert STANDIN.stats()["oom"] >= 1


def test_a_graph_replays_its_copies():
    src = torch.zeros(16, device="cuda")
    src.copy_(torch.arange(16.0))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = src.clone()
    for k in range(3):
        src.copy_(torch.full((16,), float(k)))
        g.replay()
        assert torch.equal(out.cpu(), torch.full((16,), float(k)))
    assert STANDIN.stats()["graph_launches"] >= 3


# A capture that fails leaves torch 2.11's allocator routed into the graph's pool (its
# capture_end() throws before it ends the routing, so every later emptyCache() asserts): the
# checks that make torch's own captures fail run in a process of their own.
FORBIDDEN = (
    "import torch, sys\n"
    "sys.path.insert(0, 'tests')\n"
    "from cuda_standin.standin import current\n"
    "s = current()\n"
    "x = torch.ones(8, device='cuda')\n"
    "event = torch.cuda.Event()\n"
    "def attempt(name, body, mode='global'):\n"
    "    before = s.stats()['captures_invalidated']\n"
    "    g = torch.cuda.CUDAGraph()\n"
    "    try:\n"
    "        with torch.cuda.graph(g, capture_error_mode=mode):\n"
    "            body()\n"
    "        outcome = 'captured'\n"
    "    except RuntimeError as e:\n"
    "        outcome = 'failed'\n"
    "    invalidated = s.stats()['captures_invalidated'] - before\n"
    "    print(name, outcome, invalidated, torch.cuda.is_current_stream_capturing(),\n"
    "          s.last_message().replace(' ', '_')[:200])\n"
)


def _forbidden(body_lines):
    out = run_on_standin(FORBIDDEN + body_lines, CUDA_STANDIN_QUIET="1")
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


def test_calls_a_capture_forbids_invalidate_it():
    results = _forbidden(
        "attempt('device_sync', lambda: torch.cuda.synchronize())\n"
        "attempt('stream_sync', lambda: torch.cuda.current_stream().synchronize())\n"
        "attempt('stream_query', lambda: torch.cuda.current_stream().query())\n"
        "attempt('item', lambda: (x * 2).sum().item())\n"
        "def event_sync():\n"
        "    event.record(); event.synchronize()\n"
        "attempt('event_sync', event_sync)\n"
        "torch.cuda.synchronize()  # the device is usable afterwards\n"
    )
    for call in ("device_sync", "stream_sync", "stream_query", "item", "event_sync"):
        outcome, invalidated, capturing, _message = results[call]
        assert (outcome, invalidated, capturing) == ("failed", "1", "False"), (call, results[call])


def test_a_side_stream_left_unjoined_fails_the_capture():
    results = _forbidden(
        "side = torch.cuda.Stream()\n"
        "def fork():\n"
        "    side.wait_stream(torch.cuda.current_stream())\n"
        "    with torch.cuda.stream(side):\n"
        "        x.clone()  # forked onto `side`, never joined back\n"
        "attempt('unjoined', fork)\n"
    )
    outcome, _invalidated, capturing, message = results["unjoined"]
    assert outcome == "failed" and capturing == "False" and "unjoined" in message


def test_the_modes_decide_what_another_thread_may_do():
    # A global capture forbids another thread's event queries (what c10's allocator does on its
    # way); a thread-local one does not.
    results = _forbidden(
        "import threading\n"
        "seen = {}\n"
        "def query_from_another_thread(key):\n"
        "    def run():\n"
        "        try:\n"
        "            event.query(); seen[key] = 'allowed'\n"
        "        except RuntimeError:\n"
        "            seen[key] = 'forbidden'\n"
        "    def body():\n"
        "        x.clone()\n"
        "        t = threading.Thread(target=run); t.start(); t.join()\n"
        "    return body\n"
        "event.record(); torch.cuda.synchronize()\n"
        "attempt('thread_local', query_from_another_thread('thread_local'), 'thread_local')\n"
        "attempt('global', query_from_another_thread('global'), 'global')\n"
        "print('query', seen['thread_local'], seen['global'])\n"
    )
    assert results["query"] == ["allowed", "forbidden"]
    assert results["thread_local"][0] == "captured" and results["global"][0] == "failed"


def test_a_failure_can_be_injected_into_instantiation():
    results = _forbidden(
        "s.fail_next('cudaGraphInstantiateWithFlags', 2)  # cudaErrorMemoryAllocation\n"
        "attempt('instantiate', lambda: x.clone())\n"
    )
    outcome, _invalidated, _capturing, message = results["instantiate"]
    assert outcome == "failed" and "injected" in message


def test_a_joined_side_stream_is_captured():
    x = torch.ones(8, device="cuda")
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x.clone()
        torch.cuda.current_stream().wait_stream(side)
    x.copy_(torch.full((8,), 3.0))
    g.replay()
    assert torch.equal(y.cpu(), torch.full((8,), 3.0))


def test_a_graph_node_whose_memory_was_freed_is_a_device_fault():
    code = (
        "import torch, ctypes, os\n"
        "lib = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
        "src = torch.zeros(1 << 20, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    out = src.clone()\n"
        "del src\n"
        "torch.cuda.synchronize(); torch.cuda.empty_cache()  # its segment is cudaFree'd\n"
        "g.replay()\n"
        "try:\n"
        "    torch.cuda.synchronize()\n"
        "    print('no fault')\n"
        "except RuntimeError as e:\n"
        "    print('fault:', 'illegal memory access' in str(e))\n"
    )
    out = run_on_standin(code, CUDA_STANDIN_QUIET="1")
    assert "fault: True" in out, out


def test_deferred_mode_turns_a_missing_stream_dependency_into_a_wrong_value():
    code = (
        "import torch\n"
        "a = torch.zeros(1 << 16, device='cuda')\n"
        "torch.cuda.synchronize()\n"
        "a.copy_(torch.ones(1 << 16).pin_memory(), non_blocking=True)  # queued on the stream\n"
        "side = torch.cuda.Stream()\n"
        "{wait}"
        "with torch.cuda.stream(side):\n"
        "    b = a.clone()  # side runs when it is waited for; the copy above may not have\n"
        "side.synchronize()\n"
        "print('right' if bool((b.cpu() == 1).all()) else 'wrong')\n"
    )
    missing = run_on_standin(code.format(wait=""), CUDA_STANDIN_DEFERRED="1")
    joined = run_on_standin(
        code.format(wait="side.wait_stream(torch.cuda.current_stream())\n"),
        CUDA_STANDIN_DEFERRED="1",
    )
    eager = run_on_standin(code.format(wait=""))
    assert missing.strip().endswith("wrong") and joined.strip().endswith("right")
    assert eager.strip().endswith("right")  # eager mode runs everything at once


def test_synchronising_the_legacy_stream_while_a_blocking_stream_captures_is_refused():
    # The legacy default stream waits for every blocking stream: synchronising it while another
    # thread captures on one (thread-local mode, which frees other threads of the unsafe-call
    # rule) is cudaErrorStreamCaptureImplicit, and the capture is invalidated.
    code = (
        "import ctypes, os, threading, torch\n"
        "rt = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
        "h = ctypes.c_void_p()\n"
        "assert rt.cudaStreamCreateWithFlags(ctypes.byref(h), ctypes.c_uint({flags})) == 0\n"
        "s = torch.cuda.ExternalStream(h.value)\n"
        "a = torch.ones(1024, device='cuda')\n"
        "torch.cuda.synchronize()\n"
        "started, release, result = threading.Event(), threading.Event(), []\n"
        "def capture():\n"
        "    try:\n"
        "        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s,\n"
        "                              capture_error_mode='thread_local'):\n"
        "            a.clone(); started.set(); release.wait(60)\n"
        "        result.append('captured')\n"
        "    except RuntimeError as e:\n"
        "        result.append('capture failed')\n"
        "    started.set()\n"
        "t = threading.Thread(target=capture); t.start(); started.wait(60)\n"
        "try:\n"
        "    torch.cuda.default_stream().synchronize()\n"
        "    print('sync ok')\n"
        "except RuntimeError as e:\n"
        "    print('sync refused:', 'legacy' in str(e) or 'implicit' in str(e).lower())\n"
        "torch.cuda.Stream().synchronize()  # a non-blocking stream: legal\n"
        "release.set(); t.join()\n"
        "print(result[0])\n"
    )
    blocking = run_on_standin(code.format(flags=0), CUDA_STANDIN_QUIET="1")
    assert "sync refused: True" in blocking and "capture failed" in blocking, blocking
    non_blocking = run_on_standin(code.format(flags=1), CUDA_STANDIN_QUIET="1")
    assert "sync ok" in non_blocking and "captured" in non_blocking, non_blocking


def test_expandable_segments_map_virtual_memory():
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from cuda_standin.standin import current\n"
        "s = current()\n"
        "x = torch.arange(1 << 20, dtype=torch.float32).cuda()\n"
        "y = x.clone()\n"
        "assert torch.equal(y.cpu(), torch.arange(1 << 20, dtype=torch.float32))\n"
        "assert s.stats()['vmm_mapped_bytes'] > 0\n"
        "del x, y; torch.cuda.empty_cache()\n"
        "print('mapped after', s.stats()['vmm_mapped_bytes'])\n"
    )
    out = run_on_standin(code, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert "mapped after 0" in out, out


def test_cublas_gemms_are_kernels_on_the_handles_stream():
    before = STANDIN.kernel_count("cublas")
    lin = torch.nn.Linear(64, 64).cuda()
    g = torch.cuda.CUDAGraph()
    x = torch.ones(8, 64, device="cuda")
    with torch.no_grad():
        lin(x)  # the handle and its workspace are made outside the capture
        with torch.cuda.graph(g):
            lin(x)
    assert STANDIN.kernel_count("cublas") > before
    assert STANDIN.stats()["kernel_nodes"] > 0
    # The capture's stream got a cuBLAS workspace of its own, in the graph's pool.
    del g
    torch._C._cuda_clearCublasWorkspaces()


def test_kernels_torch_compiles_with_nvrtc_are_recorded_like_any_other():
    # The jiterator (complex abs, special functions) and a complex negative view's resolution
    # compile with NVRTC: the real one crashed the process here (Note [Stand-in NVRTC]).
    z = torch.zeros(16, dtype=torch.complex64, device="cuda")
    before = STANDIN.stats()["kernel_launches"]
    assert torch.abs(z).dtype == torch.float32
    assert torch.special.i0(torch.zeros(4, device="cuda")).shape == (4,)
    assert not torch._neg_view(z).resolve_neg().is_neg()
    assert STANDIN.stats()["kernel_launches"] >= before + 3
    g = torch.cuda.CUDAGraph()
    out = torch.empty(16, device="cuda")
    with torch.cuda.graph(g):
        torch.abs(z, out=out)
    g.replay()
    assert STANDIN.stats()["kernel_nodes"] > 0


def test_unmodelled_calls_fail_naming_themselves():
    lib = cudart()
    err = lib.cudaIpcGetMemHandle(ctypes.create_string_buffer(64), ctypes.c_void_p(0))
    assert err == 801  # cudaErrorNotSupported
    assert "IPC is not modelled" in STANDIN.last_message()
    fn = ctypes.c_void_p()
    status = ctypes.c_int(-1)
    assert (
        lib.cudaGetDriverEntryPointByVersion(
            b"cuNotAFunction", ctypes.byref(fn), 13000, 0, ctypes.byref(status)
        )
        == 0
    )
    assert fn.value is None and status.value == 1  # cudaDriverEntryPointSymbolNotFound
    assert lib.cudaGetLastError() == 801  # as the runtime does; and it is cleared now


def _torch_has_conditional_nodes():
    return hasattr(torch._C._CUDAGraph, "begin_capture_to_while_node")


_CONDITIONAL_NODES = pytest.mark.skipif(
    not _torch_has_conditional_nodes(),
    reason="this torch's CUDAGraph cannot capture conditional nodes (torch 2.11 has none)",
)


@_CONDITIONAL_NODES
@pytest.mark.needs_values("the predicates are computed on the device")
def test_conditional_nodes_run_the_bodies_their_predicates_pick():
    # Note [Stand-in conditional nodes]: an IF node's body runs when its handle's value is
    # non-zero, a WHILE node's body while it is, the value set on the device by torch's kernel.
    x = torch.zeros(4, device="cuda")
    i = torch.zeros((), dtype=torch.long, device="cuda")
    pred = torch.zeros((), dtype=torch.bool, device="cuda")
    limit = torch.zeros((), dtype=torch.long, device="cuda")
    g = torch.cuda.CUDAGraph()
    before = STANDIN.stats()
    with torch.cuda.graph(g):
        g.begin_capture_to_if_node(pred)
        x.add_(1)
        g.end_capture_to_conditional_node()
        i.zero_()
        g.begin_capture_to_while_node(i < limit)
        i.add_(1)
        x.mul_(2)
        g.set_conditional_handle_for_current_node(i < limit)
        g.end_capture_to_conditional_node()
    assert STANDIN.stats()["conditional_nodes"] - before["conditional_nodes"] == 2
    expected = torch.zeros(4)
    for p, n in ((True, 0), (False, 3), (True, 1), (False, 0), (True, 5)):
        pred.fill_(p)
        limit.fill_(n)
        runs = STANDIN.stats()["conditional_runs"]
        g.replay()
        torch.cuda.synchronize()
        expected = (expected + (1 if p else 0)) * 2**n
        assert torch.equal(x.cpu(), expected), (p, n, x.cpu(), expected)
        assert int(i) == n
        assert STANDIN.stats()["conditional_runs"] - runs == int(p) + n


@_CONDITIONAL_NODES
@pytest.mark.parametrize(
    "call, made",
    [
        ("lib.cudaLaunchHostFunc(s, callback, None)", "cudaLaunchHostFunc"),
        ("lib.cudaEventRecordWithFlags(ev, s, 1)", "cudaEventRecordWithFlags"),  # external
    ],
)
def test_a_conditional_body_takes_no_host_function_or_event_node(call, made):
    # The driver allows kernels, copies, memsets, empty and conditional nodes in a body: a host
    # function or an external event record captured there fails and invalidates the capture (in
    # a process of its own: the failed capture leaves torch's graph half-ended).
    out = run_process(
        "import ctypes, os, torch\n"
        "lib = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
        "callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)\n"
        "ev = ctypes.c_void_p()\n"
        "assert lib.cudaEventCreateWithFlags(ctypes.byref(ev), 0) == 0\n"
        "pred = torch.ones((), dtype=torch.bool, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "try:\n"
        "    with torch.cuda.graph(g):\n"
        "        g.begin_capture_to_if_node(pred)\n"
        "        s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)\n"
        f"        print('in a body:', {call}, flush=True)\n"
        "        g.end_capture_to_conditional_node()\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__, flush=True)\n"
        "os._exit(0)\n"
    )
    assert "in a body: 900" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "raised" in out.stdout
    assert f"{made}" in out.stderr and "conditional node's body" in out.stderr, out.stderr[-2000:]


@_CONDITIONAL_NODES
def test_a_while_node_whose_predicate_never_falls_is_a_device_fault():
    # Without the value mode a predicate is whatever bytes memory holds: the stand-in stops a
    # WHILE node after CUDA_STANDIN_WHILE_LIMIT iterations instead of hanging, a sticky fault.
    out = run_process(
        "import torch\n"
        "pred = torch.ones((), dtype=torch.bool, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    g.begin_capture_to_while_node(pred)\n"
        "    g.set_conditional_handle_for_current_node(pred)\n"
        "    g.end_capture_to_conditional_node()\n"
        "g.replay()\n"
        "torch.cuda.synchronize()\n",
        CUDA_STANDIN_WHILE_LIMIT="50",
    )
    assert out.returncode != 0
    assert "still running after 50 iterations" in out.stderr, out.stderr[-2000:]


def test_pytorchs_own_reduce_overhead_runs_on_it():
    # Triton compiles real kernels, the stand-in loads and "launches" them: PyTorch's trees
    # record and replay (values need a GPU).
    import torch._inductor.cudagraph_trees as trees

    f = torch.compile(lambda x: (x * 2 + 1).relu(), mode="reduce-overhead")
    x = torch.ones(64, device="cuda")
    for _ in range(4):
        f(x)
    mgr = trees.get_container(0).tree_manager
    assert mgr is not None and len(list(mgr.get_roots())) >= 1
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_the_seed_story_gives_every_cudamalloc_back(mode):
    # The copy-only seed story (real values), in a process of its own: in deferred mode the
    # tree's stream, the caller's and the replays' run only where something waits for them, so
    # a synchronisation graphtrees forgot would show as a wrong value. After reset() and
    # empty_cache() every cudaMalloc was given back.
    code = (
        "import gc, sys, torch, graphtrees\n"
        "sys.path.insert(0, 'tests')\n"
        "graphtrees._ext.get_ext()._set_debug_checks(True)\n"
        "from cuda_standin.standin import current\n"
        "from test_seed_story import test_seed_story_with_copies_moves_real_values as story\n"
        "story('cuda')\n"
        "graphtrees.reset(); gc.collect(); torch.cuda.empty_cache()\n"
        "s = current().stats()\n"
        "print('mallocs', s['mallocs'], 'frees', s['frees'], 'in use', s['bytes_in_use'])\n"
        "print('deferred', s['deferred'], 'graph launches', s['graph_launches'])\n"
    )
    env = {"GRAPHTREES_CUDA": "1"}
    if mode == "deferred":
        env["CUDA_STANDIN_DEFERRED"] = "1"
    out = run_on_standin(code, **env)
    mallocs = int(out.split("mallocs ")[1].split()[0])
    frees = int(out.split("frees ")[1].split()[0])
    assert mallocs > 0 and mallocs == frees and "in use 0" in out, out
    assert f"deferred {int(mode == 'deferred')}" in out


# ---- a stand-in that punishes what hardware punishes ------------------------------------------

# What the real CUDA libraries depend on (and the loader itself): nothing of the C++ runtime.
C_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_its_libraries_need_only_the_c_library():
    # A preloaded library that needs libstdc++.so.6 puts it in the process-wide lookup scope,
    # where it hides what a private C++ runtime inside an extension does beside torch's (the first
    # GPU run's crash, which the stand-in could not show while its libraries needed it).
    for path in preloaded_libraries():
        out = subprocess.run(
            ["readelf", "-d", path], capture_output=True, text=True, check=True
        ).stdout
        needed = {
            line.split("[", 1)[1].split("]", 1)[0]
            for line in out.splitlines()
            if "(NEEDED)" in line
        }
        assert needed <= C_LIBRARIES | {"libcudart.so.13"}, (os.path.basename(path), needed)
    # And preloading them into a process without C++ loads no C++ runtime.
    maps = run_on_standin("print(open('/proc/self/maps').read())")
    assert "libcudart.so.13" in maps
    assert "libstdc++" not in maps and "libgcc_s" not in maps, maps


# Reads (or writes) a CUDA tensor's memory from the host, as no host code may: on a GPU the
# address is not the host's, and the read dies with SIGSEGV. Pinned memory stays the host's.
HOST_READ = (
    "import ctypes, torch\n"
    "host = torch.arange(4, dtype=torch.float32)\n"
    "x = host.cuda()\n"
    "pinned = host.pin_memory()\n"
    "assert ctypes.string_at(pinned.data_ptr(), 16) == host.numpy().tobytes()\n"
    "assert torch.equal(x.cpu(), host)  # the stand-in's own copies move the bytes\n"
    "print('touching', flush=True)\n"
    "{touch}\n"
    "print('touched', flush=True)\n"
)
READ = "print('bytes', ctypes.string_at(x.data_ptr(), 16) == host.numpy().tobytes())"
WRITE = "ctypes.memset(x.data_ptr() + 4, 0, 4)"


@pytest.mark.parametrize(
    "allocator",
    [
        pytest.param(None, id="cudaMalloc"),
        pytest.param("expandable_segments:True", id="expandable-segments"),
        pytest.param("backend:cudaMallocAsync", id="cudaMallocAsync"),
    ],
)
def test_host_code_cannot_read_device_memory(allocator):
    code = HOST_READ.format(touch=READ)
    r = run_process(code, PYTORCH_CUDA_ALLOC_CONF=allocator, CUDA_STANDIN_HOST_ACCESS=None)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "touching" in r.stdout and "touched" not in r.stdout
    # CUDA_STANDIN_HOST_ACCESS=1 (debugging) lets the host read the same bytes.
    out = run_on_standin(code, PYTORCH_CUDA_ALLOC_CONF=allocator, CUDA_STANDIN_HOST_ACCESS="1")
    assert "bytes True" in out and "touched" in out, out


def test_host_code_cannot_write_device_memory():
    r = run_process(HOST_READ.format(touch=WRITE), CUDA_STANDIN_HOST_ACCESS=None)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "touching" in r.stdout and "touched" not in r.stdout


# Uses a handle after it was destroyed (or one never created): a driver may crash on it, so the
# stand-in ends the process naming the call and the handle. The runtime only, through ctypes.
STALE = (
    "import ctypes, os\n"
    "lib = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
    "h, g = ctypes.c_void_p(), ctypes.c_void_p()\n"
    "zero = ctypes.c_ulonglong(0)\n"
    "{setup}\n"
    "print('handle', hex(h.value), flush=True)\n"
    "print('returned', {use}, flush=True)\n"
)
STALE_CASES = {
    "stream": (
        "assert lib.cudaStreamCreate(ctypes.byref(h)) == 0\nassert lib.cudaStreamDestroy(h) == 0",
        "lib.cudaStreamSynchronize(h)",
        "cudaStreamSynchronize: stream {h} was destroyed by cudaStreamDestroy",
        400,  # cudaErrorInvalidResourceHandle
    ),
    "event": (
        "assert lib.cudaEventCreate(ctypes.byref(h)) == 0\nassert lib.cudaEventDestroy(h) == 0",
        "lib.cudaEventRecord(h, None)",
        "cudaEventRecord: event {h} was destroyed by cudaEventDestroy",
        400,
    ),
    "event-destroyed-twice": (
        "assert lib.cudaEventCreate(ctypes.byref(h)) == 0\nassert lib.cudaEventDestroy(h) == 0",
        "lib.cudaEventDestroy(h)",
        "cudaEventDestroy: event {h} was destroyed by cudaEventDestroy",
        400,
    ),
    "graph": (
        "assert lib.cudaGraphCreate(ctypes.byref(h), 0) == 0\nassert lib.cudaGraphDestroy(h) == 0",
        "lib.cudaGraphInstantiateWithFlags(ctypes.byref(g), h, zero)",
        "cudaGraphInstantiateWithFlags: graph {h} was destroyed by cudaGraphDestroy",
        1,  # cudaErrorInvalidValue
    ),
    "graph-exec": (
        "assert lib.cudaGraphCreate(ctypes.byref(g), 0) == 0\n"
        "assert lib.cudaGraphInstantiateWithFlags(ctypes.byref(h), g, zero) == 0\n"
        "assert lib.cudaGraphExecDestroy(h) == 0",
        "lib.cudaGraphLaunch(h, None)",
        "cudaGraphLaunch: executable graph {h} was destroyed by cudaGraphExecDestroy",
        1,
    ),
    "unknown-stream": (
        "h.value = 0x5EED0000",
        "lib.cudaStreamQuery(h)",
        "cudaStreamQuery: stream {h} was never created",
        400,
    ),
}


@pytest.mark.parametrize("case", list(STALE_CASES))
def test_a_destroyed_or_unknown_handle_ends_the_process(case):
    setup, use, message, error = STALE_CASES[case]
    code = STALE.format(setup=setup, use=use)
    r = run_process(code, CUDA_STANDIN_HANDLE_ERRORS=None)
    handle = r.stdout.split("handle ")[1].split()[0] if "handle " in r.stdout else "?"
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stdout, r.stderr[-3000:])
    assert "returned" not in r.stdout
    assert message.format(h=handle) in r.stderr, r.stderr[-3000:]
    # CUDA_STANDIN_HANDLE_ERRORS=1 (debugging): the call fails instead, as the stand-in's calls
    # did before.
    out = run_on_standin(code, CUDA_STANDIN_HANDLE_ERRORS="1", CUDA_STANDIN_QUIET="1")
    assert f"returned {error}" in out, out


def test_torch_launching_onto_a_destroyed_stream_ends_the_process():
    # An external stream (torch.cuda.ExternalStream) that its owner destroyed while torch still
    # used it: the launch names the kernel.
    code = (
        "import ctypes, os, torch\n"
        "lib = ctypes.CDLL('libcudart.so.13', mode=os.RTLD_NOLOAD)\n"
        "x = torch.ones(8, device='cuda')\n"
        "h = ctypes.c_void_p()\n"
        "assert lib.cudaStreamCreate(ctypes.byref(h)) == 0\n"
        "s = torch.cuda.ExternalStream(h.value)\n"
        "with torch.cuda.stream(s):\n"
        "    x + 1\n"
        "assert lib.cudaStreamDestroy(h) == 0\n"
        "print('handle', hex(h.value), flush=True)\n"
        "with torch.cuda.stream(s):\n"
        "    x + 1\n"
        "print('launched', flush=True)\n"
    )
    r = run_process(code, CUDA_STANDIN_HANDLE_ERRORS=None)
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stdout, r.stderr[-3000:])
    handle = r.stdout.split("handle ")[1].split()[0]
    assert "launched" not in r.stdout
    assert "the launch of kernel" in r.stderr
    assert f"stream {handle} was destroyed by cudaStreamDestroy" in r.stderr, r.stderr[-3000:]


# ---- the value mode (Note [Stand-in values] in tests/cuda_standin/values.cpp) ------------------
# Each runs in a fresh interpreter with the value mode on (the environment standin.py gives), so
# that they check the engine whatever this process runs with; values are compared against the
# same computation on the CPU.


def run_with_values(code, timeout=300, exit_at_once=False, **env):
    """Runs `code` on the stand-in with the value mode on; returns its stdout.

    exit_at_once: the program leaves by os._exit once its checks are done. A program whose last
    step is a CUDA backward needs it: autograd's device thread drops its graph task (and with it
    Python objects) after backward() has returned, and if the interpreter is finalizing by then
    the thread is unwound out of a noexcept destructor ("terminate called without an active
    exception", pytorch/pytorch#38228, seen in CI once in ~20 runs on a loaded machine). That is
    torch's and CPython's race at exit, not the stand-in's; the checks have all run.
    """
    from cuda_standin import standin

    environ = standin.environment(os.environ["CUDA_STANDIN_DIR"], dict(os.environ, **env))
    header = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests', 'cuda_standin')!r})\n"
        "import standin\n"
        "assert standin.values_enabled(), 'the value engine did not load'\n"
        "def same(dev, ref, **kw):\n"
        "    known, why = standin.values_known(dev)\n"
        "    assert known, why\n"
        "    torch.testing.assert_close(dev.cpu(), ref, **kw)\n"
    )
    if exit_at_once:
        code += "\nimport os\nsys.stdout.flush()\nos._exit(0)\n"
    r = subprocess.run(
        [sys.executable, "-c", header + code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_values_eager_ops_views_inplace_out_and_gemms_compute():
    run_with_values(
        """
torch.manual_seed(0)
a_cpu = torch.randn(6, 8)
b_cpu = torch.randn(8, 5)
a, b = a_cpu.cuda(), b_cpu.cuda()
same(a * 2 + 1, a_cpu * 2 + 1)
same(torch.relu(a).sum(1), torch.relu(a_cpu).sum(1))
same(a.t().contiguous(), a_cpu.t().contiguous())            # a view, then a kernel
same(a[1:4, ::2].exp(), a_cpu[1:4, ::2].exp())
same(a.to(torch.float64).to(torch.int32), a_cpu.double().int())  # conversions (copy_)
same(torch.zeros(3, 4, device="cuda"), torch.zeros(3, 4))  # factories are kernels too
same(torch.arange(7, device="cuda") * 3, torch.arange(7) * 3)
same(a @ b, a_cpu @ b_cpu, rtol=1e-4, atol=1e-4)           # cuBLAS GEMM
same(torch.addmm(b[0], a, b), torch.addmm(b_cpu[0], a_cpu, b_cpu), rtol=1e-4, atol=1e-4)
same(torch.bmm(a.view(2, 3, 8), a.view(2, 3, 8).transpose(1, 2)),
     torch.bmm(a_cpu.view(2, 3, 8), a_cpu.view(2, 3, 8).transpose(1, 2)), rtol=1e-4, atol=1e-4)
lin = torch.nn.Linear(8, 5)
ref = lin(a_cpu).detach()
with torch.no_grad():
    same(lin.cuda()(a), ref, rtol=1e-4, atol=1e-4)
c, c_cpu = a.clone(), a_cpu.clone()
c.mul_(3).add_(1)                                           # in place
c_cpu.mul_(3).add_(1)
same(c, c_cpu)
c[2:4].zero_()                                              # in place through a view
c_cpu[2:4].zero_()
same(c, c_cpu)
out = torch.empty(6, 8, device="cuda")
torch.mul(a, a, out=out)                                    # out=
same(out, a_cpu * a_cpu)
grown = torch.empty(0, device="cuda")
torch.add(a, 1, out=grown)                                  # out= that the kernel resizes
same(grown, a_cpu + 1)
same(a[a > 0], a_cpu[a_cpu > 0])                            # data-dependent: computed first
same(torch.nonzero(a > 0.5), torch.nonzero(a_cpu > 0.5))
same(torch.unique(torch.tensor([3, 1, 3, 2], device="cuda")), torch.tensor([1, 2, 3]))
assert torch.equal(a, a.clone()) and not torch.equal(a, a + 1)
assert a.sum().item() == a.cpu().sum().item()
x = torch.randn(4, 3, device="cuda", requires_grad=True)   # autograd's backward thread
(x * x).sum().backward()
same(x.grad, 2 * x.detach().cpu())
print("ok")
""",
        exit_at_once=True,  # its last step is a CUDA backward
    )


def test_values_replays_recompute_from_what_the_memory_holds():
    run_with_values(
        """
w_cpu = torch.randn(8, 8)
x, w = torch.zeros(8, device="cuda"), w_cpu.cuda()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    torch.relu(x @ w)  # warm up cuBLAS outside the capture
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
host_nodes = standin.current().stats()["host_nodes"]
with torch.cuda.graph(g):
    y = torch.relu(x @ w) * 2 + x.sum()
    x.add_(1)  # a captured in-place op: every replay adds again
# Each op's computation rides on its own kernel node (a GEMM's too): the graph has no host node,
# so it could sit in a conditional body, which takes none.
assert standin.current().stats()["host_nodes"] == host_nodes, "the capture made host nodes"
for i in range(3):
    x_cpu = torch.full((8,), float(i))
    x.copy_(x_cpu)  # new input bytes, then a replay
    g.replay()
    same(y, torch.relu(x_cpu @ w_cpu) * 2 + x_cpu.sum(), rtol=1e-5, atol=1e-5)
    same(x, x_cpu + 1)
# A capture refuses a data-dependent op, as on a GPU.
g2 = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g2):
        torch.nonzero(x)
except Exception as e:
    assert "capture" in str(e), e
else:
    raise AssertionError("nonzero was captured")
print("ok")
"""
    )


def test_values_random_numbers_follow_the_cuda_generator():
    run_with_values(
        """
torch.manual_seed(0)
e1, e2, e3 = (torch.rand(64, device="cuda").cpu() for _ in range(3))
assert not torch.equal(e1, e2)
assert 0 <= e1.min() and e1.max() < 1 and e1.std() > 0.1
torch.manual_seed(0)
assert torch.equal(torch.rand(64, device="cuda").cpu(), e1)  # manual_seed reproduces
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    r = torch.rand(64, device="cuda")
torch.manual_seed(0)
g.replay()
r1 = r.cpu()
g.replay()
r2 = r.cpu()
assert not torch.equal(r1, r2)  # each replay draws anew
assert torch.equal(r1, e1) and torch.equal(r2, e2)  # replay k draws what eager call k drew
n = torch.randn(10000, device="cuda").cpu()
assert abs(n.mean()) < 0.05 and abs(n.std() - 1) < 0.05
d = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.25).cpu()
kept = d != 0
torch.testing.assert_close(d[kept], torch.full_like(d[kept], 1 / 0.75))
assert 150 < (~kept).sum() < 350, d
print("ok")
"""
    )


def test_values_a_launch_nothing_computed_is_unknown():
    # A raw driver launch (what a Triton kernel or a user's load_inline kernel is to the stand-in):
    # the memory its pointer argument points into becomes unknown; a computed op writing it makes
    # it known again; an op reading unknown bytes gives unknown results.
    run_with_values(
        """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
module, func = ctypes.c_void_p(), ctypes.c_void_p()
image = ctypes.create_string_buffer(b"not an image: the stand-in loads it unread", 64)
assert cuda.cuModuleLoadData(ctypes.byref(module), image) == 0
assert cuda.cuModuleGetFunction(ctypes.byref(func), module, b"user_kernel") == 0
t = torch.ones(256, device="cuda")
other = torch.ones(256, device="cuda")
assert standin.values_known(t) == (True, "")
ptr = ctypes.c_void_p(t.data_ptr())
n = ctypes.c_int(256)
params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(n))
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
assert cuda.cuLaunchKernel(func, 1, 1, 1, 128, 1, 1, 0, stream, params, None) == 0
known, why = standin.values_known(t)
assert not known and "user_kernel" in why, why
known, why = standin.values_known(t * 2)  # computed from unknown bytes
assert not known, why
t.fill_(3)  # a computed op writes it: known again
same(t, torch.full((256,), 3.0))
# The detector: an op whose CUDA kernel copies device memory to the host while it computes
# (reading values the engine has not computed yet) fails, naming the op.
cudart = ctypes.CDLL("libcudart.so.13")
name = ctypes.c_char_p(b"aten::pretend_op")
cudart.standin_values_enter(name)
try:
    t.cpu()
except RuntimeError:
    pass
else:
    raise AssertionError("a device-to-host copy inside an op was not refused")
finally:
    cudart.standin_values_exit()
assert "aten::pretend_op" in standin.current().last_message()
torch.cuda.synchronize()
same(t, torch.full((256,), 3.0))  # the stream still works
print("ok")
"""
    )


def test_values_an_inductor_kernel_is_unknown():
    # Triton kernels never reach the dispatcher: their outputs are unknown, never silently NaN.
    run_with_values(
        """
f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor")
x = torch.randn(64, device="cuda")
y = f(x)
known, why = standin.values_known(y)
assert not known and "triton" in why, why
# Its arguments' memory is unknown from each pointer on (x's too: reads and writes are not told
# apart); eager ATen on fresh values still computes.
z = torch.full((64,), 0.5, device="cuda")
same(torch.sin(z) * 2 + 1, torch.sin(torch.full((64,), 0.5)) * 2 + 1)
print("ok")
""",
        timeout=600,
    )


def test_values_host_functions_run_without_the_standins_lock():
    # A host function that needs the GIL while another thread, holding the GIL, makes CUDA calls:
    # with host functions run under the stand-in's lock this deadlocks (a driver runs them on its
    # own thread, without an API lock). And two threads computing values at once.
    run_with_values(
        """
import ctypes, threading, time
cudart = ctypes.CDLL("libcudart.so.13")
ran = []
@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def host_fn(_):
    time.sleep(0.01)  # Python: takes the GIL
    ran.append(1)
stop = threading.Event()
def poller():
    while not stop.is_set():
        torch.cuda.current_stream().query()
        torch.cuda.is_current_stream_capturing()
t = threading.Thread(target=poller)
t.start()
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
for _ in range(20):
    assert cudart.cudaLaunchHostFunc(stream, host_fn, None) == 0
stop.set()
t.join()
assert len(ran) == 20
errors = []
def worker(seed):
    try:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(20):
            a_cpu = torch.randn(32, 32, generator=gen)
            a = a_cpu.cuda()
            same((a @ a).relu() + 1, (a_cpu @ a_cpu).relu() + 1, rtol=1e-4, atol=1e-4)
    except Exception as e:
        errors.append(e)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
[th.start() for th in threads]
[th.join() for th in threads]
assert not errors, errors
print("ok")
""",
        timeout=120,
    )


@pytest.mark.parametrize("mode", ["deferred", "expandable"])
def test_values_in_deferred_mode_and_expandable_segments(mode):
    env = (
        {"CUDA_STANDIN_DEFERRED": "1"}
        if mode == "deferred"
        else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    run_with_values(
        """
a_cpu = torch.randn(300, 1000)
a = a_cpu.cuda()
b = (a * 2).sin()
c = b @ a.t()
same(b, (a_cpu * 2).sin())
same(c, (a_cpu * 2).sin() @ a_cpu.t(), rtol=1e-4, atol=1e-3)
print("ok")
""",
        **env,
    )


def test_values_a_graph_destroyed_with_its_replay_queued_keeps_its_work_until_it_ran():
    # Deferred mode: a replay is queued, then the graph is destroyed (CUDAGraph.reset(), as
    # graphtrees.reset() does). A launch holds the graph's user objects (the engine's computations)
    # until it has run, as a driver does; before, the queued replay ran freed host work (SIGSEGV).
    run_with_values(
        """
import gc
x_cpu = torch.arange(4096.0)
x = x_cpu.cuda()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    (x * 2).sin()  # warm up outside the capture
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = (x * 2).sin()
x.copy_(x_cpu + 1)
g.replay()  # queued, not run
g.reset()  # the graph and its executable are destroyed
del g
gc.collect()
junk = [bytearray(200) for _ in range(20000)]  # reuses the heap a freed computation held
torch.cuda.synchronize()  # runs the queued replay
same(y, ((x_cpu + 1) * 2).sin())
print("ok")
""",
        CUDA_STANDIN_DEFERRED="1",
    )


def test_values_an_in_place_op_whose_kernel_copies_into_its_input_is_computed_from_the_input():
    # mvlgamma_'s CUDA kernel computes into a temporary and copies it into self; the copies an
    # op's own kernel makes move no bytes while the engine computes that op, so the host computes
    # from the input (found by the OpInfo sweep: NaN before). An unknown value stays unknown
    # through a strided write, and a data-dependent op on unknown bytes gives unknown results.
    run_with_values(
        """
import ctypes
x_cpu = torch.rand(4, 3, dtype=torch.float64) + 3
x = x_cpu.cuda()
x.mvlgamma_(3)
same(x, x_cpu.clone().mvlgamma_(3))
m = torch.zeros(4, 4, device="cuda")
lib = standin.current()._lib
lib.standin_values_mark(ctypes.c_void_p(m.data_ptr()), ctypes.c_size_t(64), 1)
m.fill_diagonal_(0)  # writes 4 of 16 elements
assert not standin.values_known(m)[0], "a strided write made the whole matrix known"
assert not standin.values_known(m[m < 3])[0], "a boolean index of unknown bytes is known"
print("ok")
"""
    )


def test_values_raw_cublas_gemms_compute_eagerly_and_in_replays():
    # A GEMM called outside the dispatcher (a raw cuBLAS call, as an extension makes) is computed
    # by the stand-in's cuBLAS in the value mode (Note [Stand-in cuBLAS values]): eagerly, and
    # attached to its node in a capture, so each replay computes it from the new A.
    run_with_values(
        """
import ctypes
blas = ctypes.CDLL("libcublas.so.13")
h = ctypes.c_void_p()
assert blas.cublasCreate_v2(ctypes.byref(h)) == 0
stream = torch.cuda.Stream()
assert blas.cublasSetStream_v2(h, ctypes.c_void_p(stream.cuda_stream)) == 0
P = ctypes.c_void_p

def sgemm(a, b, c, alpha, beta):
    # Row-major C = alpha A B + beta C is column-major C^T = alpha B^T A^T + beta C^T.
    al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
    m, n, k = c.shape[1], c.shape[0], b.shape[0]
    return blas.cublasSgemm_v2(
        h, 0, 0, m, n, k, ctypes.byref(al), P(b.data_ptr()), m, P(a.data_ptr()), k,
        ctypes.byref(be), P(c.data_ptr()), m,
    )

a_cpu, b_cpu, c_cpu = torch.randn(5, 3), torch.randn(3, 4), torch.randn(5, 4)
a, b, c = a_cpu.cuda(), b_cpu.cuda(), c_cpu.cuda()
torch.cuda.synchronize()
with torch.cuda.stream(stream):
    assert sgemm(a, b, c, 2.0, 0.5) == 0
stream.synchronize()
same(c, 2.0 * a_cpu @ b_cpu + 0.5 * c_cpu, rtol=1e-5, atol=1e-5)
# In a capture: replays compute from the new A.
out = torch.zeros(5, 4, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=stream):
    assert sgemm(a, b, out, 1.0, 0.0) == 0
a.copy_(a_cpu + 1)
g.replay()
torch.cuda.synchronize()
same(out, (a_cpu + 1) @ b_cpu, rtol=1e-5, atol=1e-5)
# bfloat16 storage, float compute (cublasGemmEx).
ab, bb = a_cpu.bfloat16().cuda(), b_cpu.bfloat16().cuda()
cb = torch.zeros(5, 4, dtype=torch.bfloat16, device="cuda")
al, be = ctypes.c_float(1.0), ctypes.c_float(0.0)
with torch.cuda.stream(stream):
    assert blas.cublasGemmEx(h, 0, 0, 4, 5, 3, ctypes.byref(al), P(bb.data_ptr()), 14, 4,
                             P(ab.data_ptr()), 14, 3, ctypes.byref(be), P(cb.data_ptr()), 14, 4,
                             68, -1) == 0
stream.synchronize()
same(cb, (a_cpu.bfloat16().float() @ b_cpu.bfloat16().float()).bfloat16(), rtol=2e-2, atol=2e-2)
print("ok")
"""
    )


def test_values_off_is_the_plain_standin():
    out = run_process(
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests', 'cuda_standin')!r})\n"
        "import standin\n"
        "x = torch.ones(4, device='cuda') + 1\n"
        "print(standin.values_enabled(), standin.values_known(x)[0],\n"
        "      x.cpu().isnan().all().item())\n",
        CUDA_STANDIN_VALUES="0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "True"]
