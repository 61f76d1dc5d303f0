"""A soak of the CPU emulation backend: many calls that switch branches, record, re-record, evict
(max_recorded_shapes), reset and run from several threads, with RSS, pool bytes and live outputs
printed along the way. Fails (exit 1) if any of them grows from the first sample to the last
beyond a small slack, or if a result is ever wrong.

    python scripts/soak.py --calls 1000000 [--threads 4] [--out benchmarks/results/soak-DATE.md]

tests/test_soak.py runs a short version.
"""

import argparse
import datetime
import gc
import os
import sys
import threading
import time

import torch

import graphtrees


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(rounds, per_round, seed, barrier, report, errors):
    """One thread: `rounds` rounds of `per_round` calls; after each, it reports its own tree's
    pool bytes and live outputs and meets the others (the main thread samples, and may reset)."""
    try:
        torch.manual_seed(seed)
        g1 = graphtrees.cudagraphify(lambda x: x * 2 + 1)
        g2 = graphtrees.cudagraphify(lambda h: h.relu() - 0.5)
        g3 = graphtrees.cudagraphify(lambda h: (h.sin(), h.cos()))
        shapes = graphtrees.cudagraphify(lambda x: x.abs() + 1, max_recorded_shapes=2)
        x = torch.randn(64)
        for r in range(rounds):
            with torch.no_grad():
                for i in range(per_round // 3):
                    graphtrees.mark_step_begin()
                    h = g1(x)
                    if i % 3:
                        if not torch.equal(g2(h), (x * 2 + 1).relu() - 0.5):
                            raise AssertionError(f"wrong g2 result at {r}/{i}")
                    elif not torch.equal(g3(h)[0], (x * 2 + 1).sin()):
                        raise AssertionError(f"wrong g3 result at {r}/{i}")
                    y = torch.randn(8 + ((i // 97) % 3) * 8)  # shapes come and go: evictions
                    if not torch.equal(shapes(y), y.abs() + 1):
                        raise AssertionError(f"wrong shapes result at {r}/{i}")
                del h
            info = graphtrees.tree_info("cpu")
            report[seed] = (info["pool"]["reserved_bytes"], info["live_outputs"])
            barrier.wait()  # the main thread samples
            barrier.wait()  # and may have reset every tree
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append(repr(e))
        barrier.abort()


def soak(calls, threads, samples=10):
    """Runs `calls` calls over `threads` threads in `samples` rounds; returns (rows, errors)."""
    rows, errors, report = [], [], {}
    per_round = max(3, calls // samples // threads)
    barrier = threading.Barrier(threads + 1)
    ts = [
        threading.Thread(target=worker, args=(samples, per_round, k, barrier, report, errors))
        for k in range(threads)
    ]
    for t in ts:
        t.start()
    t0 = time.time()
    try:
        for r in range(samples):
            barrier.wait()
            gc.collect()
            pool = sum(p for p, _ in report.values())
            live = sum(n for _, n in report.values())
            done = (r + 1) * (per_round // 3) * 3 * threads
            rows.append((done, round(time.time() - t0, 1), rss_bytes(), pool, live))
            print(f"{done:>9} calls  {rows[-1][1]:>7} s  rss {rows[-1][2] / 2**20:8.1f} MiB  "
                  f"pool {pool / 2**10:8.1f} KiB  live outputs {live}", flush=True)  # fmt: skip
            if r % 4 == 3:
                graphtrees.reset()  # every thread's trees, between their calls
            barrier.wait()
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join()
    return rows, errors


def grew(rows):
    """What grew from the second sample (after the first round's warm-up) to the last."""
    if len(rows) < 3:
        return []
    first, last = rows[1], rows[-1]
    out = []
    if last[2] > first[2] * 1.10 + (16 << 20):
        out.append(f"RSS {first[2] >> 20} -> {last[2] >> 20} MiB")
    if last[3] > first[3] + (4 << 20):
        out.append(f"pool {first[3]} -> {last[3]} bytes")
    if last[4] > first[4] + 16:
        out.append(f"live outputs {first[4]} -> {last[4]}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import logging

    logging.getLogger("graphtrees").setLevel(logging.ERROR)
    rows, errors = soak(args.calls, args.threads)
    problems = errors + grew(rows)
    verdict = "FAILED: " + "; ".join(problems) if problems else "passed: nothing grew"
    print(verdict)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Soak, {datetime.date.today().isoformat()}\n\n")
            f.write(f"torch {torch.__version__}, CPU emulation backend, `python scripts/soak.py "
                    f"--calls {args.calls} --threads {args.threads}`: {verdict}.\n\n")  # fmt: skip
            f.write(
                "| calls | seconds | RSS MiB | pool KiB | live outputs |\n|---:|---:|---:|---:|---:|\n"
            )
            for done, secs, rss, pool, live in rows:
                f.write(f"| {done} | {secs} | {rss / 2**20:.1f} | {pool / 2**10:.1f} | {live} |\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
