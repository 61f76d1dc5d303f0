"""Where the host cost of torch.compile(backend="graphtrees") goes, on the CUDA stand-in (issue 40).

CUDA stand-in: host-side cost, kernels not executed. A measurement, not a test:

    python tests/cuda_standin/standin.py run -- env GRAPHTREES_CUDA=1 \\
        python benchmarks/bench_compile_path.py [--rounds 15]

Prints, in one process, interleaved over rounds (minimum per variant, us per call):
  - the dynamo + AOTAutograd floor (a backend whose compiled graph returns a ready tensor), the
    graphtrees backend with the recorded graph handed over as a BoxedCall (C++, Note [The boxed
    call in C++]) and through the Python adapter it replaced, the aot_eager inner compiler, and
    PyTorch's trees (mode="reduce-overhead");
  - the same GraphedCallable called directly, and cudagraphify;
  - afterwards, in a phase of its own: the cost of one eager op (x.add(1)) and of the graphed call
    measured inside AOTAutograd's runtime wrapper against the same calls made from a plain loop:
    what the compile path's context (caches and predictors that dynamo's and AOTAutograd's Python
    leave cold) does to any C++ work done inside it. It is compiled only once the table above is
    measured: while a compiled function that runs an eager op in its adapter was among the
    interleaved variants, the Inductor-inner variants measured ~8 us dearer (reproducible, cause
    not found; without the eager op they cost what the aot_eager one does).
"""

import argparse
import functools
import time

import torch
from bench_standin import aot_floor_backend, f, fresh, host_cost_only

import graphtrees
from graphtrees import _dynamo_backend as backend


def main():
    host_cost_only()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    x = torch.ones(64, device="cuda")
    aot_ready_backend = aot_floor_backend(f(x))
    made = []
    wrap = backend._wrap

    def keep(*a, **k):
        made.append(wrap(*a, **k))
        return made[-1]

    backend._wrap = keep
    boxed_call = torch.compile(fresh(f), backend="graphtrees")
    timing = {"op": 0, "call": 0, "n": 0}

    def python_adapter(graphed, timed=False):  # what _boxed_graphed was before BoxedCall
        def boxed(inputs):
            flat = list(inputs)
            inputs.clear()
            if not timed:
                return graphed(*flat)
            t0 = time.perf_counter_ns()
            flat[0].add(1)
            t1 = time.perf_counter_ns()
            out = graphed(*flat)
            timing["op"] += t1 - t0
            timing["call"] += time.perf_counter_ns() - t1
            timing["n"] += 1
            return out

        boxed._boxed_call = True
        boxed.graphed = [graphed]
        return boxed

    def compiled_with(adapter):
        saved = backend._boxed_graphed
        backend._boxed_graphed = adapter
        try:
            fn = torch.compile(fresh(f), backend="graphtrees")
            with torch.no_grad():
                fn(x)  # compiles (lazily) with `adapter`
        finally:
            backend._boxed_graphed = saved
        return fn

    with torch.no_grad():
        boxed_call(x)  # compiled (lazily) with the BoxedCall: made[0]
    adapter = compiled_with(python_adapter)  # made[1]
    variants = {
        "dynamo + AOTAutograd floor": torch.compile(fresh(f), backend=aot_ready_backend),
        "graphtrees backend (BoxedCall)": boxed_call,
        "graphtrees backend (Python adapter)": adapter,
        "graphtrees backend, inner=aot_eager": graphtrees.compile(fresh(f), inner="aot_eager"),
        'PyTorch\'s trees (mode="reduce-overhead")': torch.compile(
            fresh(f), mode="reduce-overhead"
        ),
        "cudagraphify (copied input)": graphtrees.cudagraphify(f, name="copied"),
    }
    best, inside, outside = {}, [], []
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(5):
                fn(x)
        variants["the same GraphedCallable, called directly"] = made[1].graphed[0]
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn(x)
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / args.iters * 1e6)
    # The phase of its own (see the docstring): the timed adapter, inside and outside.
    timed_fn = compiled_with(functools.partial(python_adapter, timed=True))
    timed = made[-1]  # its graphtrees function
    with torch.no_grad():
        for _ in range(args.rounds):
            for into, loop in ((inside, lambda: timed_fn(x)), (outside, lambda: timed([x]))):
                timing.update(op=0, call=0, n=0)
                for _ in range(args.iters):
                    loop()
                into.append((timing["op"] / timing["n"], timing["call"] / timing["n"]))
    torch.cuda.synchronize()
    floor = best["dynamo + AOTAutograd floor"]
    print("CUDA stand-in: host-side cost, kernels not executed")
    print(f"us per call (minimum over {args.rounds} interleaved rounds of {args.iters} calls)")
    for name, us in best.items():
        above = "" if name.startswith("dynamo") else f"   ({us - floor:+.2f} above the floor)"
        print(f"  {name:48s} {us:8.2f}{above}")
    ours = best["graphtrees backend (BoxedCall)"] - floor
    theirs = best['PyTorch\'s trees (mode="reduce-overhead")'] - floor
    if ours > 0:
        print(f"  PyTorch's trees / graphtrees above the floor: {theirs / ours:.1f}")
    op_in, call_in = (min(v) / 1e3 for v in zip(*inside))
    op_out, call_out = (min(v) / 1e3 for v in zip(*outside))
    print("inside AOTAutograd's runtime wrapper vs the same calls from a plain loop (min us):")
    print(f"  an eager x.add(1)              {op_in:8.2f} vs {op_out:8.2f}")
    print(f"  the graphed call (a replay)    {call_in:8.2f} vs {call_out:8.2f}")


if __name__ == "__main__":
    main()
