"""The GPU-only experiments E1-E12 of the third CUDA desk review
(../shared/reference/cuda-desk-review-3.md) and G1-G14 of the fourth (cuda-desk-review-4.md), one
verdict line each:

    EXP E<n> <name>: confirmed|refuted|inconclusive (<numbers>) [<seconds> s]

"confirmed" means the review's prediction held (for E1-E9 and the G defects, a defect is there); "refuted" means it
did not (for a defect graphtrees has fixed since, the expected outcome); "inconclusive" means the
experiment could not decide (an error, a time-out). E10-E12 measure; their verdict says whether
the review's expectation held.

    GRAPHTREES_CUDA=1 python scripts/gpu_experiments.py              # all experiments
    GRAPHTREES_CUDA=1 python scripts/gpu_experiments.py E1 E7        # some of them
    GRAPHTREES_CUDA=1 python scripts/gpu_experiments.py --proof-only # is the CUDA backend on?
    GRAPHTREES_CUDA=1 python scripts/gpu_experiments.py --sanity cuda  # record, replay, compare
    python scripts/gpu_experiments.py --sanity cpu                     # the same on the CPU backend
    python scripts/gpu_experiments.py --dry-run                      # lists them (no GPU needed)

Each experiment runs in its own Python process under its own time limit (SIGINT first, so that
it prints its traceback, then a kill): a poisoned CUDA context or a hang spoils only that one.
The exit status is 0 unless the proof failed or an experiment confirmed a defect of E1-E9.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = {}  # "E1" -> (name, limit_s, is_defect, fn)


def experiment(key, name, limit_s=20, defect=True):
    def register(fn):
        EXPERIMENTS[key] = (name, limit_s, defect, fn)
        return fn

    return register


def run_python(code, env_extra=None, timeout=60):
    """Runs `code` in a fresh interpreter; returns its stdout (raises with its stderr on failure)."""
    env = dict(os.environ, GRAPHTREES_CUDA="1", **(env_extra or {}))
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if r.returncode != 0:
        raise RuntimeError(f"rc {r.returncode}: {r.stderr.strip()[-600:]}")
    return r.stdout.strip()


def private_pool_segments(torch):
    return [
        s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    ]


def first_line(e):
    return (
        f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        if str(e).strip()
        else type(e).__name__
    )


def proof():
    """A graphed function records and replays on cuda with the CUDA backend, running no Python."""
    import torch

    import graphtrees

    calls = []

    def f(x):
        calls.append(1)
        return x * 2 + 1

    g = graphtrees.cudagraphify(f)
    x = torch.randn(1024, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            out = g(x)
    torch.testing.assert_close(out, x * 2 + 1)
    info = graphtrees.tree_info("cuda")
    assert info["backend"] == "cuda-graphs", f"backend is {info['backend']!r}"
    assert info["num_replays"] == 2 and len(calls) == 2, (info["num_replays"], len(calls))
    graphtrees.reset()
    return f"backend {info['backend']}, {info['num_replays']} replays without Python"


def sanity(device):
    """Records and replays a small model at two shapes, comparing every call's values with eager,
    and prints each step before it runs (a crash shows where) and the tree's tree_info()."""
    import torch

    import graphtrees

    backend = {"cuda": "cuda-graphs", "cpu": "cpu-emulation"}[device]
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.GELU(),
            torch.nn.Linear(128, 64),
            torch.nn.LayerNorm(64),
        )
        .to(device)
        .eval()
    )
    python_runs = []

    def f(x, y):
        python_runs.append(1)
        return model(x).relu() * 2 + y, x.sum(0)

    g = graphtrees.cudagraphify(f, name="sanity")
    graphed_runs = 0
    try:
        with torch.no_grad():
            for batch in (8, 16):
                for step in ("warmup", "recording", "replay", "replay"):
                    print(f"SANITY step: batch {batch}, {step}", flush=True)
                    x = torch.randn(batch, 64, device=device)
                    y = torch.randn(batch, 64, device=device)
                    graphtrees.mark_step_begin()
                    before = len(python_runs)
                    out = [t.clone() for t in g(x, y)]
                    graphed_runs += len(python_runs) - before
                    torch.testing.assert_close(out, list(f(x, y)))
    finally:  # the tree as it is, also when a call failed
        info = graphtrees.tree_info(device)
        print("TREE_INFO " + json.dumps(info, separators=(",", ":")), flush=True)
    assert info["backend"] == backend, f"backend is {info['backend']!r}, not {backend!r}"
    assert info["num_recordings"] == 2, info["num_recordings"]
    assert info["num_replays"] == 4, info["num_replays"]
    assert graphed_runs == 4, f"the function's Python ran {graphed_runs} times, not 4"
    graphtrees.reset()
    return (
        f"backend {info['backend']}, {info['num_recordings']} recordings, "
        f"{info['num_replays']} replays, every call's values equal to eager's"
    )


