"""Failure paths of the tree and its backends: rejected captures, checkpoints and restores that
throw, errors met while tearing down, autocast. Runs on every device; on the CPU backend the
device's failures are injected (graphtrees._C._inject_failure), on CUDA the rejected captures are
real."""

import gc
import subprocess
import sys

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import ROOT, assert_close, assert_invariants, info

pytestmark = pytest.mark.usefixtures("no_grad")


def inject(point, n=1):
    graphtrees._ext.get_ext()._inject_failure(point, n)


def eager_reasons(g):
    return [s["eager_reason"] for s in g.signatures()]


def branchy(x):
    return x * 2 if x.sum() > 0 else x * 3


def masked(x):
    return x[x > 0].sum() + x


def item(x):
    return x * x.max().item()


def tolist(x):
    return x + len([v for v in x.tolist() if v > 0])


def printing(x):
    str(x)
    return x + 1


def where_one_arg(x):
    return torch.where(x > 0)[0].float().sum() + x


def equal(x):
    # torch.equal(x, x) answers from the storages on CUDA, without reading a value (found on the
    # CUDA stand-in): compare with another tensor, so that it reads the device.
    return x + 1 if torch.equal(x, x * 1) else x


HOST_SYNCS = [branchy, masked, item, tolist, printing, where_one_arg, equal]
# What they do with the value read is a kernel's result: a shape, or what printing shows.
_DEVICE_VALUES = {
    "masked": "the mask's nonzero shape is read from the device",
    "where_one_arg": "the nonzero shape is read from the device",
    "printing": "printing formats the values (and masks them by finiteness) on the device",
}


def _host_sync_params():
    return [
        pytest.param(f, id=f.__name__, marks=pytest.mark.needs_values(_DEVICE_VALUES[f.__name__]))
        if f.__name__ in _DEVICE_VALUES
        else pytest.param(f, id=f.__name__)
        for f in HOST_SYNCS
    ]


@pytest.mark.parametrize("fn", _host_sync_params())
def test_host_sync_during_capture_runs_eagerly_and_leaves_the_tree_working(device, fn, tree_logs):
    # A CUDA capture rejects host synchronisation; the CPU backend rejects it the same way, so
    # that a test passing on CPU predicts CUDA.
    h = cudagraphify(lambda x: x.sin() + 1)
    y = torch.randn(32, device=device)
    for _ in range(3):
        assert_close(h(y), y.sin() + 1)
    nodes_before = info(device)["num_nodes"]
    g = cudagraphify(fn)
    for sign in (1.0, -1.0, 1.0, -1.0, 1.0):
        x = torch.randn(16, device=device).abs() * sign
        assert_close(g(x), fn(x))
    (reason,) = eager_reasons(g)
    assert reason is not None and "cannot be recorded as a graph" in reason
    assert tree_logs.text.count("cannot be recorded as a graph") == 1  # logged once
    assert info(device)["num_nodes"] == nodes_before  # nothing of g entered the tree
    # The tree, the pool and the other function keep working, and later captures too.
    replays = info(device)["num_replays"]
    for _ in range(3):
        mark_step_begin()
        assert_close(h(y), y.sin() + 1)
    k = cudagraphify(lambda x: x * 5)
    for _ in range(3):
        assert_close(k(y), y * 5)
    assert info(device)["num_replays"] >= replays + 4
    assert_invariants(device)


def test_host_sync_reason_names_the_operation(device):
    g = cudagraphify(item)
    x = torch.randn(8, device=device)
    for _ in range(2):
        g(x)
    (reason,) = eager_reasons(g)
    assert "item" in reason or "_local_scalar_dense" in reason or "cannot be recorded" in reason
    if device == "cpu":
        assert "aten::item" in reason and "host" in reason


def test_host_sync_in_warmup_only_is_fine(device):
    # Warmups are not captured: a sync there is allowed.
    calls = []

    def f(x):
        if not calls:
            x.sum().item()
        calls.append(1)
        return x * 2

    g = cudagraphify(f)
    x = torch.randn(8, device=device)
    for _ in range(4):
        assert_close(g(x), x * 2)
    assert eager_reasons(g) == [None]
    assert info(device)["num_replays"] == 2


