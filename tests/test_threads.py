"""Threads that share one graphed function (Note [Locks and the GIL] in csrc/TreeLock.h).

Each hazard a design review found (../shared/reference/design-review-6.md, H1...) has its test
here. A test whose failure is a crash runs its threads in a subprocess, so that the crash fails
the test instead of ending the run."""

import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, STANDIN, standin_values

# H1: four threads call one wrapper that keeps two signatures, with six batch sizes at random. An
# eviction waits for another thread's tree lock with the GIL released; the signature cache was
# iterated and erased across that wait, and ended the process with SIGSEGV (4 runs of 4).
H1_SCRIPT = """
import random, sys, threading, time
import torch, graphtrees

device = sys.argv[1]
calls = int(sys.argv[2])
check_values = sys.argv[3] == "values"

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
                right = not check_values or bool((y.cpu() == 2 * b + 1).all())
                if y.shape != (b, 8) or not right:
                    wrong.append((b, tuple(y.shape)))
    except Exception as e:  # noqa: BLE001 - reported below
        errors.append(repr(e))

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("signatures", len(g.signatures()))
# The threads have exited: calls of one thread bring the cache back within its bound (Note
# [Signatures past the bound]), also calls that find their signatures.
with torch.no_grad():
    for i in range(200):
        graphtrees.mark_step_begin()
        b = sizes[i % 2]
        y = g(torch.full((b, 8), float(b), device=device))
        if check_values and not bool((y.cpu() == 2 * b + 1).all()):
            wrong.append((b, "after"))
print("settled", len(g.signatures()))
print("wrong", len(wrong), wrong[:3])
print("errors", len(errors), errors[:3])
"""


def test_threads_sharing_a_wrapper_that_evicts_do_not_crash(device):
    calls = 1500 if device == "cpu" else 300
    # Values are compared on the CPU, a GPU, and the CUDA stand-in with its value mode; with it
    # off (CUDA_STANDIN_VALUES=0) the stand-in computes none, and shapes are compared alone.
    values = "values" if device == "cpu" or STANDIN is None or standin_values() else "shapes"
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(H1_SCRIPT), device, str(calls), values],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["errors"].startswith("0 "), lines["errors"]
    assert lines["wrong"].startswith("0 "), lines["wrong"]
    # A signature goes in past the bound only while every recorded one is on a current path
    # (Note [Signatures past the bound]): here at most one per thread, each call's path holding
    # one node. None is orphaned, and the calls of one thread bring the cache back within it.
    assert int(lines["signatures"]) <= 2 + 4, lines["signatures"]
    assert int(lines["settled"]) <= 2, lines["settled"]


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


# H2: a graphed function that runs another graphed function on a thread it starts and joins. The
# device lock was held across the user's function in warmups and captures, so the inner thread's
# first call waited for it forever on CUDA (reproduced on the CUDA stand-in; CPU has no device
# lock). Now the warmup lends the lock out, and during the capture the inner call runs eagerly.
H2_NESTED_THREAD_SCRIPT = """
import os, sys, threading
import torch, graphtrees

device = sys.argv[1]
inner = graphtrees.cudagraphify(lambda y: y * 3)
shapes, errors, fallbacks = [], [], []

def work():
    try:
        # A side stream of its own: eager work on the legacy stream would break the capture.
        s = torch.cuda.Stream() if device == "cuda" else None
        with torch.no_grad(), (torch.cuda.stream(s) if s is not None else torch.no_grad()):
            shapes.append(tuple(inner(torch.ones(4, device=device)).shape))
        if s is not None:
            s.synchronize()
        fallbacks.append(graphtrees.tree_info(device)["num_fallbacks"])
    except Exception as e:  # noqa: BLE001 - reported below
        errors.append(repr(e))

def outer_fn(x):
    t = threading.Thread(target=work)
    t.start()
    t.join(30)
    if t.is_alive():
        print("hang the inner thread still waits after 30 s", flush=True)
        os._exit(3)
    return x + 1

outer = graphtrees.cudagraphify(outer_fn)
with torch.no_grad():
    for _ in range(3):  # warmup, record, replay
        y = outer(torch.ones(4, device=device))
print("shapes", shapes)
print("errors", len(errors), errors[:3])
print("fallbacks", fallbacks)
print("outer_eager", outer.signatures()[0]["eager_reason"])
print("outer_shape", tuple(y.shape))
"""