def _reject_one_capture():
    import torch

    import graphtrees

    g = graphtrees.cudagraphify(lambda x: x[x > 0].sum())
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            g(x)
    return g.signatures()[0]["eager_reason"] or ""


@experiment("E1", "default generator left in capture mode by a rejected capture")
def e1():
    import torch

    reason = _reject_one_capture()
    try:
        torch.randn(4, device="cuda")
        torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5, training=True)
    except RuntimeError as e:
        return "confirmed", f"eager randn after the rejected capture raised {first_line(e)}"
    return (
        "refuted",
        f"eager randn and dropout work after the rejected capture ({reason[:60]!r}...)",
    )


@experiment("E2", "host pool use count reaches 0: later captures of the tree refused")
def e2():
    import torch

    import graphtrees

    _reject_one_capture()
    h = graphtrees.cudagraphify(lambda x: x * 3)
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            h(x)
        first = h.signatures()[0]["eager_reason"]
        graphtrees.reset()
        k = graphtrees.cudagraphify(lambda x: x + 1, max_recorded_shapes=1)
        for n in (16, 32, 16):  # each new shape evicts the last graph of the tree
            y = torch.randn(n, device="cuda")
            for _ in range(3):
                k(y)
    second = [s["eager_reason"] for s in k.signatures()]
    if first or any(second):
        return (
            "confirmed",
            f"after a rejected first capture: {first!r}; after evictions: {second!r}",
        )
    return (
        "refuted",
        "captures after a rejected first capture and after evicting the last graph work",
    )


E3_FUNCTIONS = {
    "tolist": "lambda x: x + len(x.tolist())",
    "cpu().cuda()": "lambda x: x.cpu().cuda()",
    "torch.tensor(device=cuda)": "lambda x: x + torch.tensor([1.0], device='cuda')",
    "scalar setitem": "lambda x: (x.__setitem__((0,), 1.0), x)[1]",
    "str(x)": "lambda x: (str(x), x + 1)[1]",
}


@experiment("E3", "host syncs torch checks before capturing: rethrown on every call", 40)
def e3():
    import torch

    import graphtrees

    results, raised = [], []
    with torch.no_grad():
        for name, src in E3_FUNCTIONS.items():
            fn = eval(src, {"torch": torch})  # noqa: S307 - our own table
            g = graphtrees.cudagraphify(fn)
            x = torch.randn(8, device="cuda")
            try:
                for _ in range(3):
                    torch.testing.assert_close(g(x.clone()), fn(x.clone()))
                reason = g.signatures()[0]["eager_reason"]
                results.append(f"{name}: {'eager' if reason else 'graphed'}")
            except Exception as e:  # noqa: BLE001 - the finding
                raised.append(name)
                results.append(f"{name}: raised {first_line(e)[:80]}")
        gen = torch.Generator("cuda")
        gen.manual_seed(3)
        f = lambda x, g: x + torch.randn(x.shape, device="cuda", generator=g)  # noqa: E731
        g = graphtrees.cudagraphify(f)
        x = torch.zeros(256, device="cuda")
        try:
            outs = [g(x, gen).clone() for _ in range(4)]
            fresh = not torch.equal(outs[2], outs[3])
            results.append(
                f"generator argument: {'fresh numbers per replay' if fresh else 'REPEATED numbers'}"
            )
            if not fresh:
                raised.append("generator")
        except Exception as e:  # noqa: BLE001
            raised.append("generator")
            results.append(f"generator argument: raised {first_line(e)[:80]}")
    return ("confirmed" if raised else "refuted"), "; ".join(results)


