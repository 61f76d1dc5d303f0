"""Piecewise recording (Note [Piecewise graphs]), measured (not tests): for the models of
tests/test_piecewise.py and a 2-layer Llama split at its attention, on the CPU backend,
single thread, with inner="aot_eager" and inner="inductor":

* the fraction of the graph's ops inside recorded pieces (whole-graph eager, piecewise=False,
  records none of them);
* compile time (dynamo + AOTAutograd + the inner compiler + the splitting, and the warmup):
  the first call, with and without splitting;
* time per call once replaying: eager, graphtrees with piecewise=False (the whole graph eager)
  and with piecewise=True;
* for aot_eager, the same with min_piece_ops 1 and 5 (default 3).

    python benchmarks/bench_piecewise.py [--quick]

Writes benchmarks/results/cpu-piecewise-<date>.{json,md}.
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

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def test_models():
    """(name, module, inputs, graphtrees options, dynamo config) for each model measured."""
    import test_piecewise as tp  # the models of the tests, and their custom ops

    torch.manual_seed(0)
    x = torch.randn(64, 8)
    models = []
    for case in ("nonzero", "item", "unsafe_custom_op", "splitting_ops", "first_and_last"):
        args, options, dynamo, _ = tp.CASES[case]
        models.append((f"test model: {case}", tp.Net(*args).eval(), (x,), options, dynamo))
    models.append(("6 x (2 ops, an unsafe op)", Alternating(), (x,), {}, {}))
    from llm_decode import tiny_llama

    _, llama = tiny_llama("cpu")
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    models.append(
        (
            "Llama (2 layers, d=128, 32 tokens), splitting_ops=[sdpa]",
            LlamaLogits(llama),
            (ids,),
            {"splitting_ops": ["aten::scaled_dot_product_attention"]},
            {},
        )
    )
    return models


class Alternating(torch.nn.Module):
    """Pieces of 2 ops between unrecordable ops: what min_piece_ops decides."""

    def forward(self, x):
        import test_piecewise as tp

        for _ in range(6):
            x = tp.host_scale(torch.tanh(x) * 0.5)
        return x


class LlamaLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def call_us(fn, args, iters):
    """bench_cpu.per_call_us of fn(*args), after 3 calls (warmup, recording, a first replay)."""
    for _ in range(3):
        fn(*args)
    return per_call_us(lambda: fn(*args), iters)


def run(model, args, inner, options, dynamo, iters, **extra):
    torch._dynamo.reset()
    graphtrees.reset()
    with torch._dynamo.config.patch(**dynamo):
        compiled = graphtrees.compile(model, inner=inner, **{**options, **extra})
        start = time.perf_counter()
        compiled(*args)
        compile_s = time.perf_counter() - start
        us = call_us(compiled, args, iters)
    splits = graphtrees.split_info()
    total = sum(p["ops"] for pieces in splits.values() for p in pieces)
    recorded = sum(p["ops"] for pieces in splits.values() for p in pieces if p["recorded"])
    t = graphtrees.tree_info("cpu")
    return {
        "compile_s": round(compile_s, 3),
        "per_call_us": round(us, 1),
        "pieces": sum(len(p) for p in splits.values()),
        "recorded_pieces": t["num_nodes"],
        "ops": total,
        "ops_recorded": recorded,
        "fraction_recorded": round(recorded / total, 3) if total else None,
        "replays": t["num_replays"],
        "fallbacks": t["num_fallbacks"],
    }


def main():
    # Cold compiles: no FX graph cache, and a kernel cache of this run's own.
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-piecewise-")
    torch._inductor.config.fx_graph_cache = False
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    iters = 20 if args.quick else 200
    inners = ("aot_eager",) if args.quick else ("aot_eager", "inductor")
    rows = []
    with torch.no_grad():
        # A first compile pays for importing and setting up dynamo, AOTAutograd and Inductor.
        for inner in inners:
            graphtrees.compile(lambda x: x.sin() * 2, inner=inner)(torch.randn(4))
        for name, model, inputs, options, dynamo in test_models():
            with torch._dynamo.config.patch(**dynamo):
                eager_us = call_us(model, inputs, iters)
            for inner in inners:
                whole = run(model, inputs, inner, {}, dynamo, iters, piecewise=False)
                split = run(model, inputs, inner, options, dynamo, iters)
                row = {"model": name, "inner": inner, "eager_us": round(eager_us, 1)}
                row["whole_graph_eager"] = whole
                row["piecewise"] = split
                if inner == "aot_eager" and not args.quick:
                    for k in (1, 5):
                        row[f"min_piece_ops={k}"] = run(
                            model, inputs, inner, options, dynamo, iters, min_piece_ops=k
                        )
                rows.append(row)
                print(json.dumps(row), flush=True)
    results = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": f"{platform.machine()} ({os.cpu_count()} CPUs)",
            "backend": "CPU emulation, 1 thread",
            "iters": iters,
        },
        "rows": rows,
    }
    md = markdown(results)
    print(md)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"cpu-piecewise-{results['meta']['date']}")
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=2)
        with open(base + ".md", "w") as f:
            f.write(md)


def markdown(results):
    m = results["meta"]
    lines = [
        f"# Piecewise recording, CPU backend ({m['date']})",
        "",
        f"torch {m['torch']}, Python {m['python']}, {m['machine']}, {m['backend']}. Per-call: "
        f"median of 7 x {m['iters']} calls. Compile: the first call (dynamo, AOTAutograd, the "
        "inner compiler, the split, the warmup), without Inductor's FX graph cache. Whole-graph eager is `piecewise=False`, what "
        "graphtrees did before: it records none of the graph's ops (in the rows with "
        "`splitting_ops`, nothing forces a split, so `piecewise=False` records the whole graph: "
        "those rows show what keeping an op out of the recordings costs).",
        "",
        "| model | inner | ops | recorded pieces | ops in recorded pieces | compile s (whole / split) "
        "| eager µs | whole-graph eager µs | piecewise µs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        w, s = r["whole_graph_eager"], r["piecewise"]
        lines.append(
            f"| {r['model']} | {r['inner']} | {s['ops']} | {s['recorded_pieces']} of "
            f"{s['pieces']} | {s['ops_recorded']} ({100 * (s['fraction_recorded'] or 0):.0f} %) "
            f"| {w['compile_s']} / {s['compile_s']} | {r['eager_us']} | {w['per_call_us']} "
            f"| {s['per_call_us']} |"
        )
    sweep = [r for r in results["rows"] if "min_piece_ops=1" in r]
    if sweep:
        lines += [
            "",
            "## min_piece_ops (aot_eager): recorded pieces, ops in them, µs per call",
            "",
            "| model | 1 | 3 (default) | 5 |",
            "|---|---:|---:|---:|",
        ]
        for r in sweep:
            cells = [r["min_piece_ops=1"], r["piecewise"], r["min_piece_ops=5"]]
            lines.append(
                f"| {r['model']} | "
                + " | ".join(
                    f"{c['recorded_pieces']} / {c['ops_recorded']} / {c['per_call_us']}"
                    for c in cells
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
