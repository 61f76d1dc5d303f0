"""Note [User code outside the tree lock] (csrc/TreeLock.h): a graphed call never holds its tree's
lock while the user's code runs, so another thread that the code waits for and that needs the
same tree -- a backward that autograd runs away from its forward's thread, an eviction, a memory
budget -- finishes instead of deadlocking. Each test runs that other thread with a join timeout:
a deadlock fails the test instead of hanging it (the other thread finishes once the call ends)."""

import copy
import threading

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import assert_close, info

# Far above what the other thread needs (well under a second); a deadlock waits it out.
JOIN_TIMEOUT_S = 20


def _on_another_thread(target):
    """Runs target() on a new thread, joined with a timeout: (finished, what it returned)."""
    out = []

    def run():
        out.append(target())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT_S)
    return not t.is_alive(), out[0] if out else None


def _trained(device):
    """A compiled model past its warmup and recording, the model and an input. Its backward
    reads an activation its forward returned (tanh's output), a pool output of this thread's
    tree: the backward belongs with that tree, whichever thread runs it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    model = model.to(device)
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(2, 4, device=device)
    for _ in range(3):  # warmup, record, replay
        compiled(x).sum().backward()
    model.zero_grad()
    return model, compiled, x


def _expected_grad(model, x):
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(x).sum().backward()
    return reference[0].weight.grad


def test_backward_on_another_thread_during_an_eager_fallback_does_not_deadlock(device):
    # The case: GraphedCallable::fallback kept the tree's handle while the function ran.
    model, compiled, x = _trained(device)
    expected = _expected_grad(model, x)
    loss = compiled(x).sum()  # its backward belongs with this thread's tree
    finished = []

    def body(t):
        done, _ = _on_another_thread(loss.backward)
        finished.append(done)
        return t * 2

    g = cudagraphify(body)
    y = torch.randn(3, device=device, requires_grad=True)  # grad mode on: runs eagerly
    assert_close(g(y), y * 2)
    assert finished == [True], "the backward on the other thread deadlocked"
    assert_close(model[0].weight.grad, expected)
    assert not info(device)["pending_backward"]


@pytest.mark.parametrize("runs", [1, 2], ids=["warmup", "recording"])
def test_backward_on_another_thread_during_a_warmup_or_recording_does_not_deadlock(device, runs):
    # The call holds its tree while it warms up or records, but lends the lock out while the
    # function runs: the other thread's backward, which needs that tree, runs eagerly.
    model, compiled, x = _trained(device)
    finished = []
    losses = []

    def body(t):
        done, _ = _on_another_thread(losses.pop().backward)
        finished.append(done)
        return t * 2

    g = cudagraphify(body)
    with torch.no_grad():
        t = torch.randn(3, device=device)
    for _ in range(runs):
        expected = _expected_grad(model, x)
        losses.append(compiled(x).sum())
        before = info(device)["num_fallbacks"]
        with torch.no_grad():
            assert_close(g(t), t * 2)
        assert finished[-1], "the backward on the other thread deadlocked"
        assert_close(model[0].weight.grad, expected)
        # It ran eagerly (a fallback of the tree it belongs to) and closed its forward's
        # pending backward there.
        assert info(device)["num_fallbacks"] == before + 1
        assert not info(device)["pending_backward"]
        model.zero_grad()
    assert len(finished) == runs


def test_eviction_by_another_thread_during_a_warmup_waits_for_the_call():
    # A new signature evicts the least recently used one's recordings from every tree of the
    # device: the tree whose call is in flight evicts them when that call ends. CPU only: on
    # CUDA the other thread's warmup waits for the device's allocation lock, which this thread's
    # warmup holds (docs/limitations.md, "Nested graphed calls"; seen on the CUDA stand-in).
    device = "cpu"
    h = cudagraphify(lambda x: x + 1, max_recorded_shapes=1)
    with torch.no_grad():
        for _ in range(3):
            h(torch.randn(4, device=device))
    assert info(device)["num_nodes"] == 1
    mark_step_begin()  # the path leaves h's recording: it may be evicted
    seen = {}

    def evict_on_another_thread():
        with torch.no_grad():
            h(torch.randn(5, device=device))  # a second signature: the first is evicted
        return info(device)["num_evictions"]

    def body(t):
        done, evictions = _on_another_thread(evict_on_another_thread)
        seen.update(done=done, nodes=info(device)["num_nodes"], other=evictions)
        return t * 2

    g = cudagraphify(body)
    with torch.no_grad():
        g(torch.randn(3, device=device))
    assert seen["done"], "the eviction on the other thread deadlocked"
    assert seen["other"] == 1  # evicted from the other thread's own tree at once
    assert seen["nodes"] == 1  # here, not while this thread's call was in flight
    assert info(device)["num_nodes"] == 0  # but once it ended
    assert info(device)["num_evictions"] == 1


def test_memory_budget_set_by_another_thread_during_a_warmup_applies_after_it(device):
    budget = 64 << 20
    seen = {}

    def body(t):
        done, _ = _on_another_thread(lambda: graphtrees.set_memory_budget(device, budget))
        seen.update(done=done, budget=info(device)["memory_budget"])
        return t * 2

    g = cudagraphify(body)
    try:
        with torch.no_grad():
            g(torch.randn(3, device=device))
        assert seen["done"], "setting the budget on the other thread deadlocked"
        assert seen["budget"] is None  # not in the middle of the call
        assert info(device)["memory_budget"] == budget
    finally:
        graphtrees.set_memory_budget(device, None)