@experiment("E4", "concurrent captures and syncs on one device (threads)", 60)
def e4():
    out = run_python(
        """
        import sys, threading, torch, graphtrees
        from graphtrees import cudagraphify, mark_step_begin
        sys.setswitchinterval(1e-5)
        errors, reasons, masks = [], [], {}
        def loop_of_tiny_ops(x):
            for _ in range(2000):
                x = x + 1e-3
            return x
        def worker(i):
            try:
                with torch.no_grad():
                    a = cudagraphify(loop_of_tiny_ops)
                    b = cudagraphify(lambda x: x * 2 - 1)
                    d = cudagraphify(lambda x: torch.nn.functional.dropout(x, 0.5, True))
                    x = torch.ones(1024, device='cuda')
                    for step in range(4):
                        mark_step_begin(); a(x); b(x); masks.setdefault(i, []).append(d(x).clone())
                    reasons.extend(s['eager_reason'] for f in (a, b, d) for s in f.signatures())
            except Exception as e:
                errors.append(repr(e)[:200])
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        [t.start() for t in ts]; [t.join() for t in ts]
        same = sum(torch.equal(masks[0][-1], masks[i][-1]) for i in (1, 2) if i in masks)
        print(len(errors), sum(r is not None for r in reasons), same)
        print(errors[:2], [r for r in reasons if r][:2])
    """,
        timeout=55,
    )
    first, detail = out.splitlines()[-2], out.splitlines()[-1]
    n_err, n_eager, same_masks = map(int, first.split())
    numbers = f"{n_err} errors, {n_eager} eager reasons, {same_masks} identical dropout masks across threads; {detail[:300]}"
    return ("confirmed" if n_err or n_eager else "refuted"), numbers