def test_failure_at_capture_end_runs_eagerly(device, tree_logs):
    g = cudagraphify(lambda x: x.cos() * 3)
    x = torch.randn(64, device=device)
    g(x)  # warmup
    inject("capture_end")
    for _ in range(3):
        assert_close(g(x), x.cos() * 3)
    assert "cannot be recorded" in eager_reasons(g)[0]
    assert info(device)["num_nodes"] == 0
    k = cudagraphify(lambda x: x - 7)
    for _ in range(3):
        assert_close(k(x), x - 7)
    assert info(device)["num_nodes"] == 1 and info(device)["num_replays"] == 1
    assert_invariants(device)


def test_checkpoint_that_throws_leaves_the_tree_as_it_was(device, tree_logs):
    g1 = cudagraphify(lambda x: x * 2)
    g2 = cudagraphify(lambda a: a + 1)
    x = torch.randn(64, device=device)
    a = g1(x)  # warmups
    g2(a)
    mark_step_begin()
    a = g1(x)  # records g1
    assert info(device)["num_nodes"] == 1
    inject("checkpoint")
    assert_close(g2(a), x * 2 + 1)  # its recording's checkpoint fails
    assert info(device)["num_nodes"] == 1
    assert "could not be checkpointed" in eager_reasons(g2)[0]
    for _ in range(4):
        mark_step_begin()
        a = g1(x)
        assert_close(g2(a), x * 2 + 1)
        assert_close(a, x * 2)
    # A branch that needs g1's checkpoint restores it (a node without one would crash here).
    h = cudagraphify(lambda a: a.exp())
    for _ in range(3):
        mark_step_begin()
        a = g1(x)
        assert_close(h(a), (x * 2).exp())
    assert info(device)["num_checkpoints"] >= 1
    assert_invariants(device)


def test_a_failed_checkpoint_keeps_the_recordings_write_back(device):
    # The recording call's results come back as eager results when the checkpoint after it fails;
    # its mutation of a copied input reached the placeholder only, and was never written back
    # (found by a review of issue 47: the caller's tensor kept its old values, silently).
    def f(a):
        a.add_(1)
        return a * 2

    g = cudagraphify(f)
    xg, xe = torch.zeros(4, device=device), torch.zeros(4, device=device)
    g(xg)  # the warmup
    f(xe)
    mark_step_begin()
    inject("checkpoint")
    assert_close(g(xg), f(xe))  # the recording, whose checkpoint fails
    assert "could not be checkpointed" in eager_reasons(g)[0]
    assert_close(xg, xe)
    assert_invariants(device)


def _tree_needing_a_restore(device):
    g1 = cudagraphify(lambda x: x * 2)
    g2 = cudagraphify(lambda a: a + 1)
    x = torch.rand(4096, device=device)
    for _ in range(3):
        mark_step_begin()
        a = g1(x)
        b = g2(a)
    return x, a, b


def test_restore_that_fails_before_changing_the_pool_leaks_nothing(device, tree_logs):
    x, a, b = _tree_needing_a_restore(device)
    inject("backend_restore")
    h = cudagraphify(lambda a: a.exp())
    assert_close(h(a), (x * 2).exp())  # retired, then run on a fresh tree
    assert_close(a, x * 2)
    assert_close(b, x * 2 + 1)
    t = info(device)
    assert t["retired_trees"] == 1 and t["leaked_bytes"] == 0
    assert "the pool was left unchanged" in tree_logs.text
    del a, b
    gc.collect()
    # clean_trees checks after reset() that no pool block stayed allocated.