def test_graphed_function_joining_a_thread_that_makes_graphed_calls(device):
    lines = _run_threads_script(H2_NESTED_THREAD_SCRIPT, device)
    assert lines["errors"].startswith("0 "), lines["errors"]
    # The inner thread ran in the warmup and in the recording (a replay runs no user code). In
    # the warmup it warmed up (the device lock is lent); in the capture, which waits for it, its
    # call waited out the patience (a second) and ran eagerly.
    assert lines["shapes"] == "[(4,), (4,)]", lines["shapes"]
    assert lines["fallbacks"] == ("[0, 0]" if device == "cpu" else "[0, 1]"), lines["fallbacks"]
    assert lines["outer_eager"] == "None", lines["outer_eager"]  # the outer one was recorded
    assert lines["outer_shape"] == "(4,)"


# H2, the other side: a thread that merely runs beside a capture (a server's request threads) is
# not waited for by it. Its call that needs the device (a warmup) waits for the capture's user code
# to return and then warms up as it would alone: no eager fallback.
H2_BESIDE_SCRIPT = """
import sys, threading, time
import torch, graphtrees

device = sys.argv[1]
capturing = threading.Event()
calls = {"x": 0}
out = {}

def fx(x):
    calls["x"] += 1
    if calls["x"] == 2:  # the capture (the first call is the warmup)
        capturing.set()
        time.sleep(0.3)  # user code that takes a while, waiting for no thread
    return x + 1

gx, gy = graphtrees.cudagraphify(fx), graphtrees.cudagraphify(lambda y: y * 2)

def beside():
    capturing.wait(30)
    with torch.no_grad():
        y = gy(torch.ones(4, device=device))  # a warmup, asked for while the capture runs
        out["y"] = y.cpu().tolist()
    t = graphtrees.tree_info(device)
    out["counts"] = (t["num_warmups"], t["num_fallbacks"])

with torch.no_grad():
    gx(torch.ones(4, device=device))  # warmup
    b = threading.Thread(target=beside)
    b.start()
    gx(torch.ones(4, device=device))  # capture
    b.join(60)
print("counts", out.get("counts"))
print("y", out.get("y"))
print("x_recordings", graphtrees.tree_info(device)["num_recordings"])
"""


def test_a_thread_beside_a_capture_waits_for_it_and_warms_up(device):
    lines = _run_threads_script(H2_BESIDE_SCRIPT, device)
    assert lines["counts"] == "(1, 0)", lines["counts"]  # one warmup, no eager fallback
    assert lines["x_recordings"] == "1", lines["x_recordings"]
    if device == "cpu" or STANDIN is None or standin_values():
        assert lines["y"] == "[2.0, 2.0, 2.0, 2.0]", lines["y"]