@experiment("E5", "budget OOM frees nothing and evicts every recording off the path", 40)
def e5():
    import torch

    import graphtrees
    from graphtrees import cudagraphify, mark_step_begin

    fns = [cudagraphify(lambda x, k=k: x * k) for k in range(1, 4)]
    x = torch.ones(1 << 18, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            for fn in fns:
                mark_step_begin()
                fn(x)
        nodes = graphtrees.tree_info("cuda")["num_nodes"]
        graphtrees.set_memory_budget("cuda", graphtrees.tree_info("cuda")["pool"]["reserved_bytes"])
        big = cudagraphify(lambda x: x.repeat(1024))  # 1 GiB
        mark_step_begin()
        big(x)
        t = graphtrees.tree_info("cuda")
        graphtrees.set_memory_budget("cuda", None)
        after = cudagraphify(lambda x: x - 1)
        for _ in range(3):
            after(x)
    numbers = (
        f"{nodes} nodes before; num_out_of_memory {t['num_out_of_memory']}, num_evictions "
        f"{t['num_evictions']}, bytes_released {t['bytes_released']}, nodes left "
        f"{t['num_nodes']}; a later recording: {after.signatures()[0]['eager_reason']!r}"
    )
    evicted_all = t["num_nodes"] == 0 and nodes > 1
    return (
        "confirmed" if evicted_all or after.signatures()[0]["eager_reason"] else "refuted"
    ), numbers


@experiment("E6", "memory fraction stuck below 1.0 after two threads with budgets", 40)
def e6():
    out = run_python(
        """
        import threading, torch, graphtrees
        from graphtrees import cudagraphify
        before = torch.cuda.get_per_process_memory_fraction(0)
        def worker(i):
            with torch.no_grad():
                graphtrees.set_memory_budget('cuda', 64 << 20)
                for k in range(6):
                    g = cudagraphify(lambda x, k=k: x * k + i)
                    x = torch.randn(1 << 16, device='cuda')
                    for _ in range(3): g(x)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(before, torch.cuda.get_per_process_memory_fraction(0))
    """,
        timeout=35,
    )
    before, after = map(float, out.split()[-2:])
    return (
        "confirmed" if after != before else "refuted"
    ), f"fraction before {before}, after {after}"


@experiment("E7", "RNG: graphed dropout follows eager call by call", defect=False)
def e7():
    import torch

    import graphtrees

    f = lambda x: torch.nn.functional.dropout(x, 0.5, training=True)  # noqa: E731
    g = graphtrees.cudagraphify(f)
    x = torch.ones(4096, device="cuda")
    with torch.no_grad():
        torch.manual_seed(0)
        eager = [f(x) for _ in range(3)]
        torch.manual_seed(0)
        graphed = [g(x).clone() for _ in range(3)]
        torch.cuda.manual_seed(1)
        after = g(x).clone()
        torch.cuda.manual_seed(1)
        ref = f(x)
    equal = [bool(torch.equal(a, b)) for a, b in zip(graphed, eager)]
    distinct = not torch.equal(graphed[1], graphed[2])
    reseeded = bool(torch.equal(after, ref))
    ok = all(equal) and distinct and reseeded
    # The review predicts correct RNG here: "confirmed" is the good outcome of this one.
    return (
        "confirmed" if ok else "refuted"
    ), f"equal per call {equal}, masks differ {distinct}, after manual_seed {reseeded}"


@experiment("E8", "NCCL warmup leaves a pool block held by the work object", 40)
def e8():
    out = run_python(
        """
        import os, tempfile, time, torch, torch.distributed as dist, graphtrees
        graphtrees._ext.get_ext()._set_debug_checks(False)
        d = tempfile.mkdtemp()
        dist.init_process_group('nccl', init_method=f'file://{d}/store', rank=0, world_size=1,
                                device_id=torch.device('cuda', 0))
        def f(x):
            y = x * 2
            dist.all_reduce(y)
            return y + 1
        g = graphtrees.cudagraphify(f)
        with torch.no_grad():
            out = g(torch.ones(16, device='cuda'))
            now = graphtrees.check_pool_invariants('cuda')[0]
            time.sleep(0.2)
            later = graphtrees.check_pool_invariants('cuda')[0]
            for _ in range(3): g(torch.ones(16, device='cuda'))
        print(now, later, graphtrees.tree_info('cuda')['num_replays'])
        dist.destroy_process_group()
    """,
        timeout=35,
    )
    now, later, replays = out.split()[-3:]
    held = now == "False"
    return (
        "confirmed" if held else "refuted"
    ), f"invariant right after the warmup {now}, after 0.2 s {later}, replays {replays}"


@experiment("E9", "a function that leaves another stream current", 30)
def e9():
    import torch

    import graphtrees

    side = torch.cuda.Stream()

    def f(x):
        y = x * 2
        torch.cuda.set_stream(side)
        return y

    g = graphtrees.cudagraphify(f)
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        try:
            for _ in range(3):
                g(x)
        finally:
            torch.cuda.set_stream(torch.cuda.default_stream())
        h = graphtrees.cudagraphify(lambda x: x + 5)
        out = h(x)  # a warmup: on a zombie capture it would hold no real values
        torch.cuda.synchronize()
        real = bool(torch.equal(out, x + 5))
    reason = g.signatures()[0]["eager_reason"]
    return (
        "refuted" if real else "confirmed"
    ), f"later warmup real values: {real}; eager reason {str(reason)[:100]!r}"


@experiment(
    "E10",
    "second-review carry-overs: expandable segments, 300 cycles, bit identity, x.t()",
    90,
    defect=False,
)
def e10():
    seed = run_python(
        """
        import torch, graphtrees
        from graphtrees import cudagraphify, mark_step_begin
        lin = [torch.nn.Linear(1024, 1024).cuda() for _ in range(3)]
        g1, g2, g3 = (cudagraphify(m) for m in lin)
        x = torch.randn(1024, 1024, device='cuda')
        with torch.no_grad():
            for branch in (g2, g2, g2, g3, g3, g3):
                mark_step_begin(); h = g1(x); y = branch(h)
        t = graphtrees.tree_info('cuda')
        print(t['retired_trees'], t['num_checkpoints'])
    """,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        timeout=30,
    )
    retired = int(seed.split()[-2])
    cycles = run_python(
        """
        import torch, graphtrees
        from graphtrees import cudagraphify
        seen = []
        with torch.no_grad():
            for i in range(300):
                g = cudagraphify(lambda x: x + 1)
                x = torch.randn(1 << 18, device='cuda')
                for _ in range(3): g(x)
                graphtrees.reset()
                if i in (0, 299): seen.append(torch.cuda.memory_reserved())
        print(*seen)
    """,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        timeout=40,
    )
    r0, r1 = map(int, cycles.split()[-2:])
    identity = run_python(
        """
        import torch, graphtrees
        torch.manual_seed(0)
        block = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True).cuda().eval()
        g = graphtrees.cudagraphify(block)
        x = torch.randn(4, 32, 256, device='cuda')
        with torch.no_grad():
            ref = block(x)
            for _ in range(4): out = g(x)
            t = graphtrees.cudagraphify(lambda x: x.t())
            y = torch.randn(8, 4, device='cuda')
            for _ in range(3): ty = t(y)
        print((out - ref).abs().max().item(), ty.data_ptr() == y.data_ptr())
    """,
        timeout=20,
    )
    diff, view = identity.split()[-2:]
    ok = retired == 0 and r1 <= r0 and float(diff) == 0 and view == "True"
    return ("confirmed" if ok else "refuted"), (
        f"expandable seed story retired_trees={retired}; reserved "
        f"after 1 / 300 cycles {r0 >> 20} / {r1 >> 20} MiB; "
        f"transformer max|diff| {diff}; x.t() a view {view}"
    )


@experiment("E11", "sizing: test durations and one conftest teardown", 60, defect=False)
def e11():
    t = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/test_seed_story.py",
            "tests/test_cuda.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=0",
            "-k",
            "cuda and (seed or transformer)",
        ],
        cwd=ROOT,
        env=dict(os.environ, GRAPHTREES_CUDA="1"),
        capture_output=True,
        text=True,
        timeout=55,
    )
    took = time.perf_counter() - t
    lines = [
        line.strip() for line in r.stdout.splitlines() if " call " in line or " teardown " in line
    ]
    return ("confirmed" if r.returncode == 0 else "inconclusive"), (
        f"{took:.0f} s for the selection (rc {r.returncode}), interpreter and CUDA start included; "
        + " | ".join(lines[:8])
    )


