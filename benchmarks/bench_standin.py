"""Host-side cost of graphtrees against PyTorch's own trees, on the CUDA stand-in.

CUDA stand-in: host-side cost, kernels not executed. Kernels are no-ops there (the benchmark runs
without the stand-in's value mode: it starts itself again with CUDA_STANDIN_VALUES=0), so a call's
time is its bookkeeping: Python, dynamo's guards, AOTAutograd's wrappers, the tree managers, the copies of
inputs and the graph launch. Everything runs in one process, interleaved over rounds, and the
minimum per variant is reported (measure on a quiet machine).

    python tests/cuda_standin/standin.py run -- env GRAPHTREES_CUDA=1 \\
        python benchmarks/bench_standin.py --out benchmarks/results

Sections: overhead (us per call: raw CUDAGraph.replay, cudagraphify with static and with copied
inputs, torch.compile(backend="graphtrees"), torch.compile(mode="reduce-overhead"), dynamo alone,
dynamo + AOTAutograd alone), drop-in (the same torch.compile(mode="reduce-overhead") functions
recorded by PyTorch's trees and, with graphtrees.install(), by graphtrees: us per call and pool
bytes), memory (pool bytes for K sibling branches, graphtrees against PyTorch's trees), capture
(16 buckets captured largest first).
"""

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import types

import torch

import graphtrees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from cuda_standin.standin import current  # noqa: E402

LABEL = "CUDA stand-in: host-side cost, kernels not executed"


def f(x):
    for _ in range(10):
        x = x * 1.5 + 1.0
    return x


def fresh(fn):
    """`fn` under a code object of its own. Dynamo keeps its compiled entries per code object and
    checks them in turn: variants compiled from one function would pay for each other's guards, in
    an order that changes between processes (benchmarks/bench_compile_path.py)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def aot_floor_backend(ready):
    """A dynamo backend whose AOTAutograd forward returns `ready` at once: what dynamo and
    AOTAutograd cost by themselves (the floor the recorded variants are measured above)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm, example_inputs):
        def fw(g, ins):
            outs = g(*ins)
            return lambda *args: [ready for _ in outs]

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    return backend


def machine():
    """The host these figures were taken on: host costs differ from one machine to the next far
    more than the work does (benchmarks/README.md, "The host-cost lead from machine to machine")."""
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "unknown",
    )
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            level = open(f"{base}/{index}/level").read().strip()
            kind = open(f"{base}/{index}/type").read().strip()
            size = open(f"{base}/{index}/size").read().strip()
        except OSError:
            continue
        caches[f"L{level}{'i' if kind == 'Instruction' else 'd' if kind == 'Data' else ''}"] = size
    return {"cpu": cpu, "cores": os.cpu_count(), "caches": caches, "host": os.uname().nodename}