# H2, with memory budgets: a warmup lent the device lock out while a budget's lowered fraction was
# applied, so another thread's warmup ran out of memory under it although each pool stayed under
# its own cap (found in review, on the CUDA stand-in). A budgeted warmup now keeps the lock and
# marks the device as a capture does: the other thread waits for it, then warms up.
BUDGET_SCRIPT = """
import sys, threading, time
import torch, graphtrees

device = sys.argv[1]
MiB = 2**20
graphtrees.set_memory_budget(device, 64 * MiB)  # each thread's pool gets the cap
in_user_code = threading.Event()
out = {}

def f1(x):
    big = torch.empty(40 * MiB, dtype=torch.uint8, device=device)  # thread 1's pool: 40 MiB
    in_user_code.set()
    time.sleep(0.3)
    return x + big[:4].float()

def f2(x):
    big = torch.empty(40 * MiB, dtype=torch.uint8, device=device)  # thread 2's: 40 MiB < 64
    return x + big[:4].float()

g1, g2 = graphtrees.cudagraphify(f1), graphtrees.cudagraphify(f2)

def t1():
    with torch.no_grad():
        g1(torch.ones(4, device=device))

def t2():
    in_user_code.wait(30)  # while thread 1's warmup runs its code
    with torch.no_grad():
        g2(torch.ones(4, device=device))
    i = graphtrees.tree_info(device)
    out["t2"] = (i["num_warmups"], i["num_out_of_memory"], i["num_fallbacks"])

a, b = threading.Thread(target=t1), threading.Thread(target=t2)
a.start()
b.start()
b.join(60)
a.join(60)
print("t2", out.get("t2"))
"""


def test_budgeted_warmups_of_two_threads_each_stay_under_their_own_cap(device):
    lines = _run_threads_script(BUDGET_SCRIPT, device)
    assert lines["t2"] == "(1, 0, 0)", lines["t2"]  # warmed up, no out of memory, no fallback


# H2, the lock-order inversion: thread Z's call holds its tree lock and waits for the device lock
# (its warmup's user code has returned) while thread X's capture holds the device lock and runs
# user code that joins a thread I which needs Z's tree lock (set_memory_budget() takes every
# tree's lock, as a backward on autograd's device thread takes its forward's). A thread now lends
# its tree lock out while it waits for the device lock.
H2_INVERSION_SCRIPT = """
import os, sys, threading, time
import torch, graphtrees

device = sys.argv[1]
z_in_user_code, x_capturing = threading.Event(), threading.Event()
calls = {"x": 0}
failures = []

def fz(x):
    z_in_user_code.set()
    if not x_capturing.wait(30):
        failures.append("Z: X's capture never began")
    return x - 1

def fx(x):
    calls["x"] += 1
    if calls["x"] == 2:  # the capture (the first call is the warmup)
        x_capturing.set()
        time.sleep(0.5)  # Z's user code returns; Z waits for the device lock
        i = threading.Thread(target=graphtrees.set_memory_budget, args=(device, None))
        i.start()
        i.join(30)
        if i.is_alive():
            print("hang thread I still waits for a tree lock after 30 s", flush=True)
            os._exit(3)
    return x + 1

gx, gz = graphtrees.cudagraphify(fx), graphtrees.cudagraphify(fz)

def run_z():
    try:
        with torch.no_grad():
            gz(torch.ones(4, device=device))
    except Exception as e:  # noqa: BLE001 - reported below
        failures.append(repr(e))

with torch.no_grad():
    gx(torch.ones(4, device=device))  # warmup
    z = threading.Thread(target=run_z)
    z.start()
    if not z_in_user_code.wait(30):
        failures.append("Z never ran its warmup")
    gx(torch.ones(4, device=device))  # capture
    z.join(60)
    if z.is_alive():
        print("hang thread Z still waits after 60 s", flush=True)
        os._exit(3)
    y = gx(torch.ones(4, device=device))  # replay
print("failures", len(failures), failures[:3])
print("x_eager", gx.signatures()[0]["eager_reason"])
"""


def test_waiting_for_the_device_lock_lends_the_tree_lock(device):
    lines = _run_threads_script(H2_INVERSION_SCRIPT, device)
    assert lines["failures"].startswith("0 "), lines["failures"]
    assert lines["x_eager"] == "None", lines["x_eager"]