@experiment(
    "E12", "cuBLAS workspace in memory_reserved after reset and empty_cache", 20, defect=False
)
def e12():
    import torch

    import graphtrees

    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    x = torch.randn(512, 512, device="cuda")
    g = graphtrees.cudagraphify(lambda x: x @ x)
    with torch.no_grad():
        for _ in range(3):
            g(x)
        _ = x @ x
    graphtrees.reset()
    torch.cuda.empty_cache()
    without = torch.cuda.memory_reserved() - base
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    with_clear = torch.cuda.memory_reserved() - base
    explained = without > with_clear
    return (
        ("confirmed" if explained else "refuted"),
        f"above the start after reset: {without} B; after clearing the cuBLAS workspaces too: {with_clear} B",
    )


# --- The fourth review's experiments (G1-G14). Each defect was fixed on the CUDA stand-in first;
# here a GPU says whether the fix holds where kernels run. "refuted" is the expected verdict.


@experiment("G1", "generator argument: abort at destruction, or repeated numbers (2.11)", 25)
def g1():
    out = run_python(
        """
        import gc, torch, graphtrees
        f = lambda x, g: x + torch.rand(x.shape, device='cuda', generator=g)
        g = graphtrees.cudagraphify(f)
        gen = torch.Generator('cuda')
        x = torch.zeros(1 << 16, device='cuda')
        with torch.no_grad():
            gen.manual_seed(7); graphed = [g(x, gen).clone() for _ in range(5)]
            gen.manual_seed(7); eager = [f(x, gen) for _ in range(5)]
        equal = sum(torch.equal(a, b) for a, b in zip(graphed, eager))
        fresh = not torch.equal(graphed[3], graphed[4])
        print(equal, int(fresh), graphtrees.tree_info('cuda')['num_replays'])
        del g; graphtrees.reset(); gc.collect(); torch.cuda.synchronize()
    """,
        timeout=24,
    )
    equal, fresh, replays = map(int, out.splitlines()[-1].split())
    ok = equal == 5 and fresh and replays == 3
    return (
        "refuted" if ok else "confirmed"
    ), f"{equal}/5 calls equal eager, fresh={bool(fresh)}, {replays} replays, no abort"


