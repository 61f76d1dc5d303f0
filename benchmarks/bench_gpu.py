"""GPU benchmarks (measurements, not tests). Needs a CUDA device and GRAPHTREES_CUDA=1.

    GRAPHTREES_CUDA=1 python benchmarks/bench_gpu.py --out benchmarks/results
    python benchmarks/bench_gpu.py --anchor eager --out DIR     # one anchor, no graphtrees

Side by side, same inputs:
  1. per-call overhead of a replay (wall time per call minus the graph's own GPU time) for
     graphtrees, PyTorch's trees (cudagraphify_impl), torch.cuda.make_graphed_callables and a
     hand-written torch.cuda.CUDAGraph replay;
  2. end to end on launch-bound models at batch 1 (an MLP stack, a transformer decoder step):
     eager, torch.compile(mode="reduce-overhead"), graphtrees;
  3. pool memory of a tree with K branches sharing a prefix, against one pool per graph;
  4. capture time (warmup + recording) for 16 input shapes, graphtrees vs PyTorch's trees.
Each section is independent: a failure is recorded in the JSON and the others still run.

`--anchor eager|hand_written|pytorch_trees` measures one anchor alone on the same workloads (the
chain of small kernels with 1 and 8 inputs, the two batch-1 models; PyTorch's trees also the 16
capture shapes and torch.compile(mode="reduce-overhead")), with the replayed values compared with
eager, and merges its rows into DIR/anchors.json after each row, printing one `ANCHOR` line each.
It never imports graphtrees (the import is blocked in that process): scripts/gpu_check.sh runs each
anchor in its own process before graphtrees is built, so that their numbers come back whatever
graphtrees does later.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch

DEV = "cuda"
ANCHORS = ("eager", "hand_written", "pytorch_trees")
graphtrees = None  # imported by main() for the benchmarks, never for an anchor


def gpu_ms_per_call(fn, iters):
    """Mean GPU time per call of back-to-back calls, in ms (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def wall_us_per_call(fn, iters, repeats=5):
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


class Chain(torch.nn.Module):
    """A launch-bound callable: `n` small kernels on a small tensor."""

    def __init__(self, n=10):
        super().__init__()
        self.n = n

    def forward(self, x):
        for i in range(self.n):
            x = x * 1.0001 + 0.0001 * i
        return x


# The workloads, shared by the benchmarks and the anchors (same seeds, same shapes).


def chain_workload(n_inputs):
    """`n_inputs` independent chains of small kernels: (function, inputs)."""
    torch.manual_seed(0)
    chain = Chain()
    xs = [torch.randn(1024, device=DEV) for _ in range(n_inputs)]

    def f(*args):
        outs = tuple(chain(a) for a in args)
        return outs if len(outs) > 1 else outs[0]

    return f, xs


def end_to_end_models():
    """Launch-bound models at batch 1: name -> (model, args)."""
    torch.manual_seed(0)
    return {
        "mlp8x256_b1": (
            torch.nn.Sequential(
                *[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())]
            )
            .to(DEV)
            .eval(),
            (torch.randn(1, 256, device=DEV),),
        ),
        "decoder_step_d256_b1": (
            torch.nn.TransformerDecoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
            .to(DEV)
            .eval(),
            (torch.randn(1, 1, 256, device=DEV), torch.randn(1, 16, 256, device=DEV)),
        ),
    }


