"""The one capture observer (Note [One capture observer] in csrc/CaptureObserver.h): a user's
RecordFunction switch is kept, and work forked onto another thread is refused. Each test failed
before its fix."""

import warnings

import pytest
import torch

import graphtrees

from helpers import assert_close, info

pytestmark = pytest.mark.usefixtures("no_grad")


def _record_function(on):
    torch._C._autograd._enable_record_function(on)


def test_record_function_switched_off_by_the_user_stays_off_and_the_call_runs_eagerly(tree_logs):
    # Before: each watcher switched RecordFunction on for itself; a profiler inside the function
    # saw its ops while the user had switched it off, and the function was recorded.
    seen = []

    def f(x):
        with torch.autograd.profiler.profile() as p:
            y = x * 2
        seen.append(sum(e.name == "aten::mul" for e in p.function_events))
        return y + 1

    g = graphtrees.cudagraphify(f, name="switched_off")
    _record_function(False)
    try:
        for _ in range(4):
            x = torch.randn(4)
            assert_close(g(x), x * 2 + 1)
    finally:
        _record_function(True)
    assert seen == [0, 0, 0, 0]
    t = info("cpu")
    assert (t["num_warmups"], t["num_recordings"], t["num_fallbacks"]) == (0, 0, 4)
    assert "RecordFunction is switched off on this thread" in tree_logs.text
    assert [s["eager_reason"] for s in g.signatures()] == [None]  # not for good
    for _ in range(4):  # on again: warmed up, recorded, replayed
        x = torch.randn(4)
        assert_close(g(x), x * 2 + 1)
    t = info("cpu")
    assert (t["num_warmups"], t["num_recordings"], t["num_replays"]) == (1, 1, 2)


def test_a_function_that_switches_record_function_off_runs_eagerly_with_the_reason():
    def f(x):
        _record_function(False)
        return x + 1

    g = graphtrees.cudagraphify(f, name="switches_off")
    try:
        x = torch.randn(4)
        assert_close(g(x), x + 1)  # warmup: RecordFunction is off after it
        assert "RecordFunction is switched off" in g.signatures()[0]["eager_reason"]
    finally:
        _record_function(True)


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.jit.script is deprecated

    @torch.jit.script
    def _double_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(x * 2 + 1)
        return out

    @torch.jit.script
    def _forking(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        fut = torch.jit.fork(_double_into, x, out)
        y = x.sin()
        return torch.jit.wait(fut) + y


def test_a_function_that_forks_torchscript_work_runs_eagerly_and_matches_eager():
    # Issue 39: the forked task runs on an interop thread, where no watcher sees its ops. Before,
    # the recorded program replayed without it, and `state` kept the recording's values: every
    # replay returned stale values.
    state = torch.zeros(8)

    def f(x):
        return _forking(x, state) * 3

    g = graphtrees.cudagraphify(f, name="forking")
    for _ in range(6):
        x = torch.randn(8)
        got = g(x).clone()
        assert_close(got, f(x))
    (sig,) = g.signatures()
    assert "torch.jit.fork" in sig["eager_reason"]
    assert info("cpu")["num_recordings"] == 0


def test_the_shared_fork_slot_forgets_a_fork_once_its_observers_are_gone():
    # Observers past CaptureObserver::kForkSlots (32) share one more slot; a fork seen there
    # refuses the captures of all that share it. Before, its flag was never cleared: once every
    # slot had been taken and something forked, every later capture on the shared slot was
    # refused as forking.
    import threading

    slots = 32  # CaptureObserver::kForkSlots
    inside = threading.Barrier(slots + 1)
    release = threading.Event()
    errors = []

    def hold(x):
        inside.wait(30)
        assert release.wait(60)
        return x + 1

    def holder():
        try:
            graphtrees.cudagraphify(hold)(torch.ones(2))  # its warmup holds a slot meanwhile
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=holder) for _ in range(slots)]
    for t in threads:
        t.start()
    try:
        inside.wait(30)  # every slot is taken: this thread's observers share the last one
        state = torch.zeros(8)
        forking = graphtrees.cudagraphify(lambda x: _forking(x, state) * 3, name="forking")
        for _ in range(3):
            forking(torch.randn(8))
        assert "torch.jit.fork" in forking.signatures()[0]["eager_reason"]
        plain = graphtrees.cudagraphify(lambda x: x * 2, name="plain")
        x = torch.randn(4)
        for _ in range(3):
            assert_close(plain(x), x * 2)
        assert plain.signatures()[0]["eager_reason"] is None
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert errors == []