def test_restore_that_fails_half_way_reports_the_leak(tree_logs):
    # A half-done restore can only be injected on the CPU backend (c10's can fail half-way on
    # its own; the CUDA backend then reports the same way).
    device = "cpu"
    x, a, b = _tree_needing_a_restore(device)
    inject("partial_restore")
    h = cudagraphify(lambda a: a.exp())
    assert_close(h(a), (x * 2).exp())
    assert_close(a, x * 2)  # disowned but intact: a retired pool never allocates
    t = info(device)
    assert t["retired_trees"] == 1 and t["leaked_bytes"] >= a.numel() * 4
    assert "left inconsistent" in tree_logs.text
    for _ in range(3):
        mark_step_begin()
        a2 = cudagraphify(lambda x: x * 2)(x)
        assert_close(a2, x * 2)
    graphtrees.reset()
    assert info(device)["leaked_bytes"] == 0


def test_error_at_the_end_of_routing_is_raised_by_the_call(device):
    g = cudagraphify(lambda x: x + 3)
    x = torch.randn(16, device=device)
    inject("end_allocate")
    with pytest.raises(RuntimeError, match="injected failure after ending the routing"):
        g(x)
    # The routing did end: nothing allocated now lands in the pool, and the tree goes on.
    before = info(device)["pool"]["allocated_blocks"]
    keep = torch.empty(1 << 16, device=device)
    assert info(device)["pool"]["allocated_blocks"] == before
    del keep
    for _ in range(3):
        assert_close(g(x), x + 3)
    assert info(device)["num_replays"] >= 1
    assert_invariants(device)


def test_error_while_unwinding_keeps_the_users_error(device, tree_logs):
    # The destructor path: the user's function raised during a warmup and ending the routing
    # fails too. The user's error propagates; the second becomes a warning.
    def f(x):
        raise ValueError("boom from the user")

    g = cudagraphify(f)
    inject("end_allocate")
    with pytest.raises(ValueError, match="boom from the user"):
        g(torch.ones(4, device=device))
    assert "ending the pool routing after an error failed too" in tree_logs.text
    k = cudagraphify(lambda x: x * 4)
    for _ in range(3):
        assert_close(k(torch.ones(4, device=device)), torch.full((4,), 4.0, device=device))
    assert_invariants(device)


def test_error_while_releasing_the_pool_is_raised_by_reset(device):
    g = cudagraphify(lambda x: x * 2)
    x = torch.randn(8, device=device)
    for _ in range(3):
        out = g(x)
    inject("release_pool")
    with pytest.raises(RuntimeError, match="injected failure after releasing"):
        graphtrees.reset()
    # Everything was freed all the same; the next tree works.
    assert info(device)["num_nodes"] == 0 and info(device)["backend"] is None
    with pytest.raises(RuntimeError, match="overwritten"):
        out + 1
    for _ in range(3):
        assert_close(g(x), x * 2)