@experiment("G2", "OOM while the default generator first registers: abort (2.11)", 25)
def g2():
    out = run_python(
        """
        import torch, graphtrees
        x = torch.randn(1 << 20, device='cuda')
        small = torch.cuda.memory_stats().get('segment.small_pool.current')
        g = graphtrees.cudagraphify(lambda x: x * 2)
        with torch.no_grad():
            g(x)
            graphtrees.set_memory_budget('cuda', graphtrees.tree_info('cuda')['pool']['reserved_bytes'])
            for _ in range(3): g(x)
        s = g.signatures()[0]
        print(small, graphtrees.tree_info('cuda')['num_recordings'], repr(s['out_of_memory'])[:80])
        graphtrees.reset()
    """,
        timeout=24,
    )
    return (
        "refuted",
        f"no abort: small-pool segments before, recordings, OOM = {out.splitlines()[-1]}",
    )


@experiment("G3", "another thread's RNG replays raise while a graph is captured (2.11)", 40)
def g3():
    out = run_python(
        """
        import sys, threading, torch, graphtrees
        from graphtrees import cudagraphify
        sys.setswitchinterval(1e-5)
        drop = cudagraphify(lambda x: torch.nn.functional.dropout(x, 0.5, training=True))
        x = torch.ones(4096, device='cuda')
        with torch.no_grad():
            for _ in range(3): drop(x)
        errors, replays, stop = [], [0], threading.Event()
        def replayer():
            with torch.no_grad():
                while not stop.is_set():
                    try:
                        drop(x); replays[0] += 1
                    except RuntimeError as e:
                        errors.append(str(e)[:80])
        t = threading.Thread(target=replayer); t.start()
        with torch.no_grad():
            for k in range(30):
                f = cudagraphify(lambda y, k=k: y * k + 1)
                y = torch.ones(256, device='cuda')
                for _ in range(2): f(y)
        stop.set(); t.join()
        print(len(errors), replays[0], errors[:1])
    """,
        timeout=38,
    )
    n_err, replays = map(int, out.splitlines()[-1].split()[:2])
    return (
        "confirmed" if n_err else "refuted"
    ), f"{n_err} errors in {replays} replays beside 30 captures"


@experiment("G4", "budget OOM on CUDA: each call evicts another recording", 30)
def g4():
    out = run_python(
        """
        import torch, graphtrees
        from graphtrees import cudagraphify, mark_step_begin
        fns = [cudagraphify(lambda x, k=k: x * k) for k in range(1, 4)]
        x = torch.ones(1 << 18, device='cuda')
        with torch.no_grad():
            for _ in range(3):
                for fn in fns:
                    mark_step_begin(); fn(x)
            graphtrees.set_memory_budget('cuda', graphtrees.tree_info('cuda')['pool']['reserved_bytes'])
            big = cudagraphify(lambda x: x.repeat(256))
            rows = []
            for _ in range(4):
                mark_step_begin(); big(x)
                t = graphtrees.tree_info('cuda')
                rows.append((t['num_evictions'], t['num_nodes'], t['pool']['reserved_bytes']))
        print(rows)
    """,
        timeout=28,
    )
    rows = eval(out.splitlines()[-1])  # noqa: S307 - our own output
    evicted = rows[-1][0]
    return ("confirmed" if evicted else "refuted"), f"(evictions, nodes, reserved) per call: {rows}"


@experiment("G6", "NCCL: how long the work object holds a warmup block", 40)
def g6():
    out = run_python(
        """
        import os, tempfile, time, torch, torch.distributed as dist, graphtrees
        d = tempfile.mkdtemp()
        dist.init_process_group('nccl', init_method=f'file://{d}/s', rank=0, world_size=1,
                                device_id=torch.device('cuda', 0))
        def f(x):
            y = x * 2; dist.all_reduce(y); return y + 1
        waits = []
        for _ in range(5):
            graphtrees.reset()
            g = graphtrees.cudagraphify(f)
            with torch.no_grad():
                g(torch.ones(16, device='cuda'))
            t = time.perf_counter()
            while not graphtrees.check_pool_invariants('cuda')[0] and time.perf_counter() - t < 1:
                time.sleep(0.005)
            waits.append(round((time.perf_counter() - t) * 1000, 1))
        dist.destroy_process_group()
        print(max(waits), waits)
    """,
        timeout=38,
    )
    worst = float(out.splitlines()[-1].split()[0])
    return (
        "confirmed" if worst > 200 else "refuted"
    ), f"ms until the pool check holds: {out.splitlines()[-1]}"


