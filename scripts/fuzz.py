"""Runs the stateful fuzzer (tests/fuzz_machine.py) long and writes what it covered.

    python scripts/fuzz.py --steps 10000 [--out benchmarks/results/fuzz-DATE.md]

Each example is one machine: a fresh set of graphed functions and up to --steps-per-example rule
applications (calls, drops, steps, resets, budgets, injected failures), every one followed by the
oracle and invariant checks. Stops once --steps calls ran. Exit status 0 means no wrong read.
"""

import argparse
import datetime
import os
import sys
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from fuzz_machine import TreeMachine  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10_000, help="graphed calls to run, at least")
    p.add_argument("--steps-per-example", type=int, default=60)
    p.add_argument("--out", default=None, help="a Markdown file for the results")
    args = p.parse_args()
    t0 = time.time()
    TreeMachine.steps = 0
    examples = 0
    while TreeMachine.steps < args.steps:
        runner = TreeMachine.TestCase
        runner.settings = settings(
            max_examples=100,
            stateful_step_count=args.steps_per_example,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        runner().runTest()
        examples += 100
    took = time.time() - t0
    line = (
        f"{TreeMachine.steps} graphed calls in {examples} machines of up to "
        f"{args.steps_per_example} rules each, {took:.0f} s: no wrong read, every held output "
        "either kept its value or raised the overwritten error, the pool invariant held after "
        "every rule; counters summed over the machines: "
        + ", ".join(f"{k} {v}" for k, v in TreeMachine.totals.items())
    )
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"# Stateful fuzzer, {datetime.date.today().isoformat()}\n\n"
                f"torch {torch.__version__}, CPU emulation backend, "
                f"`python scripts/fuzz.py --steps {args.steps}`\n\n{line}.\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