def test_error_while_releasing_at_exit_does_not_abort():
    code = (
        "import torch, graphtrees\n"
        "g = graphtrees.cudagraphify(lambda x: x + 1)\n"
        "with torch.no_grad():\n"
        "    for _ in range(3): g(torch.ones(4))\n"
        "graphtrees._ext.get_ext()._inject_failure('release_pool', 1)\n"
        "print('done')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout and "injected failure after releasing" in r.stderr


def test_garbage_collector_is_paused_during_captures(device):
    states = []

    def f(x):
        states.append(gc.get_threshold()[0] == 0)  # automatic collections paused
        return x + 1

    g = cudagraphify(f)
    x = torch.randn(4, device=device)
    threshold = gc.get_threshold()[0]
    for _ in range(3):
        g(x)
    assert gc.isenabled()  # the pause leaves the user's switch alone
    assert gc.get_threshold()[0] == threshold > 0
    assert states[:2] == [False, True]  # warmup, capture
    assert "tolist" not in torch.Tensor.__dict__  # the host-read watch is gone after a capture


def test_overlapping_captures_of_two_threads_keep_the_collector_paused():
    # Two threads capture at once (CPU trees: per thread, not serialised; CUDA captures of one
    # device take turns, so they cannot overlap there). Thread A's capture begins, B's begins,
    # A's ends while B still captures: the collector must stay paused until B's ends, and be
    # running again after both. Each scope used to restore what it saw at its own start: A's end
    # re-enabled the collector under B's capture (and in another order left it paused for good).
    import threading

    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    calls = {"a": 0, "b": 0}
    b_states, errors = [], []

    def fa(x):
        calls["a"] += 1
        if calls["a"] == 2:  # the capture (the first call is the warmup)
            a_in.set()
            assert b_in.wait(20), "B's capture never began"
        return x + 1

    def fb(x):
        calls["b"] += 1
        if calls["b"] == 2:
            b_in.set()
            assert a_done.wait(20), "A's capture never ended"
            b_states.append(gc.get_threshold()[0] == 0)  # paused
        return x * 2

    ga, gb = cudagraphify(fa), cudagraphify(fb)
    x = torch.ones(4)

    def run(g, want, before=None, after=None):
        try:
            with torch.no_grad():
                g(x)  # warmup
                if before is not None:
                    assert before.wait(20)
                g(x)  # capture
                if after is not None:
                    after.set()
                assert_close(g(x), want)  # a replay
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    assert gc.isenabled()
    ta = threading.Thread(target=run, args=(ga, x + 1, None, a_done))
    tb = threading.Thread(target=run, args=(gb, x * 2, a_in, None))
    ta.start()
    tb.start()
    ta.join(60)
    tb.join(60)
    assert errors == []
    assert [s["eager_reason"] for s in ga.signatures() + gb.signatures()] == [None, None]
    assert b_states == [True]  # still paused for B after A's capture ended
    assert gc.isenabled() and gc.get_threshold()[0] > 0  # and running again after both
    assert "tolist" not in torch.Tensor.__dict__


def _autocast_device(device):
    return torch.device(device).type


def test_autocast_replays_follow_eager_across_steps(device):
    # Note [Autocast and recordings]: the cast cache must not be baked into a recording.
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).to(device)  # parameters require grad: autocast caches them
    g = cudagraphify(lin)
    other = cudagraphify(lambda x: (x * 2 + 1).relu())
    x = torch.randn(8, 64, device=device)
    dt = torch.bfloat16
    for _step in range(6):
        mark_step_begin()
        with torch.autocast(_autocast_device(device), dt):
            y = g(x)
            ref = lin(x)
        assert y.dtype == dt
        assert_close(y, ref)
        z = other(torch.randn(256, 256, device=device))  # reuses the pool outside autocast
        assert z.dtype == torch.float32
        lin.weight.add_(0.01)  # replays must see parameter updates
    assert info(device)["num_replays"] >= 6
    assert_invariants(device)


def test_autocast_state_is_part_of_the_signature(device):
    lin = torch.nn.Linear(32, 32).to(device)
    g = cudagraphify(lin)
    x = torch.randn(4, 32, device=device)
    for _ in range(3):
        with torch.autocast(_autocast_device(device), torch.bfloat16):
            assert g(x).dtype == torch.bfloat16
    for _ in range(3):
        y = g(x)
        assert y.dtype == torch.float32
        assert_close(y, lin(x))
    assert len(g.signatures()) == 2


def test_conv_net_with_onednn_replays(device):
    # oneDNN allocates scratch memory through raw_allocate/raw_deallocate: replayed allocations
    # must look like ordinary ones.
    m = (
        torch.nn.Sequential(
            torch.nn.Conv2d(4, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 4, 3, padding=1),
        )
        .to(device)
        .eval()
    )
    f = cudagraphify(m)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(2, 4, 32, 32, device=device)
            assert_close(f(x), m(x))
    assert info(device)["num_replays"] == 2


def test_a_rejected_recording_runs_the_function_once_in_its_call():
    # The CPU emulation runs the function for real while it records: when the recording is
    # rejected, its results are returned instead of running the function a second time (side
    # effects such as a collective must happen once per call). CPU only: a CUDA capture stops at
    # the host read.
    runs = []

    def f(x):
        runs.append(1)
        y = x * 2
        if y.sum() > 1e9:  # bool() of a tensor: a host read
            y = y * 0
        return y + 1, y

    g = cudagraphify(f)
    for i in range(5):
        x = torch.full((4,), float(i))
        a, b = g(x)
        assert_close(a, x * 2 + 1)
        assert_close(b, x * 2)
        assert len(runs) == i + 1
    assert info("cpu")["num_nodes"] == 0
    assert_invariants("cpu")


