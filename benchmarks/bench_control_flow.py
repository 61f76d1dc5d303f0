"""A loop of calls with a data-dependent torch.cond: graphtrees' recording against eager.

Each call runs f(x) = a few ops, then torch.cond on x's sum (the sign alternates call by call, so
both branches run), then a few more; the loop makes N calls. Variants, in microseconds per call:

* eager: f called directly (torch's own cond: it reads the predicate on the host every call);
* graphtrees: cudagraphify(f), replayed -- on the CPU backend the op program's control step
  (`program-branch`: the predicate read from C++, no Python), on CUDA two IF conditional nodes
  (`conditional-node`: the predicate read on the device, no host sync);
* tree-branch (cond only): cudagraphify(f, cond_form="tree-branch") -- f traced by torch.compile
  and split at the cond: the piece before, then the predicate read on the host, then the taken
  branch's node (Note [A wrapper's cond split into tree branches]); dynamo's guards and the
  Python between the pieces are in its figure;
* with `--while-loop`, a torch.while_loop whose trip count changes per call instead.

    python benchmarks/bench_control_flow.py --device cpu
    python tests/cuda_standin/standin.py run -- env GRAPHTREES_CUDA=1 CUDA_STANDIN_VALUES=0 \\
        python benchmarks/bench_control_flow.py --device cuda        # CUDA stand-in: host cost
    GRAPHTREES_CUDA=1 python benchmarks/bench_control_flow.py --device cuda  # on a GPU

On the CUDA stand-in (a fake CUDA runtime, not a GPU) kernels are not executed: with
CUDA_STANDIN_VALUES=0 the figures are host cost per call; each call's predicate is then whatever
bytes memory holds, so the loop variant needs the value mode (`standin.py run`'s default), whose
host-computed values dominate its figures (the header says which mode ran). Results say which device, machine and torch they were taken with; every variant is
checked against eager before it is timed (not on the stand-in without values).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _standin():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from cuda_standin.standin import current

    return current()


def make(kind, width):
    import torch

    def branch_big(t):
        for _ in range(4):
            t = t * 1.01 + 0.5
        return t

    def branch_small(t):
        return t - 1.0

    def f_cond(x):
        y = x * 2.0 + 1.0
        z = torch.cond(y.sum() > 0, branch_big, branch_small, (y,))
        return z.relu() + 1.0

    def f_loop(x, n):
        def body(i, t):
            return i + 1, t * 1.01 + 0.5

        return torch.while_loop(lambda i, t: i < n, body, (torch.zeros_like(n), x))[1]

    return f_cond if kind == "cond" else f_loop


def calls_for(kind, device, width, n):
    import torch

    base = torch.rand(width, device=device) + 0.1
    if kind == "cond":
        return [((base if k % 2 == 0 else -base),) for k in range(n)]
    trips = [0, 1, 4, 2, 7, 3]
    return [(base, torch.tensor(trips[k % len(trips)], device=device)) for k in range(n)]


def timed(fn, calls, device, sync):
    import graphtrees

    t0 = time.perf_counter()
    for args in calls:
        graphtrees.mark_step_begin()
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / len(calls) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--while-loop", action="store_true", help="the loop variant")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    import torch

    import graphtrees

    torch.set_grad_enabled(False)
    standin = None
    if args.device == "cuda":
        if os.environ.get("GRAPHTREES_CUDA") != "1":
            sys.exit("bench_control_flow: CUDA needs GRAPHTREES_CUDA=1 (graphtrees' CUDA backend)")
        standin = _standin()
    kind = "while_loop" if args.while_loop else "cond"
    values = standin is None or standin.values_enabled()
    if kind == "while_loop" and not values:
        sys.exit(
            "bench_control_flow: the loop variant needs the predicate's values: on the CUDA "
            "stand-in, its value mode (CUDA_STANDIN_VALUES=1)"
        )
    f = make(kind, args.width)
    calls = calls_for(kind, args.device, args.width, args.calls)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    g = graphtrees.cudagraphify(f)
    variants = {"graphtrees": g}
    if kind == "cond":
        variants["tree-branch"] = graphtrees.cudagraphify(f, cond_form="tree-branch")
    for fn in variants.values():
        for a in calls[:8]:  # warmup and recording of both branches, checked against eager
            graphtrees.mark_step_begin()
            out = fn(*a)
            if values:
                expected = f(*a)
                assert torch.allclose(out.cpu(), expected.cpu(), rtol=1e-4, atol=1e-4), "wrong"
    info = graphtrees.tree_info(args.device)
    forms = sorted({c["form"] for n in info["nodes"] for c in n["conditionals"]})
    if any(n["function"].endswith(".cond1.true") for n in info["nodes"]):
        forms.append("tree-branch")
    reasons = sorted({s["eager_reason"] for s in g.signatures() if s["eager_reason"]})
    results = {"eager": [], **{k: [] for k in variants}}
    replays_before = info["num_replays"]
    for _ in range(args.repeats):
        results["eager"].append(timed(f, calls, args.device, sync))
        for k, fn in variants.items():
            results[k].append(timed(fn, calls, args.device, sync))
    replays = graphtrees.tree_info(args.device)["num_replays"] - replays_before
    where = (
        (
            "CUDA stand-in (values computed on the host by its value engine)"
            if values
            else "CUDA stand-in (kernels not executed: host cost)"
        )
        if standin is not None
        else torch.cuda.get_device_name()
        if args.device == "cuda"
        else "CPU"
    )
    summary = {
        "kind": kind,
        "device": args.device,
        "where": where,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "calls": args.calls,
        "width": args.width,
        "forms": forms,
        "eager_reasons": reasons,
        "replays": replays,
        "us_per_call": {k: min(v) for k, v in results.items()},
        "us_per_call_median": {k: statistics.median(v) for k, v in results.items()},
    }
    print(f"bench_control_flow: a {kind} every call, {args.calls} calls, on {where}")
    print(f"  recorded as: {', '.join(forms) or 'nothing (eager)'} {'; '.join(reasons)}")
    total = args.calls * args.repeats * len(variants)
    print(f"  replays: {replays} over {total} calls (a tree-branch call replays two nodes)")
    for k in results:
        print(f"  {k:>11}: {summary['us_per_call'][k]:9.1f} us per call (min of {args.repeats})")
    e = summary["us_per_call"]["eager"]
    for k in variants:
        print(f"  eager / {k}: {e / summary['us_per_call'][k]:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)


if __name__ == "__main__":
    main()
