"""What one recording costs on the host: the call that records a new node, timed alone.

    python benchmarks/bench_record.py [--device cpu|cuda] [--nodes 200]

A small function (three ops) is wrapped once per node, so that each node is a fresh
warmup + recording; only the recording call is timed (its median and mean are printed, in us).
With `--device cuda` on the CUDA stand-in (tests/cuda_standin) this is a stand-in figure, not
a GPU one: kernels are not executed (it runs without the stand-in's value mode), so it measures
graphtrees' and torch's host work.
The `graphtrees` logger is left at its default level (nothing below WARNING is emitted), which
is what a recording costs when nobody reads its log message.
"""

import argparse
import statistics
import time

import torch
from bench_standin import host_cost_only

import graphtrees


def main():
    host_cost_only()
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--nodes", type=int, default=200)
    a = p.parse_args()
    x = torch.randn(64, 64, device=a.device)
    times = []
    for i in range(a.nodes):
        g = graphtrees.cudagraphify(lambda t: (t * 2 + 1).relu(), name=f"f{i}")
        g(x)  # warmup
        graphtrees.mark_step_begin()
        t0 = time.perf_counter()
        g(x)  # recording
        times.append((time.perf_counter() - t0) * 1e6)
        graphtrees.mark_step_begin()
        if i % 50 == 49:
            graphtrees.reset()
    times = times[5:]
    where = "CUDA stand-in" if a.device == "cuda" else a.device
    print(
        f"recording ({where}, torch {torch.__version__}): median {statistics.median(times):.1f} us, "
        f"mean {statistics.mean(times):.1f} us over {len(times)} recordings"
    )


if __name__ == "__main__":
    main()