def test_a_rejected_recording_whose_result_is_its_input_runs_again():
    # A result that is the recording's copy of an input must be the caller's own tensor, as in
    # eager mode: that call runs the function again, eagerly.
    def f(x):
        if x.sum() > 1e9:
            return x * 0
        return x

    g = cudagraphify(f)
    for _ in range(3):
        x = torch.ones(4)
        assert g(x).data_ptr() == x.data_ptr()
    assert_invariants("cpu")


# --- Errors during a capture, and the inputs every fallback runs on (third CUDA review, #3 #10) ---


def _refused_while_capturing(x):
    # torch 2.11 refuses .tolist(), .cpu() and pageable host copies during a CUDA capture with a
    # check made before any CUDA call: the capture stays valid and the error reaches graphtrees.
    # graphtrees answers torch.cuda.is_current_stream_capturing() with True while it records, on
    # every backend, so this is the same path on CPU.
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "Cannot copy between CPU and CUDA tensors during CUDA graph capture "
            "unless the CPU tensor is pinned."
        )
    return x * 4


def test_error_raised_during_the_capture_runs_eagerly(device, tree_logs):
    g = cudagraphify(_refused_while_capturing)
    x = torch.randn(32, device=device)
    for _ in range(4):
        assert_close(g(x), x * 4)
    (reason,) = eager_reasons(g)
    assert "raised while it was being recorded" in reason and "pinned" in reason
    assert tree_logs.text.count("raised while it was being recorded") == 1
    assert info(device)["num_nodes"] == 0
    k = cudagraphify(lambda x: x + 3)  # the tree keeps recording
    for _ in range(3):
        assert_close(k(x), x + 3)
    assert info(device)["num_replays"] >= 1
    assert_invariants(device)


def test_error_of_the_users_own_propagates_and_is_not_an_eager_reason(device):
    calls = []

    def raises_once(x):
        calls.append(1)
        if len(calls) == 2:  # the recording call
            raise ValueError("the user's own error")
        return x - 1

    g = cudagraphify(raises_once)
    x = torch.randn(8, device=device)
    g(x)  # warmup
    with pytest.raises(ValueError, match="the user's own error"):
        g(x)  # the capture raises: not a RuntimeError, so it is the user's at once
    assert len(calls) == 2  # no eager rerun in the same call (design review 6)
    assert eager_reasons(g) == [None]
    for _ in range(3):  # recorded at the next call
        assert_close(g(x), x - 1)
    assert info(device)["num_nodes"] == 1


def test_keyboard_interrupt_during_the_capture_propagates(device):
    calls = []

    def interrupted(x):
        calls.append(1)
        if torch.cuda.is_current_stream_capturing():
            raise KeyboardInterrupt
        return x + 1

    g = cudagraphify(interrupted)
    x = torch.randn(8, device=device)
    g(x)
    with pytest.raises(KeyboardInterrupt):
        g(x)
    assert len(calls) == 2  # not run again eagerly
    assert eager_reasons(g) == [None]


def _stale_input_setup(device):
    # A 10 MiB output recorded over three steps, and a function warmed up on it.
    big = cudagraphify(
        torch.nn.Sequential(torch.nn.Linear(64, 64)).to(device).requires_grad_(False).__call__
    )
    x = torch.randn(40960, 64, device=device)
    for _ in range(3):
        mark_step_begin()
        y = big(x)
    return big, x, y


FALLBACKS = {
    "checkpoint": lambda y: torch.cat([y, y]) * 3,
    "rejected": lambda y: torch.cat([y, y]) * 3 + len(y[:1, :1].tolist()) * 0,
    "raises": lambda y: (
        torch.cat([y, y]) * 3
        if not torch.cuda.is_current_stream_capturing()
        else (_ for _ in ()).throw(RuntimeError("refused during capture"))
    ),
}


