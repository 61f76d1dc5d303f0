"""Serving benchmark on the CPU backend: shape buckets on a small transformer block (measurements,
not tests).

    python benchmarks/bench_buckets.py [--quick]   (--quick: fewer iterations, prints only)

Buckets 1..64: the powers of two and every multiple of 8 (1, 2, 4, 8, 16, 24, ..., 64). Writes
benchmarks/results/cpu-buckets-<date>.json and .md with
  1. capture time: wrapped.capture() recording every bucket, largest first, per bucket and total;
  2. pool bytes after capture, all buckets in one tree, against the sum of each bucket recorded
     alone in its own pool;
  3. per-call cost of padding and narrowing: a batch that is padded up to its bucket against a
     call at the bucket's exact size, on the transformer block and on a launch-bound function
     (where graphtrees' own work is all there is to see).
On the CPU emulation a replay re-runs the callable, so (3) includes the block's compute.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from bench_cpu import per_call_us  # benchmarks/ is the script's directory, first on sys.path

import graphtrees

HERE = os.path.dirname(os.path.abspath(__file__))
BUCKETS = sorted({1, 2, 4, 8, 16, 32, 64} | set(range(8, 65, 8)))
SEQ, D_MODEL = 16, 128


def block():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        D_MODEL, nhead=4, dim_feedforward=256, batch_first=True, dropout=0.0
    )
    return layer.eval()


def reserved():
    return graphtrees.tree_info("cpu")["pool"]["reserved_bytes"]


def bench_capture():
    graphtrees.reset()
    model = block()
    step = graphtrees.cudagraphify(model, buckets=BUCKETS, name="block")
    t0 = time.perf_counter()
    report = step.capture(torch.randn(3, SEQ, D_MODEL), progress=False)
    total = time.perf_counter() - t0
    assert all(r["status"] == "recorded" for r in report), report
    shared = reserved()
    alone = []
    for b in BUCKETS:
        graphtrees.reset()
        one = graphtrees.cudagraphify(block(), buckets=[b], name=f"block_{b}")
        one.capture(torch.randn(b, SEQ, D_MODEL), progress=False)
        alone.append({"bucket": b, "reserved_bytes": reserved()})
    graphtrees.reset()
    return {
        "buckets": BUCKETS,
        "capture_seconds_total": round(total, 3),
        "per_bucket": [
            {
                "bucket": r["size"],
                "seconds": round(r["seconds"], 4),
                "pool_bytes_after": r["pool_bytes_after"],
            }
            for r in report
        ],
        "shared_pool_reserved_bytes": shared,
        "separate_pools_reserved_bytes": sum(a["reserved_bytes"] for a in alone),
        "separate_pools": alone,
    }


def bench_padding(iters):
    rows = []
    with torch.inference_mode():
        cases = [
            ("transformer block", block(), lambda b: torch.randn(b, SEQ, D_MODEL)),
            ("x * 2 + 1 (launch-bound)", lambda x: x * 2 + 1, lambda b: torch.randn(b, 16)),
        ]
        for name, fn, make in cases:
            graphtrees.reset()
            step = graphtrees.cudagraphify(fn, buckets=BUCKETS, name="bench")
            step.capture(make(1), progress=False)
            for padded, bucket in ((5, 8), (33, 40), (57, 64)):
                xp, xb = make(padded), make(bucket)
                for _ in range(3):
                    step(xp)
                    step(xb)
                before = graphtrees.tree_info("cpu")["num_replays"]
                t_pad = per_call_us(lambda: step(xp), iters)
                t_exact = per_call_us(lambda: step(xb), iters)
                t_eager = per_call_us(lambda: fn(xp), iters)
                assert graphtrees.tree_info("cpu")["num_replays"] > before
                rows.append(
                    {
                        "function": name,
                        "batch": padded,
                        "bucket": bucket,
                        "padded_us": round(t_pad, 2),
                        "exact_bucket_us": round(t_exact, 2),
                        "padding_overhead_us": round(t_pad - t_exact, 2),
                        "eager_at_batch_us": round(t_eager, 2),
                    }
                )
    graphtrees.reset()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    torch.set_num_threads(1)
    iters = 20 if args.quick else 200
    with torch.inference_mode():
        capture = bench_capture()
    padding = bench_padding(iters)
    date = datetime.date.today().isoformat()
    meta = {
        "date": date,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "backend": "cpu-emulation",
        "graphtrees": graphtrees.__version__,
    }
    out = {"meta": meta, "capture": capture, "padding": padding}
    mib = 1 << 20
    lines = [
        f"# Shape buckets on the CPU backend ({date})",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['machine']}, "
        f"{meta['cpu_threads']} thread, graphtrees {meta['graphtrees']}. A "
        f"`TransformerEncoderLayer(d_model={D_MODEL}, nhead=4, dim_feedforward=256)` on "
        f"(batch, {SEQ}, {D_MODEL}); buckets {BUCKETS}.",
        "",
        "## Capture of every bucket (`wrapped.capture()`, largest first)",
        "",
        f"Total: {capture['capture_seconds_total']} s.",
        "",
        "| bucket | seconds | pool MiB after |",
        "|---:|---:|---:|",
    ]
    for r in capture["per_bucket"]:
        lines.append(f"| {r['bucket']} | {r['seconds']} | {r['pool_bytes_after'] / mib:.1f} |")
    lines += [
        "",
        "## Pool memory",
        "",
        f"* all buckets in one tree: {capture['shared_pool_reserved_bytes'] / mib:.1f} MiB",
        f"* each bucket in its own pool, summed: "
        f"{capture['separate_pools_reserved_bytes'] / mib:.1f} MiB",
        "",
        "## Padding and narrowing per call (microseconds, median of 7 means)",
        "",
        "| function | batch | bucket | padded call | exact-size call | overhead | eager at batch |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in padding:
        lines.append(
            f"| {r['function']} | {r['batch']} | {r['bucket']} | {r['padded_us']} | "
            f"{r['exact_bucket_us']} | {r['padding_overhead_us']} | "
            f"{r['eager_at_batch_us']} |"
        )
    print("\n".join(lines))
    if args.quick:
        return  # a smoke run writes nothing
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    base = os.path.join(HERE, "results", f"cpu-buckets-{date}")
    with open(base + ".json", "w") as f:
        json.dump(out, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