# H3: a restore that finds pool blocks no live output owns collects garbage (dead cycles may hold
# pool tensors). That collection ran finalizers while another thread captured, past the collector
# pause of that capture (a finalizer freeing that capture's tensors aborts the process, Note
# [Freeing during a capture] in csrc/ThreadState.h). Now graphtrees collects no garbage while any
# thread captures.
H3_SCRIPT = """
import gc, os, sys, threading
import torch, graphtrees

device = sys.argv[1]
gc.disable()  # only graphtrees' own gc.collect() collects in this process
collections = []
gc.callbacks.append(lambda phase, info: collections.append(1) if phase == "start" else None)

def f(x):
    t = x * 3
    c = [t]
    c.append(c)  # garbage once f returns, holding a pool tensor: only a collection frees it
    return x + 1

g = graphtrees.cudagraphify(f)
h = graphtrees.cudagraphify(lambda y: y * 2)
k = graphtrees.cudagraphify(lambda y: y - 2)
b_capturing, a_done = threading.Event(), threading.Event()
calls_b = [0]
failures = []

def fb(x):
    calls_b[0] += 1
    if calls_b[0] == 2:  # B's capture (its first call was its warmup)
        b_capturing.set()
        if not a_done.wait(60):
            failures.append("B: A never finished its step")
    return x * 2

gb = graphtrees.cudagraphify(fb)

def run_b():
    try:
        with torch.no_grad():
            gb(torch.ones(4, device=device))
            gb(torch.ones(4, device=device))
    except Exception as e:  # noqa: BLE001 - reported below
        failures.append(repr(e))

x = torch.ones(4, device=device)
a_error = None
with torch.no_grad():
    for step in range(2):  # g and h warmed up, then recorded
        graphtrees.mark_step_begin()
        h(g(x))
    b = threading.Thread(target=run_b)
    b.start()
    if not b_capturing.wait(60):
        failures.append("B's capture never began")
    graphtrees.mark_step_begin()
    before = len(collections)
    try:
        k(g(x))  # g replays; k's warmup needs the pool restored to g's checkpoint
    except RuntimeError as e:
        a_error = str(e).splitlines()[0]
    during = len(collections) - before
    a_done.set()
    b.join(60)
    if b.is_alive():
        print("hang B did not finish", flush=True)
        os._exit(3)
print("failures", len(failures), failures[:3])
print("collections_during_capture", during)
print("a_error", a_error)
"""


def test_no_garbage_collection_of_graphtrees_while_another_thread_captures(device):
    lines = _run_threads_script(H3_SCRIPT, device)
    assert lines["failures"].startswith("0 "), lines["failures"]
    assert lines["collections_during_capture"] == "0", lines


# H6: wrapped.capture() froze the collector (gc.freeze()) and thawed it after (gc.unfreeze()),
# which thaws every frozen object, those the application froze too (a server freezes its
# start-up objects before it forks, to keep their pages shared). Now it freezes only when nothing
# was frozen before. In a fresh process: this suite freezes its own start-up objects (conftest).
H6_SCRIPT = """
import gc, sys
import torch, graphtrees

device = sys.argv[1]

def capture():
    f = graphtrees.cudagraphify(lambda x: x * 2, buckets=[2, 4])
    reports = f.capture(torch.ones(3, 4, device=device), progress=False)
    assert [r["status"] for r in reports] == ["recorded", "recorded"], reports

capture()  # nothing frozen: capture() freezes while it records, and thaws what it froze
print("unfrozen", gc.get_freeze_count())
gc.freeze()  # the application's start-up objects
frozen = gc.get_freeze_count()
capture()
# Still frozen after capture(): an unfreeze moves every frozen object back (the count drops to
# 0). A frozen object that dies meanwhile leaves the count too, so it need not stay exact.
print("frozen", frozen, gc.get_freeze_count())
"""


def test_capture_leaves_the_applications_frozen_objects_frozen(device):
    lines = _run_threads_script(H6_SCRIPT, device)
    assert lines["unfrozen"] == "0", lines
    before, after = (int(n) for n in lines["frozen"].split())
    assert before > 0 and after > before // 2, lines