def hand_written_graph(f, xs):
    """A torch.cuda.CUDAGraph of f on static copies of xs, warmed up on a side stream: (graph,
    call), where call(*args) copies args into the static inputs, replays and returns the static
    outputs."""
    static_in = [x.clone() for x in xs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f(*static_in)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = f(*static_in)

    def call(*args):
        for d, x in zip(static_in, args):
            d.copy_(x)
        graph.replay()
        return static_out

    return graph, call


def pytorch_trees_callable(f, xs):
    """f through PyTorch's own CUDA graph trees (cudagraphify_impl), warmed up and recorded;
    call(*args) marks a step, runs it and returns f's outputs."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl

    def boxed(inputs):
        args = list(inputs)
        inputs.clear()
        out = f(*args)
        return list(out) if isinstance(out, tuple) else [out]

    eager = f(*xs)
    n_outputs = len(eager) if isinstance(eager, tuple) else 1
    # stack_traces: one per output (torch 2.14 asserts that a node has them when a warmup ends).
    pt = cudagraphify_impl(
        boxed,
        list(xs),
        (),
        device_index=0,
        is_backward=False,
        is_inference=True,
        stack_traces=[None] * n_outputs,
    )

    def call(*args):
        torch.compiler.cudagraph_mark_step_begin()
        out = pt(list(args))
        return tuple(out) if len(out) > 1 else out[0]

    for _ in range(4):
        call(*xs)
    return call


def bench_overhead(iters):
    rows = []
    for n_inputs in (1, 8):
        f, xs = chain_workload(n_inputs)
        graph, hand = hand_written_graph(f, xs)
        gpu_ms = gpu_ms_per_call(graph.replay, iters)
        results = {"hand_written": wall_us_per_call(lambda: hand(*xs), iters)}

        gt = graphtrees.cudagraphify(f, name=f"chain_x{n_inputs}")
        for _ in range(4):
            graphtrees.mark_step_begin()
            gt(*xs)
        results["graphtrees"] = wall_us_per_call(lambda: gt(*xs), iters)
        graphtrees.reset()

        try:
            pt = pytorch_trees_callable(f, xs)
            results["pytorch_trees"] = wall_us_per_call(lambda: pt(*xs), iters)
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            results["pytorch_trees_error"] = repr(e)
        try:
            mgc = torch.cuda.make_graphed_callables(Chain(), (xs[0].clone(),))
            results["make_graphed_callables_1input"] = wall_us_per_call(lambda: mgc(xs[0]), iters)
        except Exception as e:  # noqa: BLE001
            results["make_graphed_callables_error"] = repr(e)
        overhead = {
            k: round(v - gpu_ms * 1000, 2) for k, v in results.items() if isinstance(v, float)
        }
        rows.append(
            {
                "inputs_outputs": n_inputs,
                "graph_gpu_us": round(gpu_ms * 1000, 2),
                "wall_us": {
                    k: round(v, 2) if isinstance(v, float) else v for k, v in results.items()
                },
                "overhead_us": overhead,
            }
        )
    return rows


def bench_end_to_end(iters):
    rows = []
    for name, (model, args) in end_to_end_models().items():
        row = {"model": name}
        row["eager_us"] = round(wall_us_per_call(lambda: model(*args), iters), 2)
        try:
            torch._dynamo.reset()
            ro = torch.compile(model, mode="reduce-overhead")
            for _ in range(5):
                ro(*args)
            row["reduce_overhead_us"] = round(wall_us_per_call(lambda: ro(*args), iters), 2)
        except Exception as e:  # noqa: BLE001
            row["reduce_overhead_error"] = repr(e)
        gt = graphtrees.cudagraphify(model, name=name)
        for _ in range(4):
            gt(*args)
        row["graphtrees_us"] = round(wall_us_per_call(lambda: gt(*args), iters), 2)
        torch.testing.assert_close(gt(*args), model(*args))
        graphtrees.reset()
        rows.append(row)
    return rows


def pool_bytes_by_id():
    out = {}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id", (0, 0)))
        if pid != (0, 0):
            out[pid] = out.get(pid, 0) + seg["total_size"]
    return out


def bench_memory(ks):
    rows = []
    numel = 4 << 20  # 16 MiB of float32 per activation
    for k in ks:
        graphtrees.reset()
        torch.cuda.empty_cache()
        prefix = graphtrees.cudagraphify(lambda x: x * 2, name="prefix")
        branches = [
            graphtrees.cudagraphify(lambda y, i=i: (y.exp() + i).log() * y, name=f"b{i}")
            for i in range(k)
        ]
        x = torch.randn(numel, device=DEV)
        for b in branches:
            for _ in range(3):
                graphtrees.mark_step_begin()
                out = b(prefix(x))
        del out
        tree_reserved = graphtrees.tree_info(DEV)["pool"]["reserved_bytes"]
        graphtrees.reset()
        torch.cuda.empty_cache()
        before = set(pool_bytes_by_id())
        graphs = []
        for i in range(k):  # one pool per graph: prefix + branch captured alone
            static_x = x.clone()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ((static_x * 2).exp() + i).log() * (static_x * 2)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                y = static_x * 2
                out = (y.exp() + i).log() * y
            graphs.append((g, out))
        separate = sum(v for p, v in pool_bytes_by_id().items() if p not in before)
        rows.append(
            {
                "branches": k,
                "tree_reserved_mib": round(tree_reserved / 2**20, 1),
                "separate_pools_reserved_mib": round(separate / 2**20, 1),
            }
        )
        del graphs
        torch.cuda.empty_cache()
    return rows


CAPTURE_SIZES = [8 * (i + 1) for i in range(16)]


def capture_model():
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        .to(DEV)
        .eval()
    )


def pytorch_trees_capture_ms(model, sizes):
    """Warmup + recording of `model` at each batch size through PyTorch's trees, in ms."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl

    def boxed(inputs):
        a = inputs[0]
        inputs.clear()
        return [model(a)]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in sizes:
        x = torch.randn(b, 256, device=DEV)
        fn = cudagraphify_impl(
            boxed,
            [x],
            (),
            device_index=0,
            is_backward=False,
            is_inference=True,
            stack_traces=[None],
        )
        for _ in range(2):
            torch.compiler.cudagraph_mark_step_begin()
            fn([x])
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1000, 1)