@experiment("G7", "verify=True: a nested graphed call enters the tree", 20)
def g7():
    out = run_python(
        """
        import torch, graphtrees
        inner = graphtrees.cudagraphify(lambda x: x * 2)
        outer = graphtrees.cudagraphify(lambda x: inner(x) + 1, verify=True)
        x = torch.ones(8, device='cuda')
        with torch.no_grad():
            for _ in range(5): outer(x)
        t = graphtrees.tree_info('cuda')
        print(t['num_nodes'], [n['function'] for n in t['nodes']])
    """,
        timeout=18,
    )
    nodes = int(out.splitlines()[-1].split()[0])
    return ("confirmed" if nodes != 1 else "refuted"), f"nodes: {out.splitlines()[-1]}"


@experiment("G8", "verify=True on dropout: mismatch, or the RNG stream moved", 20, defect=True)
def g8():
    out = run_python(
        """
        import torch, graphtrees
        f = lambda x: torch.nn.functional.dropout(x, 0.5, True)
        g = graphtrees.cudagraphify(f, verify=True)
        x = torch.ones(4096, device='cuda')
        torch.manual_seed(0)
        with torch.no_grad():
            for _ in range(6): g(x)
        after = torch.cuda.get_rng_state()
        torch.manual_seed(0)
        for _ in range(6): f(x)
        print(int(torch.equal(after, torch.cuda.get_rng_state())))
    """,
        timeout=18,
    )
    same = out.splitlines()[-1] == "1"
    return (
        "refuted" if same else "confirmed"
    ), f"no mismatch; RNG state equal to 6 eager calls: {same}"


@experiment("G9", "a graphed call inside the user's torch.cuda.graph breaks it", 20)
def g9():
    out = run_python(
        """
        import torch, graphtrees
        g = graphtrees.cudagraphify(lambda x: x + 1)
        x = torch.zeros(16, device='cuda')
        with torch.no_grad():
            for _ in range(3): g(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = g(x)
            x.fill_(4); graph.replay(); torch.cuda.synchronize()
        print(out[0].item())
    """,
        timeout=18,
    )
    ok = out.splitlines()[-1] == "5.0"
    return (
        "refuted" if ok else "confirmed"
    ), f"the user's graph replays: out[0] = {out.splitlines()[-1]}"


@experiment("G10", "piecewise: a 0-dim CPU copy puts a whole piece on eager", 40)
def g10():
    out = run_python(
        """
        import torch, graphtrees
        f = graphtrees.compile(lambda x: (torch.tanh(x) * 2 + 1).sum().cpu() + 0, inner='aot_eager')
        x = torch.randn(64, device='cuda')
        with torch.no_grad():
            for _ in range(4): f(x)
        pieces = [p for ps in graphtrees.split_info().values() for p in ps]
        print(graphtrees.tree_info('cuda')['num_replays'], [(p['recorded'], p['why_eager']) for p in pieces])
    """,
        timeout=38,
    )
    replays = int(out.splitlines()[-1].split()[0])
    return ("confirmed" if replays == 0 else "refuted"), out.splitlines()[-1][:300]


@experiment("G12", "transformer block: bit identity with eager", 30, defect=False)
def g12():
    code = """
        import torch, graphtrees
        torch.manual_seed(0)
        block = torch.nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True).cuda().eval()
        g = graphtrees.cudagraphify(block)
        x = torch.randn(4, 32, 256, device='cuda')
        with torch.no_grad():
            ref = block(x)
            for _ in range(4): out = g(x)
        print((out - ref).abs().max().item())
    """
    plain = float(run_python(code, timeout=14).splitlines()[-1])
    fixed = float(
        run_python(code, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, timeout=14).splitlines()[-1]
    )
    return (
        "confirmed" if plain == 0 else "refuted"
    ), f"max |graphed - eager| = {plain}; with CUBLAS_WORKSPACE_CONFIG=:4096:8: {fixed}"


