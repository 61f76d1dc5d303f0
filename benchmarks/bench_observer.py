"""What a warmup and a recording cost on the CPU backend for two real models, and how many ops
each observes (Note [One capture observer] in csrc/CaptureObserver.h).

    python benchmarks/bench_observer.py [--runs 7] [--json PATH]

Models, built from configs (random weights, nothing downloaded): a transformers
LlamaForCausalLM decode step (a tiny LlamaConfig: 2 layers, d=64, 4 heads, a StaticCache in a
closure, one token) and a torchvision resnet18 (weights=None, one 3x64x64 image), both in eval
mode under torch.no_grad(). Each run wraps the model afresh, times its first call (the warmup)
and its second (the recording: on the CPU backend the capture, the op program and its
completeness proof), then resets the trees; the medians and minimums over `--runs` runs are
printed (ms): on a loaded machine the minimums are the steadier figures.
Ops per call: the RecordFunction FUNCTION events of one eager call under the profiler (each is
boxed once by the dispatcher when an observer needs inputs).
"""

import argparse
import json
import statistics
import time

import torch

import graphtrees


def llama_step():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    import inspect

    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step(ids, position):
        return model(input_ids=ids, cache_position=position, use_cache=True, **{arg: cache}).logits

    return step, (torch.tensor([[5]]), torch.tensor([3]))


def resnet():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    return model, (torch.randn(1, 3, 64, 64),)


def ops_per_call(fn, args):
    from torch.autograd import profiler

    with profiler.profile() as p:
        fn(*args)
    return sum(1 for e in p.function_events if e.scope == 0)  # RecordScope::FUNCTION


def measure(name, fn, args, runs):
    warm, rec = [], []
    for i in range(runs + 1):
        g = graphtrees.cudagraphify(fn, name=f"{name}{i}")
        graphtrees.mark_step_begin()
        t0 = time.perf_counter()
        g(*args)
        t1 = time.perf_counter()
        graphtrees.mark_step_begin()
        t2 = time.perf_counter()
        g(*args)
        t3 = time.perf_counter()
        info = graphtrees.tree_info("cpu")
        assert info["num_recordings"] == 1, info  # the second call recorded
        graphtrees.reset()
        if i == 0:
            continue  # first run: one-time costs (allocator, dispatcher caches)
        warm.append((t1 - t0) * 1e3)
        rec.append((t3 - t2) * 1e3)
    eager = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        eager.append((time.perf_counter() - t0) * 1e3)
    return {
        "model": name,
        "eager_ms": statistics.median(eager),
        "warmup_ms": statistics.median(warm),
        "record_ms": statistics.median(rec),
        "eager_min_ms": min(eager),
        "warmup_min_ms": min(warm),
        "record_min_ms": min(rec),
        "warmup_all": warm,
        "record_all": rec,
        "ops_per_call": ops_per_call(fn, args),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    with torch.no_grad():
        for name, make in (("llama_decode", llama_step), ("resnet18", resnet)):
            fn, args = make()
            rows.append(measure(name, fn, args, a.runs))
            r = rows[-1]
            print(
                f"{name} (CPU, torch {torch.__version__}): eager {r['eager_ms']:.2f} ms, warmup "
                f"{r['warmup_ms']:.2f} ms, recording {r['record_ms']:.2f} ms (medians of "
                f"{a.runs}; minimums {r['eager_min_ms']:.2f}, {r['warmup_min_ms']:.2f}, "
                f"{r['record_min_ms']:.2f} ms); {r['ops_per_call']} ops per call",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "runs": a.runs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