def bench_capture(shapes=16):
    sizes = CAPTURE_SIZES[:shapes]
    model = capture_model()
    row = {"shapes": shapes}
    gt = graphtrees.cudagraphify(model, name="capture")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in sizes:
        x = torch.randn(b, 256, device=DEV)
        for _ in range(2):  # warmup + recording
            graphtrees.mark_step_begin()
            gt(x)
    torch.cuda.synchronize()
    row["graphtrees_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    graphtrees.reset()
    try:
        row["pytorch_trees_ms"] = pytorch_trees_capture_ms(model, sizes)
    except Exception as e:  # noqa: BLE001
        row["pytorch_trees_error"] = repr(e)
    return row


# The anchors: what graphtrees is measured against, each alone in its own process.


def anchor_rows(name, iters):
    """(row, thunk) pairs of one anchor, cheapest first; a thunk returns the row's numbers and,
    for a graph, whether its replayed values equal eager's ("values")."""

    def same_as_eager(fn, f, args, **tolerances):
        try:
            torch.testing.assert_close(fn(*args), f(*args), **tolerances)
        except AssertionError as e:
            return "DIFFER: " + " ".join(str(e).split())[:200]
        return "equal to eager"

    def chain(n):
        f, xs = chain_workload(n)
        if name == "eager":
            return {"us_per_call": round(wall_us_per_call(lambda: f(*xs), iters), 2)}
        if name == "hand_written":
            graph, hand = hand_written_graph(f, xs)
            values = same_as_eager(hand, f, xs)
            gpu_us = gpu_ms_per_call(graph.replay, iters) * 1000
            wall = wall_us_per_call(lambda: hand(*xs), iters)
            return {
                "us_per_call": round(wall, 2),
                "graph_gpu_us": round(gpu_us, 2),
                "overhead_us": round(wall - gpu_us, 2),
                "values": values,
            }
        pt = pytorch_trees_callable(f, xs)
        values = same_as_eager(pt, f, xs)
        return {"us_per_call": round(wall_us_per_call(lambda: pt(*xs), iters), 2), "values": values}

    def model(key):
        m, args = end_to_end_models()[key]
        row = {}
        if name == "eager":
            fn = m
        elif name == "hand_written":
            fn = hand_written_graph(m, args)[1]
            row["values"] = same_as_eager(fn, m, args)
        else:  # torch.compile(mode="reduce-overhead"): PyTorch's trees under Inductor
            torch._dynamo.reset()
            fn = torch.compile(m, mode="reduce-overhead")
            for _ in range(5):
                fn(*args)
            # Inductor's fused kernels round differently from eager's.
            row["values"] = same_as_eager(fn, m, args, rtol=1e-3, atol=1e-3)
        return {"us_per_call": round(wall_us_per_call(lambda: fn(*args), iters // 4), 2), **row}

    rows = [("chain_x1", lambda: chain(1)), ("chain_x8", lambda: chain(8))]
    if name == "pytorch_trees":
        rows.append(
            (
                "capture_16_shapes",
                lambda: {"ms": pytorch_trees_capture_ms(capture_model(), CAPTURE_SIZES)},
            )
        )
    suffix = "_reduce_overhead" if name == "pytorch_trees" else ""
    for key in ("mlp8x256_b1", "decoder_step_d256_b1"):
        rows.append((key + suffix, lambda key=key: model(key)))
    return rows


def run_anchor(name, iters, out_dir, dry_run):
    """Measures one anchor and merges its rows into out_dir/anchors.json after each row."""
    sys.modules["graphtrees"] = None  # an anchor never imports graphtrees (ImportError if tried)
    path = os.path.join(out_dir, "anchors.json")
    os.makedirs(out_dir, exist_ok=True)
    try:
        with open(path) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {
            "meta": {
                "date": datetime.date.today().isoformat(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name(0) if not dry_run else "none (dry run)",
                "dry_run": dry_run,
                "iters": iters,
            },
            "anchors": {},
            "errors": {},
        }
    rows = res["anchors"][name] = {}

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=2)

    failed = 0
    with torch.no_grad():
        for key, thunk in anchor_rows(name, iters):
            if dry_run:
                rows[key] = "skipped (dry run)"
                print(f"ANCHOR {name} {key}: skipped (dry run)", flush=True)
                save()
                continue
            t0 = time.perf_counter()
            try:
                rows[key] = thunk()
                text = ", ".join(f"{k} {v}" for k, v in rows[key].items())
                failed += str(rows[key].get("values", "")).startswith("DIFFER")
            except Exception as e:  # noqa: BLE001 - recorded in the results
                traceback.print_exc()
                failed += 1
                res["errors"][f"{name}.{key}"] = traceback.format_exc()
                first = (str(e).strip().splitlines() or [""])[0][:160]
                text = f"failed: {type(e).__name__}: {first}"
            save()
            print(f"ANCHOR {name} {key}: {text} [{time.perf_counter() - t0:.1f} s]", flush=True)
    imported = "graphtrees" in sys.modules and sys.modules["graphtrees"] is not None
    print(f"ANCHOR {name}: graphtrees imported in this process: {'yes' if imported else 'no'}")
    return 1 if failed else 0


def markdown(res):
    m = res["meta"]
    lines = [
        f"# graphtrees GPU benchmarks ({m['date']})",
        "",
        f"{m['gpu']}, torch {m['torch']} (CUDA {m['cuda']}), graphtrees {m['graphtrees']}.",
        "",
    ]
    if "overhead" in res:
        lines += [
            "## Per-call overhead of a replay (wall time per call minus the graph's GPU time, µs)",
            "",
            "| inputs/outputs | graph GPU µs | method | wall µs | overhead µs |",
            "|---:|---:|---|---:|---:|",
        ]
        for r in res["overhead"]:
            for k, v in r["wall_us"].items():
                lines.append(
                    f"| {r['inputs_outputs']} | {r['graph_gpu_us']} | {k} | {v} | "
                    f"{r['overhead_us'].get(k, '')} |"
                )
        lines.append("")
    if "end_to_end" in res:
        lines += [
            "## End to end, batch 1 (µs per call)",
            "",
            "| model | eager | reduce-overhead | graphtrees |",
            "|---|---:|---:|---:|",
        ]
        for r in res["end_to_end"]:
            lines.append(
                f"| {r['model']} | {r.get('eager_us')} | {r.get('reduce_overhead_us', r.get('reduce_overhead_error'))} | "
                f"{r.get('graphtrees_us')} |"
            )
        lines.append("")
    if "memory" in res:
        lines += [
            "## Pool memory, K branches after a shared prefix (MiB)",
            "",
            "| branches | graphtrees tree | one pool per graph |",
            "|---:|---:|---:|",
        ]
        for r in res["memory"]:
            lines.append(
                f"| {r['branches']} | {r['tree_reserved_mib']} | {r['separate_pools_reserved_mib']} |"
            )
        lines.append("")
    if "capture" in res:
        r = res["capture"]
        lines += [
            "## Warmup + recording of 16 shapes (ms)",
            "",
            "| graphtrees | PyTorch trees |",
            "|---:|---:|",
            f"| {r.get('graphtrees_ms')} | {r.get('pytorch_trees_ms', r.get('pytorch_trees_error'))} |",
            "",
        ]
    for k in res.get("skipped", []):
        lines.append(f"- {k}: skipped (dry run)")
    for k, v in res.get("errors", {}).items():
        lines.append(f"- {k} failed: `{v.splitlines()[-1]}`")
    return "\n".join(lines) + "\n"


def write_results(res, out_dir):
    """Rewrites the JSON and Markdown results; called after every section, so that a timeout
    keeps what finished."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"gpu-{res['meta']['date']}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=2)
    md = markdown(res)
    with open(base + ".md", "w") as f:
        f.write(md)
    return md


def main():
    global graphtrees
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU needed: writes the result files with every section skipped",
    )
    parser.add_argument(
        "--anchor",
        choices=ANCHORS,
        help="measure this anchor alone, without importing graphtrees (DIR/anchors.json)",
    )
    args = parser.parse_args()
    if not args.dry_run:
        assert torch.cuda.is_available(), "needs a CUDA device"
    if args.anchor:
        return run_anchor(args.anchor, args.iters, args.out, args.dry_run)
    if not args.dry_run:
        assert os.environ.get("GRAPHTREES_CUDA") == "1", "set GRAPHTREES_CUDA=1"
    import graphtrees as module

    graphtrees = module
    res = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if not args.dry_run else "none (dry run)",
            "graphtrees": graphtrees.__version__,
            "dry_run": args.dry_run,
        },
        "errors": {},
        "skipped": [],
    }
    # end_to_end last: its torch.compile(mode="reduce-overhead") compiles are the slowest part,
    # and a time-out then keeps every other section.
    sections = (
        ("overhead", lambda: bench_overhead(args.iters)),
        ("memory", lambda: bench_memory([1, 2, 4, 8])),
        ("capture", bench_capture),
        ("end_to_end", lambda: bench_end_to_end(args.iters // 4)),
    )
    with torch.no_grad():
        for key, fn in sections:
            t0 = time.perf_counter()
            if args.dry_run:
                res["skipped"].append(key)
            else:
                try:
                    res[key] = fn()
                except Exception:  # noqa: BLE001 - recorded in the results
                    res["errors"][key] = traceback.format_exc()
                    print(res["errors"][key], file=sys.stderr)
                graphtrees.reset()
            write_results(res, args.out)
            print(f"{key} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(write_results(res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
