"""CPU replays side by side (measurements, not tests), single thread: eager, the Python replay
(cpu_replay="python": the function runs again), the program replay (the recorded ops run from
C++, Note [CPU graphs]) and torch.compile with Inductor, for a 4-op function, a 6-layer MLP
(d=64, batch 1), a transformer encoder layer and the Llama decode step of examples/llm_decode.py.

    python benchmarks/bench_cpu_replay.py [--quick]

Also the program replay's cost per op above the ops' own kernel time: the slope of its time per
call over functions of N cheap ops (views, whose kernels only make a tensor), against eager's.
Writes benchmarks/results/cpu-replay-<date>.{json,md}.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from bench_cpu import HERE, per_call_us

import graphtrees


def four_ops():
    x = torch.randn(64)
    return "4-op function", (lambda x: (x * 2 + 1).relu() - 0.5), (x,)


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    return "6-layer MLP (d=64, batch 1)", torch.nn.Sequential(*layers).eval(), (torch.randn(1, 64),)


def encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0).eval()
    return "transformer encoder layer (d=64, 16 tokens)", layer, (torch.randn(1, 16, 64),)


def llama_decode():
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from llm_decode import cache_argument, tiny_llama

    cfg, model = tiny_llama("cpu")
    cache = transformers.StaticCache(config=cfg, max_cache_len=4096)
    cache_arg = cache_argument(model)

    def step(ids, position):
        out = model(input_ids=ids, cache_position=position, use_cache=True, **{cache_arg: cache})
        return out.logits[:, -1]

    step.reset = cache.reset  # each call writes the next position of the cache
    ids = torch.randint(0, cfg.vocab_size, (1, 1))
    return "Llama decode step (examples/llm_decode.py)", step, (ids, torch.tensor([5]))


def ops_per_call(fn, iters):
    """The top-level ops the profiler sees per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
    return len([e for e in prof.events() if e.cpu_parent is None]) / iters


def per_op_slope(iters):
    """µs per op of eager and of the program replay: the slope of the time per call between
    functions of 10 and 210 views (aten::view's kernel makes a tensor and nothing else)."""

    def chain(n):
        def f(x):
            for _ in range(n):
                x = x.view(-1)
            return x + 1

        return f

    x = torch.randn(16)
    times = {}
    for n in (10, 210):
        f = chain(n)
        graphtrees.reset()
        g = graphtrees.cudagraphify(f, name=f"views{n}")
        for _ in range(3):
            g(x)
        times[n] = (per_call_us(lambda: f(x), iters), per_call_us(lambda: g(x), iters))
    graphtrees.reset()
    return {
        "eager_us_per_op": (times[210][0] - times[10][0]) / 200,
        "program_us_per_op": (times[210][1] - times[10][1]) / 200,
    }


def bench(make, iters, with_inductor):
    name, fn, args = make()
    reset = getattr(fn, "reset", lambda: None)
    row = {"workload": name}
    with torch.no_grad():
        row["eager_us"] = per_call_us(lambda: fn(*args), iters)
        for kind in ("python", "program"):
            graphtrees.reset()
            reset()
            g = graphtrees.cudagraphify(fn, cpu_replay=kind, name=f"{kind}")
            for _ in range(3):
                g(*args)
            reset()
            got = g(*args).clone()
            reset()
            torch.testing.assert_close(got, fn(*args))
            row[f"{kind}_replay_us"] = per_call_us(lambda: g(*args), iters)
            info = graphtrees.tree_info("cpu")
            assert [n["cpu_replay"] for n in info["nodes"]] == [kind], info["nodes"]
            if kind == "program":
                row["ops_per_call"] = ops_per_call(lambda: g(*args), max(10, iters // 10))
        graphtrees.reset()
        reset()
        if with_inductor:
            torch._dynamo.reset()
            compiled = torch.compile(fn)
            t0 = time.perf_counter()
            compiled(*args)
            row["inductor_compile_s"] = time.perf_counter() - t0
            row["inductor_us"] = per_call_us(lambda: compiled(*args), iters)
    row["program_vs_eager"] = row["program_replay_us"] / row["eager_us"]
    return row


def markdown(results):
    m = results["meta"]
    lines = [
        f"# CPU replays side by side ({m['date']})",
        "",
        f"torch {m['torch']}, Python {m['python']}, {m['machine']}, {m['threads']} thread; "
        f"median of 7 runs of {m['iters']} calls, under torch.no_grad().",
        "",
        "| workload | eager µs | Python replay µs | program replay µs | program / eager "
        "| Inductor µs (compile s) | ops per call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        ind = (
            f"{r['inductor_us']:.1f} ({r['inductor_compile_s']:.1f})" if "inductor_us" in r else "-"
        )
        lines.append(
            f"| {r['workload']} | {r['eager_us']:.1f} | {r['python_replay_us']:.1f} | "
            f"{r['program_replay_us']:.1f} | {r['program_vs_eager']:.2f}x | {ind} | "
            f"{r['ops_per_call']:.0f} |"
        )
    slope = results["per_op"]
    lines += [
        "",
        "Ops per call: the top-level ops the profiler saw during a program replay (the recorded",
        "ops and the copies of inputs into the graph's placeholders). Inductor's compile time is",
        "its first call, with Inductor's on-disk caches as the machine had them.",
        "",
        "Cost per op above the kernels (slope of the time per call from 10 to 210 `view` ops, whose",
        f"kernel only makes a tensor): program replay {slope['program_us_per_op']:.3f} µs per op,",
        f"eager {slope['eager_us_per_op']:.3f} µs per op. The program figure includes the view",
        "kernel itself, so it bounds the dispatch cost from above.",
        "",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="few iterations, no Inductor")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    iters = 20 if args.quick else 500
    rows = [
        bench(make, iters if make is not llama_decode else max(5, iters // 10), not args.quick)
        for make in (four_ops, mlp, encoder_layer, llama_decode)
    ]
    results = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
            "threads": torch.get_num_threads(),
            "iters": iters,
        },
        "rows": rows,
        "per_op": per_op_slope(iters),
    }
    md = markdown(results)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"cpu-replay-{results['meta']['date']}")
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
