"""CPU-backend benchmarks of graphtrees' tree manager (measurements, not tests).

    python benchmarks/bench_cpu.py [--quick]

Writes benchmarks/results/cpu-<date>.json and .md:
  1. per-call overhead of a replay: wrapped call minus eager call, for 1 and 8 inputs/outputs;
  2. lookup cost with 1, 10, 100 and 1000 sibling nodes under one parent (should stay flat);
  3. pool reserved bytes for K sibling branches sharing a prefix, against K separate pools.
(1) uses the Python replay (cpu_replay="python": the callable runs again), so it measures
everything graphtrees adds around a call: argument flattening, signature and child lookup, liveness bookkeeping, copying inputs
into placeholders, replaying the allocation sequence and building the outputs.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

import graphtrees

HERE = os.path.dirname(os.path.abspath(__file__))


def per_call_us(fn, iters, repeats=7):
    """Median over `repeats` of the mean wall time per call, in microseconds."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


def bench_overhead(iters):
    rows = []
    for n in (1, 8):
        xs = [torch.randn(16) for _ in range(n)]

        def f(*args):
            return tuple(a + 1 for a in args) if len(args) > 1 else args[0] + 1

        g = graphtrees.cudagraphify(f, name=f"add1_x{n}", cpu_replay="python")
        for _ in range(5):
            g(*xs)
        eager = per_call_us(lambda: f(*xs), iters)
        wrapped = per_call_us(lambda: g(*xs), iters)
        info = graphtrees.tree_info("cpu")
        assert info["num_replays"] > 0
        rows.append(
            {
                "inputs_outputs": n,
                "eager_us": round(eager, 2),
                "wrapped_us": round(wrapped, 2),
                "overhead_us": round(wrapped - eager, 2),
            }
        )
        graphtrees.reset()
    return rows


def bench_lookup(sizes, iters):
    rows = []
    for n in sizes:
        graphtrees.reset()
        parent = graphtrees.cudagraphify(lambda x: x + 1, name="parent")
        x = torch.randn(16)
        siblings = []
        for k in range(n):
            h = graphtrees.cudagraphify(lambda y: y * 2, name=f"sibling{k}")
            for _ in range(3):  # warmup, record, replay under `parent`
                graphtrees.mark_step_begin()
                h(parent(x))
            siblings.append(h)
        info = graphtrees.tree_info("cpu")
        (root,) = [nd for nd in info["nodes"] if nd["parent"] is None]
        assert len(root["children"]) == n, (len(root["children"]), n)
        target = siblings[n // 2]

        def step():
            graphtrees.mark_step_begin()
            target(parent(x))

        rows.append({"siblings": n, "step_us": round(per_call_us(step, iters), 2)})
    graphtrees.reset()
    return rows


def bench_memory(ks, mib):
    rows = []
    numel = mib * 2**20 // 4
    for k in ks:
        graphtrees.reset()
        prefix = graphtrees.cudagraphify(lambda x: x * 2, name="prefix")
        x = torch.randn(numel)
        branches = [
            graphtrees.cudagraphify(lambda y: (y.exp() + 1).log() * y, name=f"branch{i}")
            for i in range(k)
        ]
        for b in branches:
            for _ in range(3):
                graphtrees.mark_step_begin()
                out = b(prefix(x))
        del out
        info = graphtrees.tree_info("cpu")
        separate = sum(nd["pool_bytes"] for nd in info["nodes"])
        branch_bytes = [
            nd["pool_bytes"] for nd in info["nodes"] if nd["function"].startswith("branch")
        ]
        prefix_bytes = [nd["pool_bytes"] for nd in info["nodes"] if nd["function"] == "prefix"][0]
        rows.append(
            {
                "branches": k,
                "tree_reserved_mib": round(info["pool"]["reserved_bytes"] / 2**20, 1),
                "separate_pools_written_mib": round(separate / 2**20, 1),
                "one_path_written_mib": round((prefix_bytes + max(branch_bytes)) / 2**20, 1),
            }
        )
    graphtrees.reset()
    return rows


def markdown(results):
    m = results["meta"]
    lines = [
        f"# graphtrees CPU benchmarks ({m['date']})",
        "",
        f"torch {m['torch']}, Python {m['python']}, {m['machine']} ({m['cpus']} CPUs), "
        f"backend: CPU emulation. Medians of 7 repeats.",
        "",
        "## Per-call overhead of a replay (wrapped minus eager)",
        "",
        "| inputs/outputs | eager µs | wrapped µs | overhead µs |",
        "|---:|---:|---:|---:|",
    ]
    for r in results["overhead"]:
        lines.append(
            f"| {r['inputs_outputs']} | {r['eager_us']} | {r['wrapped_us']} | {r['overhead_us']} |"
        )
    lines += [
        "",
        "## Lookup cost with N sibling nodes (one step = parent replay + child replay)",
        "",
        "| siblings | step µs |",
        "|---:|---:|",
    ]
    for r in results["lookup"]:
        lines.append(f"| {r['siblings']} | {r['step_us']} |")
    lines += [
        "",
        "## Pool memory: K sibling branches after one shared prefix",
        "",
        "| branches | tree pool reserved MiB | K separate pools (sum written) MiB | one path written MiB |",
        "|---:|---:|---:|---:|",
    ]
    for r in results["memory"]:
        lines.append(
            f"| {r['branches']} | {r['tree_reserved_mib']} | {r['separate_pools_written_mib']} | "
            f"{r['one_path_written_mib']} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    iters = 200 if args.quick else 2000
    torch.set_num_threads(1)
    with torch.inference_mode():
        results = {
            "meta": {
                "date": datetime.date.today().isoformat(),
                "torch": torch.__version__,
                "graphtrees": graphtrees.__version__,
                "python": platform.python_version(),
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "iters": iters,
            },
            "overhead": bench_overhead(iters),
            "lookup": bench_lookup([1, 10, 100] if args.quick else [1, 10, 100, 1000], iters // 2),
            "memory": bench_memory([1, 2, 4, 8], 4 if args.quick else 16),
        }
    md = markdown(results)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"cpu-{results['meta']['date']}")
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(md)
        print(f"wrote {base}.json and {base}.md", file=sys.stderr)


if __name__ == "__main__":
    main()