def per_call_us(fn, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def overhead_variants(x):
    """name -> a no-argument call of `f` on `x`, for each variant of the overhead section
    (benchmarks/callgrind_overhead.py counts the same variants' instructions)."""
    ready = f(x)

    def ready_backend(gm, example_inputs):
        as_tuple = isinstance(gm(*example_inputs), tuple)
        return (lambda *args: (ready,)) if as_tuple else (lambda *args: ready)

    aot_ready_backend = aot_floor_backend(ready)

    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    for _ in range(2):
        f(static_x)
    with torch.cuda.graph(graph):
        f(static_x)
    return {
        "raw CUDAGraph.replay()": graph.replay,
        "cudagraphify, static input": (lambda g: lambda: g(x))(
            graphtrees.cudagraphify(f, static_argnums=(0,), name="static")
        ),
        "cudagraphify, copied input": (lambda g: lambda: g(x))(
            graphtrees.cudagraphify(f, name="copied")
        ),
        "dynamo alone": (lambda c: lambda: c(x))(torch.compile(fresh(f), backend=ready_backend)),
        "dynamo + AOTAutograd alone": (lambda c: lambda: c(x))(
            torch.compile(fresh(f), backend=aot_ready_backend)
        ),
        'torch.compile(backend="graphtrees")': (lambda c: lambda: c(x))(
            torch.compile(fresh(f), backend="graphtrees")
        ),
        'torch.compile(mode="reduce-overhead")': (lambda c: lambda: c(x))(
            torch.compile(fresh(f), mode="reduce-overhead")
        ),
    }


def bench_overhead(iters, rounds):
    import torch._dynamo

    variants = overhead_variants(torch.ones(64, device="cuda"))
    with torch.no_grad():
        for fn in variants.values():  # warm up, record, compile
            for _ in range(5):
                fn()
        best = {k: float("inf") for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                best[k] = min(best[k], per_call_us(fn, iters))
    torch.cuda.synchronize()
    floor = best["dynamo + AOTAutograd alone"]
    ours = best['torch.compile(backend="graphtrees")'] - floor
    theirs = best['torch.compile(mode="reduce-overhead")'] - floor
    torch._dynamo.reset()
    graphtrees.reset()
    return {
        "us_per_call": {k: round(v, 2) for k, v in best.items()},
        "bookkeeping_above_dynamo_aot_us": {
            "graphtrees": round(ours, 2),
            "pytorch_trees": round(theirs, 2),
        },
        "ratio_pytorch_over_graphtrees": round(theirs / ours, 1) if ours > 0 else None,
        "iters": iters,
        "rounds": rounds,
    }


def dropin_cases():
    """name -> (make(compiled) -> a no-argument call, grad mode): what tests/test_policy.py
    records, each a torch.compile(mode="reduce-overhead") function."""

    def mlp():
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)
        ).cuda()

    def inference(compile):
        m, x = compile(mlp()), torch.randn(8, 64, device="cuda")
        return lambda: m(x)

    def training(compile):
        m, x = compile(mlp()), torch.randn(8, 64, device="cuda")

        params = list(m.parameters())

        def step():
            torch.compiler.cudagraph_mark_step_begin()
            for p in params:  # PyTorch's trees refuse to accumulate into a graph's .grad
                p.grad = None
            m(x).sum().backward()

        return step

    def graph_break(compile):
        def g(x):
            y = f(x)
            torch._dynamo.graph_break()
            return f(y)

        c, x = compile(g), torch.ones(64, device="cuda")
        return lambda: c(x)

    def mutated_buffer(compile):
        class Counter(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(64, 64)
                self.register_buffer("steps", torch.zeros(()))

            def forward(self, x):
                self.steps.add_(1)
                return self.lin(x)

        m, x = compile(Counter().cuda()), torch.randn(8, 64, device="cuda")
        return lambda: m(x)

    def dynamic(compile):
        c = compile(f, dynamic=True)
        xs = [torch.ones(n, device="cuda") for n in (16, 32, 64)]
        state = {"i": 0}

        def call():
            state["i"] += 1
            return c(xs[state["i"] % 3])

        return call

    return {
        "MLP inference": (inference, False),
        "MLP training step (fwd + bwd)": (training, True),
        "graph break (2 graphs)": (graph_break, False),
        "mutated static buffer": (mutated_buffer, False),
        "dynamic shapes (3 sizes)": (dynamic, False),
    }


def bench_dropin(iters, rounds):
    """The same reduce-overhead functions, PyTorch's trees against graphtrees.install()."""

    def compiled(m, **kw):
        if graphtrees.installed():
            # mode="reduce-overhead" spelt as its options (graph_partition=True is the default
            # anyway): another backend for dynamo, so that this compile does not reuse the one
            # PyTorch's trees already made of the same code.
            options = {"triton.cudagraphs": True, "graph_partition": True}
            return torch.compile(m, options=options, **kw)
        return torch.compile(m, mode="reduce-overhead", **kw)

    rows = []
    for name, (make, grad) in dropin_cases().items():
        row = {"function": name}
        calls = {}
        graphtrees.reset()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        with torch.set_grad_enabled(grad):
            for impl in ("pytorch_trees", "graphtrees"):
                with graphtrees.install() if impl == "graphtrees" else contextlib.nullcontext():
                    call = make(compiled)
                    for _ in range(6):  # warm up, record, compile (while installed)
                        call()
                calls[impl] = call
            # PyTorch's pool is every private pool but graphtrees' (one tree, one pool).
            info = graphtrees.tree_info("cuda")
            ours = info["pool"]["reserved_bytes"]
            row["pytorch_trees_pool_mib"] = round((private_pool_bytes() - ours) / 2**20, 2)
            row["graphtrees_pool_mib"] = round(ours / 2**20, 2)
            row["graphtrees_nodes"] = info["num_nodes"]
            # Both stay usable side by side: PyTorch's trees and graphtrees' tree are separate.
            best = {k: float("inf") for k in calls}
            for _ in range(rounds):
                for k, call in calls.items():
                    best[k] = min(best[k], per_call_us(call, iters))
        torch.cuda.synchronize()
        row.update({f"{k}_us": round(v, 2) for k, v in best.items()})
        row["ratio"] = round(best["pytorch_trees"] / best["graphtrees"], 2)
        rows.append(row)
    graphtrees.reset()
    torch._dynamo.reset()
    return {"rows": rows, "iters": iters, "rounds": rounds}


def private_pool_bytes():
    return sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def bench_memory(ks):
    rows = []
    numel = 1 << 20  # 4 MiB of float32 per activation
    for k in ks:
        row = {"branches": k}
        for impl in ("graphtrees", "pytorch_trees"):
            graphtrees.reset()
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            if impl == "graphtrees":
                make = graphtrees.cudagraphify
            else:

                def make(fn):
                    return torch.compile(fn, mode="reduce-overhead")

            prefix = make(lambda x: x * 2)
            branches = [make(lambda y, i=i: (y + i) * y) for i in range(k)]
            x = torch.ones(numel, device="cuda")
            with torch.no_grad():
                for b in branches:
                    for _ in range(3):
                        torch.compiler.cudagraph_mark_step_begin()
                        out = b(prefix(x))
                del out
            row[f"{impl}_pool_mib"] = round(private_pool_bytes() / 2**20, 1)
        rows.append(row)
    graphtrees.reset()
    torch._dynamo.reset()
    return rows


def bench_capture(shapes=16):
    model = (
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        .cuda()
        .eval()
    )
    buckets = [8 * (i + 1) for i in range(shapes)]
    g = graphtrees.cudagraphify(model, buckets=buckets, name="buckets")
    x = torch.ones(8, 256, device="cuda")
    t0 = time.perf_counter()
    with torch.no_grad():
        report = g.capture(x, progress=False)
    seconds = time.perf_counter() - t0
    pool = graphtrees.tree_info("cuda")["pool"]["reserved_bytes"]
    graphtrees.reset()
    return {
        "buckets": shapes,
        "total_ms": round(seconds * 1000, 1),
        "ms_per_bucket": round(seconds * 1000 / shapes, 1),
        "recorded": sum(r["status"] == "recorded" for r in report),
        "pool_mib": round(pool / 2**20, 1),
    }


def markdown(res):
    m = res["meta"]
    lines = [
        f"# {LABEL}",
        "",
        f"{m['date']}, torch {m['torch']}, {m['device']}, Python {m['python']}. One process; "
        "each variant's minimum over interleaved rounds. Not a GPU run: kernels never execute, "
        "so these are host-side costs only.",
    ]
    if "machine" in m:
        mm = m["machine"]
        caches = ", ".join(f"{k} {v}" for k, v in mm["caches"].items())
        lines += ["", f"Machine: {mm['cpu']}, {mm['cores']} cores ({caches}), host {mm['host']}."]
    if "overhead" in res:
        o = res["overhead"]
        lines += [
            "",
            f"## Cost per call (f = 10 x (x * 1.5 + 1.0) on 64 floats; minimum over "
            f"{o['rounds']} rounds of {o['iters']} calls)",
            "",
            "| variant | us per call |",
            "|---|---|",
        ]
        lines += [f"| {k} | {v} |" for k, v in o["us_per_call"].items()]
        b = o["bookkeeping_above_dynamo_aot_us"]
        lines += [
            "",
            f"Above the dynamo + AOTAutograd floor: graphtrees {b['graphtrees']} us, PyTorch's "
            f"trees {b['pytorch_trees']} us per call ({o['ratio_pytorch_over_graphtrees']}x).",
        ]
    if "dropin" in res:
        d = res["dropin"]
        lines += [
            "",
            '## Drop-in: torch.compile(mode="reduce-overhead"), PyTorch\'s trees against '
            "graphtrees.install()",
            "",
            f"us per call (minimum over {d['rounds']} interleaved rounds of {d['iters']} calls) "
            "and private pool MiB after six calls.",
            "",
            "| function | PyTorch's trees us | graphtrees us | ratio | PyTorch's trees pool MiB "
            "| graphtrees pool MiB | graphtrees nodes |",
            "|---|---|---|---|---|---|---|",
        ]
        if d.get("skipped"):
            lines.append(f"| skipped: {d['skipped']} | | | | | | |")
        for r in d["rows"]:
            lines.append(
                f"| {r['function']} | {r['pytorch_trees_us']} | {r['graphtrees_us']} | "
                f"{r['ratio']}x | {r['pytorch_trees_pool_mib']} | {r['graphtrees_pool_mib']} | "
                f"{r['graphtrees_nodes']} |"
            )
    if "memory" in res:
        lines += [
            "",
            "## Pool memory for K sibling branches after one prefix (4 MiB activations)",
            "",
            "| K | graphtrees pool MiB | PyTorch's trees pool MiB |",
            "|---|---|---|",
        ]
        for r in res["memory"]:
            lines.append(
                f"| {r['branches']} | {r['graphtrees_pool_mib']} | {r['pytorch_trees_pool_mib']} |"
            )
    if "capture" in res:
        c = res["capture"]
        lines += [
            "",
            "## Capture of 16 buckets, largest first (`wrapped.capture()`)",
            "",
            f"{c['recorded']} of {c['buckets']} recorded in {c['total_ms']} ms "
            f"({c['ms_per_bucket']} ms a bucket); pool {c['pool_mib']} MiB.",
        ]
    return "\n".join(lines + [""])


def host_cost_only():
    """Starts this process again without the stand-in's value mode, if it is on: the engine
    computes every op's values on the host, several microseconds an op, which is not the cost
    of graphtrees or of torch (tests/cuda_standin/README.md, "The value mode")."""
    if current() is not None and os.environ.get("CUDA_STANDIN_VALUES") != "0":
        env = dict(os.environ, CUDA_STANDIN_VALUES="0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main():
    host_cost_only()
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--sections",
        default="overhead,dropin,memory,capture",
        help="comma-separated: overhead, dropin, memory, capture (CI runs overhead alone)",
    )
    args = p.parse_args()
    sections = set(args.sections.split(","))
    if current() is None:
        sys.exit("bench_standin.py runs on the CUDA stand-in: see tests/cuda_standin/README.md")
    if os.environ.get("GRAPHTREES_CUDA") != "1":
        sys.exit(
            "bench_standin.py measures graphtrees' CUDA backend, which is off without "
            "GRAPHTREES_CUDA=1 (its calls would run eagerly): run it with GRAPHTREES_CUDA=1"
        )
    res = {
        "meta": {
            "label": LABEL,
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "python": sys.version.split()[0],
            "machine": machine(),
        },
    }
    if "overhead" in sections:
        res["overhead"] = bench_overhead(args.iters, args.rounds)
    if "dropin" in sections:
        res["dropin"] = (
            bench_dropin(max(1, args.iters // 4), args.rounds)
            if graphtrees._policy.hook_available()
            else {"rows": [], "iters": 0, "rounds": 0, "skipped": "no cudagraph_policy hook"}
        )
    if "memory" in sections:
        res["memory"] = bench_memory((1, 2, 4, 8))
    if "capture" in sections:
        res["capture"] = bench_capture()
    text = markdown(res)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"standin-{res['meta']['date']}")
        with open(base + ".json", "w") as fh:
            json.dump(res, fh, indent=1)
        with open(base + ".md", "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