# H7: the collector pause of captures re-enabled the collector when the last capture ended, even
# if the user had disabled it meanwhile. The pause no longer touches the user's switch
# (gc.isenabled()): it sets the first threshold to 0, and puts it back only if it is still 0.
def test_collector_pause_keeps_the_users_newer_choice(device):
    import gc

    import torch

    import graphtrees

    calls = [0]
    thresholds = gc.get_threshold()

    def f(x):
        calls[0] += 1
        if calls[0] == 2:  # during the capture (the first call is the warmup)
            gc.disable()
        return x + 1

    def f2(x):
        calls[0] += 1
        if calls[0] == 4:  # during its capture (its warmup was the third run)
            gc.set_threshold(1234, *thresholds[1:])
        return x - 1

    assert gc.isenabled()
    try:
        with torch.no_grad():
            g = graphtrees.cudagraphify(f)
            for _ in range(3):
                g(torch.ones(4, device=device))
            assert calls[0] == 2  # warmup and capture ran the function, the replay did not
            assert not gc.isenabled()  # the user's gc.disable() during the capture stays
            gc.enable()
            g2 = graphtrees.cudagraphify(f2)
            for _ in range(3):
                g2(torch.ones(4, device=device))
            assert calls[0] == 4
            assert gc.get_threshold()[0] == 1234  # so does a threshold set during a capture
            assert gc.isenabled()
    finally:
        gc.enable()
        gc.set_threshold(*thresholds)


# A user function that raises an error that no capture refusal raises (not a RuntimeError) during
# its recording, its warmup having run without one, was run a second time eagerly in the same call
# (its side effects twice, its exception swallowed) and marked eager for good. Now the error
# propagates at once, and the next call records the function again.
def test_users_own_error_during_a_recording_propagates_without_a_second_run(device):
    import torch

    import graphtrees

    runs = []
    fail = [False]

    def f(x):
        runs.append(1)  # a side effect
        if fail[0]:
            fail[0] = False
            raise ValueError("the user's own error")
        return x * 5

    g = graphtrees.cudagraphify(f)
    x = torch.ones(4, device=device)
    with torch.no_grad():
        g(x)  # warmup
        assert len(runs) == 1
        fail[0] = True
        with pytest.raises(ValueError, match="the user's own error"):
            g(x)  # the recording raises
        assert len(runs) == 2  # run once: no eager rerun in the same call
        assert g.signatures()[0]["eager_reason"] is None
        g(x)  # recorded now
        assert len(runs) == 3
        y = g(x)  # a replay
        assert len(runs) == 3
    assert g.signatures()[0]["eager_reason"] is None
    assert graphtrees.tree_info(device)["num_recordings"] == 1
    assert tuple(y.shape) == (4,)


# H12: graphtrees' log lines reached the user's logging handlers while the thread held its tree's
# lock (and, on CUDA, the device's): a handler that waits for another thread needing that lock
# (one that sets a memory budget, which takes every tree's lock) deadlocked. Log lines are now
# held back while the thread holds one of graphtrees' locks and emitted once it holds none.
H12_SCRIPT = """
import logging, os, sys, threading
import torch, graphtrees

device = sys.argv[1]
under_lock = []

class Handler(logging.Handler):
    def emit(self, record):
        t = threading.Thread(target=graphtrees.set_memory_budget, args=(device, None), daemon=True)
        t.start()
        t.join(5)
        if t.is_alive():  # it waits for a lock this thread holds while it logs
            under_lock.append(record.getMessage()[:60])

logger = logging.getLogger("graphtrees")
logger.setLevel(logging.INFO)
logger.addHandler(Handler())
g = graphtrees.cudagraphify(lambda x: x * 2)
with torch.no_grad():
    for _ in range(3):
        g(torch.ones(4, device=device))
print("under_lock", len(under_lock), under_lock[:3])
print("recordings", graphtrees.tree_info(device)["num_recordings"])
"""


def test_log_handlers_run_outside_graphtrees_locks(device):
    lines = _run_threads_script(H12_SCRIPT, device)
    assert lines["recordings"] == "1", lines
    assert lines["under_lock"].startswith("0 "), lines["under_lock"]
