"""GPU benchmarks (measurements, not tests). Needs a CUDA device and GRAPHTREES_CUDA=1.

    GRAPHTREES_CUDA=1 python benchmarks/bench_gpu.py --out benchmarks/results

Side by side, same inputs:
  1. per-call overhead of a replay (wall time per call minus the graph's own GPU time) for
     graphtrees, PyTorch's trees (cudagraphify_impl), torch.cuda.make_graphed_callables and a
     hand-written torch.cuda.CUDAGraph replay;
  2. end to end on launch-bound models at batch 1 (an MLP stack, a transformer decoder step):
     eager, torch.compile(mode="reduce-overhead"), graphtrees;
  3. pool memory of a tree with K branches sharing a prefix, against one pool per graph;
  4. capture time (warmup + recording) for 16 input shapes, graphtrees vs PyTorch's trees.
Each section is independent: a failure is recorded in the JSON and the others still run.
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

import graphtrees

DEV = "cuda"


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


def bench_overhead(iters):
    rows = []
    for n_inputs in (1, 8):
        torch.manual_seed(0)
        chain = Chain()
        xs = [torch.randn(1024, device=DEV) for _ in range(n_inputs)]

        def f(*args):
            outs = tuple(chain(a) for a in args)
            return outs if len(outs) > 1 else outs[0]

        # Hand-written CUDAGraph.
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

        def hand():
            for d, x in zip(static_in, xs):
                d.copy_(x)
            graph.replay()
            return static_out

        gpu_ms = gpu_ms_per_call(graph.replay, iters)
        results = {"hand_written": wall_us_per_call(hand, iters)}

        gt = graphtrees.cudagraphify(f, name=f"chain_x{n_inputs}")
        for _ in range(4):
            graphtrees.mark_step_begin()
            gt(*xs)
        results["graphtrees"] = wall_us_per_call(lambda: gt(*xs), iters)
        graphtrees.reset()

        try:
            from torch._inductor.cudagraph_trees import cudagraphify_impl

            def boxed(inputs):
                args = list(inputs)
                inputs.clear()
                out = f(*args)
                return list(out) if isinstance(out, tuple) else [out]

            pt = cudagraphify_impl(
                boxed, list(xs), (), device_index=0, is_backward=False, is_inference=True
            )
            for _ in range(4):
                torch.compiler.cudagraph_mark_step_begin()
                pt(list(xs))

            def pt_call():
                torch.compiler.cudagraph_mark_step_begin()
                return pt(list(xs))

            results["pytorch_trees"] = wall_us_per_call(pt_call, iters)
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            results["pytorch_trees_error"] = repr(e)
        try:
            mgc = torch.cuda.make_graphed_callables(chain, (xs[0].clone(),))
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
    torch.manual_seed(0)
    models = {
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
    rows = []
    for name, (model, args) in models.items():
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


def bench_capture(shapes=16):
    sizes = [8 * (i + 1) for i in range(shapes)]
    model = (
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        .to(DEV)
        .eval()
    )
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
        from torch._inductor.cudagraph_trees import cudagraphify_impl

        def boxed(inputs):
            a = inputs[0]
            inputs.clear()
            return [model(a)]

        t0 = time.perf_counter()
        for b in sizes:
            x = torch.randn(b, 256, device=DEV)
            fn = cudagraphify_impl(
                boxed, [x], (), device_index=0, is_backward=False, is_inference=True
            )
            for _ in range(2):
                torch.compiler.cudagraph_mark_step_begin()
                fn([x])
        torch.cuda.synchronize()
        row["pytorch_trees_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    except Exception as e:  # noqa: BLE001
        row["pytorch_trees_error"] = repr(e)
    return row


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
    args = parser.parse_args()
    if not args.dry_run:
        assert torch.cuda.is_available(), "needs a CUDA device"
        assert os.environ.get("GRAPHTREES_CUDA") == "1", "set GRAPHTREES_CUDA=1"
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


if __name__ == "__main__":
    main()
