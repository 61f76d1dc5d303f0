"""What graphtrees' profiler ranges cost (measurements, not tests).

    python benchmarks/bench_ranges.py [--device cpu|cuda] [--iters N] [--rounds R]

Prints the host cost of one replayed call of a small function (us per call, the best of R rounds
of N calls): with no profiler running -- where the ranges must cost nothing (Note [Call ranges]
in csrc/CallRange.h) -- and inside a running torch.profiler.profile() (CPU activity only), where
each call opens one ``graphtrees::replay`` range. On the CUDA stand-in (tests/cuda_standin/) the
CUDA figures are host costs of the stand-in, not of a GPU.
"""

import argparse
import time

import torch

import graphtrees


def f(x):
    return x * 2 + 1


def per_call_us(fn, iters, rounds):
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def measure(device, iters, rounds):
    x = torch.randn(64, device=device)
    static = graphtrees.cudagraphify(f, static_argnums=(0,), name="static")
    copied = graphtrees.cudagraphify(f, name="copied")
    rows = {}
    for name, g in (("static input", static), ("copied input", copied)):
        for _ in range(3):
            g(x)
        graphtrees.mark_step_begin()

        def call(g=g):
            g(x)
            graphtrees.mark_step_begin()

        rows[f"cudagraphify, {name}, no profiler"] = per_call_us(call, iters, rounds)
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities):
            rows[f"cudagraphify, {name}, under torch.profiler"] = per_call_us(call, iters, rounds)
    if device == "cuda":
        torch.cuda.synchronize()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    rows = measure(a.device, a.iters, a.rounds)
    print(f"| variant ({a.device}) | us per call |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
    main()