@experiment("G14", "the tree's stream is one torch.cuda.Stream() hands out", 20)
def g14():
    out = run_python(
        """
        import torch, graphtrees
        seen = []
        def f(x):
            seen.append(torch.cuda.current_stream().cuda_stream); return x + 1
        g = graphtrees.cudagraphify(f)
        with torch.no_grad():
            g(torch.ones(4, device='cuda'))
        print(sum(torch.cuda.Stream().cuda_stream == seen[0] for _ in range(64)))
    """,
        timeout=18,
    )
    same = int(out.splitlines()[-1])
    return ("confirmed" if same else "refuted"), f"{same} of 64 new streams share the tree's handle"


def run_one(key):
    name, _, _, fn = EXPERIMENTS[key]
    try:
        verdict, numbers = fn()
    except KeyboardInterrupt:
        traceback.print_exc()
        verdict, numbers = "inconclusive", "stopped at its time limit"
    except Exception as e:  # noqa: BLE001 - reported as the verdict
        traceback.print_exc()
        verdict, numbers = "inconclusive", first_line(e)
    print("VERDICT " + json.dumps({"verdict": verdict, "numbers": numbers}), flush=True)
    return 0


def run_isolated(key, limit_s):
    """Runs one experiment in a child process under `limit_s`; returns (verdict, numbers, seconds)."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--one", key],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, GRAPHTREES_CUDA="1"),
    )
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except KeyboardInterrupt:
        proc.kill()
        raise
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the child prints its traceback and its verdict
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        out += f"\n(timed out after {limit_s} s)"
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    verdict, numbers = "inconclusive", f"no verdict (rc {proc.returncode})"
    for line in out.splitlines():
        if line.startswith("VERDICT "):
            v = json.loads(line[len("VERDICT ") :])
            verdict, numbers = v["verdict"], v["numbers"]
    if "(timed out after" in out and verdict == "inconclusive":
        numbers = f"timed out after {limit_s} s; {numbers}"
    return verdict, numbers, time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("keys", nargs="*", help="experiments to run (default: all)")
    parser.add_argument("--proof-only", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds for all of them: an experiment that would not fit is not started",
    )
    parser.add_argument(
        "--sanity",
        choices=("cuda", "cpu"),
        help="record, replay and compare with eager on this device, in this process",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return run_one(args.one)
    if args.sanity:
        os.environ["GRAPHTREES_CUDA"] = "1"
        t = time.perf_counter()
        try:
            verdict = f"passed ({sanity(args.sanity)})"
        except Exception as e:  # noqa: BLE001 - reported
            traceback.print_exc()
            verdict = f"failed ({first_line(e)})"
        print(f"SANITY: {verdict} [{time.perf_counter() - t:.1f} s]", flush=True)
        return 0 if verdict.startswith("passed") else 1
    keys = args.keys or list(EXPERIMENTS)
    unknown = [k for k in keys if k not in EXPERIMENTS]
    if unknown:
        parser.error(f"unknown experiments {unknown}; known: {list(EXPERIMENTS)}")
    if args.dry_run:
        for key in keys:
            name, limit_s, _, _ = EXPERIMENTS[key]
            print(f"EXP {key} {name}: skipped (dry run, limit {limit_s} s)")
        return 0
    os.environ["GRAPHTREES_CUDA"] = "1"
    if args.proof_only:
        try:
            print(f"PROOF: passed ({proof()})", flush=True)
        except Exception as e:  # noqa: BLE001 - reported
            traceback.print_exc()
            print(f"PROOF: failed ({first_line(e)})", flush=True)
            return 2
        return 0
    confirmed_defects = 0
    t0 = time.perf_counter()
    for key in keys:
        name, limit_s, defect, _ = EXPERIMENTS[key]
        left = args.budget - (time.perf_counter() - t0) if args.budget else None
        if left is not None and left < min(limit_s, 15):
            print(
                f"EXP {key} {name}: inconclusive (not run: {left:.0f} s of the budget left) [0.0 s]"
            )
            continue
        try:
            verdict, numbers, took = run_isolated(
                key, limit_s if left is None else min(limit_s, left)
            )
        except KeyboardInterrupt:
            print(f"EXP {key} {name}: inconclusive (the whole run was stopped) [-]", flush=True)
            return 1
        confirmed_defects += defect and verdict == "confirmed"
        print(f"EXP {key} {name}: {verdict} ({numbers}) [{took:.1f} s]", flush=True)
    return 1 if confirmed_defects else 0


if __name__ == "__main__":
    sys.exit(main())
