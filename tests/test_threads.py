"""Threads that share one graphed function (Note [Locks and the GIL] in csrc/TreeLock.h).

Each hazard a design review found (../shared/reference/design-review-6.md, H1...) has its test
here. A test whose failure is a crash runs its threads in a subprocess, so that the crash fails
the test instead of ending the run."""

import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT

# H1: four threads call one wrapper that keeps two signatures, with six batch sizes at random. An
# eviction waits for another thread's tree lock with the GIL released; the signature cache was
# iterated and erased across that wait, and ended the process with SIGSEGV (4 runs of 4).
H1_SCRIPT = """
import random, sys, threading, time
import torch, graphtrees

device = sys.argv[1]
calls = int(sys.argv[2])

def fn(x):
    time.sleep(0)  # lets the other threads run in the middle of a warmup or a recording
    return x * 2 + 1

g = graphtrees.cudagraphify(fn, max_recorded_shapes=2)
sizes = [1, 2, 3, 4, 5, 6]
wrong = []
errors = []

def worker(seed):
    rng = random.Random(seed)
    try:
        with torch.no_grad():
            for _ in range(calls):
                b = rng.choice(sizes)
                x = torch.full((b, 8), float(b), device=device)
                y = g(x)
                # Read it now: a later call of this thread may overwrite it (a generation).
                if y.shape != (b, 8) or not bool((y.cpu() == 2 * b + 1).all()):
                    wrong.append((b, tuple(y.shape)))
    except Exception as e:  # noqa: BLE001 - reported below
        errors.append(repr(e))

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("signatures", len(g.signatures()))
print("wrong", len(wrong), wrong[:3])
print("errors", len(errors), errors[:3])
"""


def test_threads_sharing_a_wrapper_that_evicts_do_not_crash(device):
    calls = 1500 if device == "cpu" else 300
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(H1_SCRIPT), device, str(calls)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["errors"].startswith("0 "), lines["errors"]
    assert lines["wrong"].startswith("0 "), lines["wrong"]
    # The bound holds: no signature was inserted past a concurrent eviction, none orphaned.
    assert int(lines["signatures"]) <= 2, lines["signatures"]


def _run_threads_script(script, device, timeout=300):
    """Runs `script` (its argv[1] is the device) in a fresh process; a hang inside fails the test
    with the process's own message (the script exits 3 after a join timeout) or the subprocess
    timeout, instead of hanging the run."""
    cmd = [sys.executable, "-c", textwrap.dedent(script), device]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the threads hung past {timeout} s: {e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