# (A mutation of a copied input is written back now, not a fallback: Note [Copied inputs
# written back]; the fallback for one that cannot be is the same runEager path as these.)
@pytest.mark.parametrize("exit_", ["checkpoint", "rejected", "raises"])
def test_fallbacks_of_a_recording_run_on_the_clone_of_a_stale_input(device, exit_):
    # The restore before the recording invalidates `y` (last step's replayed output) and clones
    # it; every eager fallback of the recording must run on that clone, not on `y`.
    big, x, y0 = _stale_input_setup(device)
    expected_base = y0.clone()
    fn = FALLBACKS[exit_]
    other = cudagraphify(fn)
    other(y0)  # warmup on big's output
    mark_step_begin()
    y = big(x)
    mark_step_begin()
    if exit_ == "checkpoint":
        inject("checkpoint")
    out = other(y)  # records: the restore clones y first; the recording's fallback runs eagerly
    assert_close(out, torch.cat([expected_base, expected_base]) * 3)
    assert eager_reasons(other)[0] is not None
    # `y` itself was invalidated by the restore: only its clone could give the result above.
    with pytest.raises(RuntimeError, match="overwritten"):
        y + 1
    assert_invariants(device)


class _OwnAutocast(torch.nn.Module):
    """A model that opens its own autocast region inside forward (timm and diffusers do)."""

    def __init__(self, device):
        super().__init__()
        self.device_type = torch.device(device).type
        self.lin = torch.nn.Linear(32, 32).to(device)

    def forward(self, x):
        # A region made here inherits the cache switch graphtrees turned off, unless it asks for
        # the cache (as a region built once in __init__ and re-entered does).
        with torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=True):
            return self.lin(x).float()


def test_autocast_region_inside_the_function_under_an_outer_region(device):
    # The inner region turns autocast's cast cache back on and, nested, does not clear it on
    # exit: the casts a warmup cached would sit in the pool, held by autocast's C++ cache (third
    # CUDA review, #12). The cache is cleared around every warmup and capture.
    model = _OwnAutocast(device)
    g = cudagraphify(model)
    h = cudagraphify(lambda y: y * 2)
    x = torch.randn(8, 32, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        for step in range(6):
            mark_step_begin()
            y = g(x)
            z = h(y) if step % 2 else y + 0
            expected = model(x)
            assert_close(y, expected)
            assert_close(z, expected * 2 if step % 2 else expected)
            assert_invariants(device)
    mark_step_begin()
    assert_close(g(x), model(x))  # outside the outer region: a new signature
    assert eager_reasons(g) == [None, None]
    assert_invariants(device)


def _draw(x, gen):
    return x + torch.rand(x.shape, device=x.device, generator=gen)


def test_generator_arguments_key_the_signature_by_identity(device):
    # A torch.Generator argument is part of the signature (a recording registers that very
    # generator with its graph).
    g = cudagraphify(_draw)
    x = torch.zeros(256, device=device)
    a, b = torch.Generator(device), torch.Generator(device)
    for _ in range(4):
        g(x, a)
    assert info(device)["num_replays"] == 2
    g(x, b)  # another generator: another signature
    assert len(g.signatures()) == 2
    assert all(s["eager_reason"] is None for s in g.signatures())
    graphtrees.reset()  # the graphs that registered a, b are destroyed (review 4, #1)
    gc.collect()
    torch.rand(4, device=device, generator=a)  # the generators are usable afterwards


@pytest.mark.needs_values("the random numbers are a kernel's output")
def test_replays_draw_fresh_numbers_from_a_generator_argument(device):
    # Each replay draws fresh numbers from the generator passed, as eager calls do.
    g = cudagraphify(_draw)
    x = torch.zeros(256, device=device)
    a, b = torch.Generator(device), torch.Generator(device)
    a.manual_seed(1)
    graphed = [g(x, a).clone() for _ in range(4)]
    a.manual_seed(1)
    eager = [_draw(x, a) for _ in range(4)]
    for got, want in zip(graphed, eager):
        assert_close(got, want)
    assert not torch.equal(graphed[2], graphed[3])
    b.manual_seed(1)
    assert_close(g(x, b), eager[0])
