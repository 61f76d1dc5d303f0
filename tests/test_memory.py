"""Memory: the pool budget (graphtrees.set_memory_budget, Note [Memory budget]), allocation
failures during warmup and capture (Note [Out of memory]) and eviction without thrashing
(Note [Eviction without thrashing])."""

import logging

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify
from graphtrees._ext import get_ext

from helpers import assert_close, assert_invariants, assert_overwritten, info

pytestmark = pytest.mark.usefixtures("no_grad")

MiB = 1 << 20
WIDTH = 4096  # one row of the output below is 16 KiB


class Outer(torch.nn.Module):
    """x of k floats -> a k x 4096 output (k * 16 KiB), from one allocation: with k >= 640 each
    output needs a CPU pool segment of its own (requests of 10 MiB and more)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.arange(WIDTH, dtype=torch.float32))

    def forward(self, x):
        return x[:, None] + self.w


def _call(g, k):
    x = torch.arange(k, dtype=torch.float32)
    out = g(x)
    assert_close(out, x[:, None] + torch.arange(WIDTH, dtype=torch.float32))
    return out


def _record(g, k):
    for _ in range(3):  # warmup, recording, replay
        _call(g, k)


def _nodes_by_rows(device="cpu"):
    return sorted(n["function"] for n in info(device)["nodes"])


def test_budget_evicts_least_recently_used_recording_first(tree_logs):
    m = Outer()
    g = cudagraphify(m, name="outer")
    _record(g, 640)  # 10 MiB segment (+ a 2 MiB small segment for the copied input)
    _record(g, 768)  # 12 MiB: a second segment
    _call(g, 640)  # 640 is now more recent than 768
    reserved = info("cpu")["pool"]["reserved_bytes"]
    assert reserved == 24 * MiB
    graphtrees.set_memory_budget("cpu", 36 * MiB)
    assert graphtrees.memory_budget("cpu") == 36 * MiB
    assert info("cpu")["memory_budget"] == 36 * MiB

    # 800 rows need a 14 MiB segment: 24 + 14 > 36. The least recently used recording (768) is
    # evicted and its segment returned; 640's recording stays and keeps replaying.
    _call(g, 800)
    t = info("cpu")
    assert t["num_out_of_memory"] == 1 and t["num_evictions"] == 1
    assert t["bytes_released"] == 12 * MiB
    assert t["pool"]["reserved_bytes"] == 12 * MiB
    assert "evicted node 1 ('outer#1'" in tree_logs.text and "12.0 MiB returned" in tree_logs.text
    assert "ran out of memory while warming it up" in tree_logs.text
    assert [n["function"] for n in t["nodes"]] == ["outer"]

    _record(g, 800)  # tries again after the eviction: records within the budget
    replays = info("cpu")["num_replays"]
    _call(g, 640)
    t = info("cpu")
    assert t["num_replays"] == replays + 1  # still recorded
    assert t["pool"]["reserved_bytes"] <= 36 * MiB
    assert sorted(n["function"] for n in t["nodes"]) == ["outer", "outer#2"]
    assert_invariants("cpu")


def test_budget_with_nothing_to_evict_runs_eagerly(tree_logs):
    g = cudagraphify(Outer(), name="outer")
    graphtrees.set_memory_budget("cpu", 8 * MiB)  # below what one 640-row output needs
    for _ in range(4):
        _call(g, 640)
    t = info("cpu")
    assert t["num_nodes"] == 0 and t["num_out_of_memory"] == 1  # no retry without an eviction
    assert t["pool"]["reserved_bytes"] <= 8 * MiB
    assert (
        tree_logs.text.count(
            "no recording off the current path (nor one whose outputs this call reads) was left"
        )
        == 1
    )
    graphtrees.set_memory_budget("cpu", None)
    assert graphtrees.memory_budget("cpu") is None
    graphtrees.reset()  # a reset lets it try again
    _record(g, 640)
    assert info("cpu")["num_replays"] == 1


def test_budget_survives_reset_and_is_validated():
    graphtrees.set_memory_budget("cpu", 4 * MiB)
    try:
        graphtrees.reset()
        assert graphtrees.memory_budget("cpu") == 4 * MiB
        g = cudagraphify(Outer())
        _call(g, 640)
        assert info("cpu")["memory_budget"] == 4 * MiB
        assert info("cpu")["num_out_of_memory"] == 1
    finally:
        graphtrees.set_memory_budget("cpu", None)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_pool_bytes must be an int >= 0 or None"):
            graphtrees.set_memory_budget("cpu", bad)


def test_the_current_path_is_never_evicted(tree_logs):
    # big -> follow recorded; under a tight budget, a new function called after big in the same
    # step needs a segment of its own: follow (off the path) is evicted, big (on it) never is.
    big = cudagraphify(Outer(), name="big")
    follow = cudagraphify(lambda y: y * 2, name="follow")
    other = cudagraphify(lambda y: torch.cat([y, y]) * 3, name="other")  # a 20 MiB segment
    for _ in range(3):
        graphtrees.mark_step_begin()
        y = _call(big, 640)
        assert_close(follow(y), y * 2)
    budget = info("cpu")["pool"]["reserved_bytes"]
    graphtrees.set_memory_budget("cpu", budget)
    for _ in range(4):
        graphtrees.mark_step_begin()
        y = _call(big, 640)
        assert_close(other(y), torch.cat([y, y]) * 3)
        t = info("cpu")
        assert t["pool"]["reserved_bytes"] <= budget
        assert "big" in [n["function"] for n in t["nodes"]]
    assert t["num_evictions"] == 1 and "evicted node 1 ('follow'" in tree_logs.text
    assert "node 0 ('big'" not in tree_logs.text.split("evicted node 1")[1]
    assert t["nodes"][0]["replays"] == 5  # big kept replaying throughout
    graphtrees.set_memory_budget("cpu", None)
    assert_invariants("cpu")


def _oom_every_allocation(make, args, calls=3):
    """Runs `calls` calls of a fresh wrapper with the k-th pool allocation failing, for every k
    until no allocation is left to fail; checks results, the tree and the pool each time."""
    _C = get_ext()
    # A fresh wrapper's first call is a warmup: eager values, cloned out of the pool.
    expected = tuple(t.clone() for t in make()(*args))
    graphtrees.reset()
    k = 0
    while True:
        graphtrees.reset()
        g = make()
        _C._inject_failure("pool_alloc", 1, k)
        for _ in range(calls):
            assert_close(g(*args), expected)
        fired = _C._pending_failures("pool_alloc") == 0
        _C._inject_failure("pool_alloc", 0)
        t = info("cpu")
        assert_invariants("cpu")
        if not fired:
            assert t["num_out_of_memory"] == 0 and t["num_replays"] == calls - 2
            return k
        assert t["num_out_of_memory"] == 1, k
        # The failed run changed nothing: no node (it never retries without an eviction), and
        # the pool holds only what the failed run could not give back (segments of earlier
        # successful runs that a checkpoint needs).
        assert t["num_nodes"] == 0, k
        assert t["pool"]["allocated_blocks"] == 0 or t["live_outputs"] > 0, k
        k += 1


def test_out_of_memory_at_every_allocation_index():
    def f(x, w):
        h = torch.relu(x @ w)
        return h.softmax(-1), (h * 2).sum(0)

    w = torch.randn(32, 32)
    x = torch.randn(16, 32)
    n = _oom_every_allocation(lambda: cudagraphify(f, static_argnums=(1,)), (x, w))
    assert n >= 6  # warmup, placeholder and capture allocations were all failed once


def test_out_of_memory_in_a_later_node_leaves_the_tree_usable(tree_logs):
    _C = get_ext()
    f = cudagraphify(lambda x: x * 2, name="f")
    g = cudagraphify(lambda y: (y + 1).exp(), name="g")
    x = torch.randn(64)
    for _ in range(3):
        graphtrees.mark_step_begin()
        y = f(x)
        g(y)
    h = cudagraphify(lambda y: y.sin() * 3, name="h")
    graphtrees.mark_step_begin()
    y = f(x)
    _C._inject_failure("pool_alloc", 1)
    assert_close(h(y), (x * 2).sin() * 3)  # warmup fails: eager
    assert "running 'h' eagerly: it ran out of memory while warming it up" in tree_logs.text
    for _ in range(3):
        graphtrees.mark_step_begin()
        y = f(x)
        assert_close(g(y), (x * 2 + 1).exp())
        assert_close(h(y), (x * 2).sin() * 3)
    t = info("cpu")
    assert sorted(n["function"] for n in t["nodes"]) == ["f", "g"]  # h stays eager
    assert t["num_replays"] >= 6
    assert_invariants("cpu")


def test_a_genuine_out_of_memory_in_eager_code_still_raises():
    # Not graphtrees' to swallow: the eager rerun raises it.
    def f(x):
        if x.numel() > 10:
            raise torch.OutOfMemoryError("the user's own out of memory")
        return x + 1

    g = cudagraphify(f)
    with pytest.raises(torch.OutOfMemoryError, match="the user's own"):
        g(torch.ones(20))
    assert_invariants("cpu")


def test_cycling_shapes_keep_the_hot_recordings(tree_logs):
    # More shapes cycle than max_recorded_shapes keeps: plain LRU would evict every recording
    # before it replays. Once evictions keep wasting recordings, the kept ones stay and the rest
    # run eagerly, with the advice to use buckets.
    tree_logs.set_level(logging.INFO, logger="graphtrees")
    g = cudagraphify(lambda x: x * 2 + 1, max_recorded_shapes=4)
    for _cycle in range(6):
        for b in range(1, 9):
            x = torch.randn(b, 4)
            assert_close(g(x), x * 2 + 1)
    t = info("cpu")
    assert t["num_evictions"] == 4
    assert t["num_replays"] >= 4 * 3  # 4 shapes recorded by the third cycle, replayed after
    assert len(g.signatures()) == 4
    assert tree_logs.text.count("Pass buckets=[...]") == 1
    assert_invariants("cpu")


def test_a_workload_that_moves_on_gets_its_shapes_recorded():
    g = cudagraphify(lambda x: x - 1, max_recorded_shapes=2)
    for _ in range(4):  # thrash: three shapes through two places
        for b in (1, 2, 3):
            g(torch.ones(b))
    for _ in range(12):  # then only shapes 4 and 5: the idle recordings are evicted for them
        for b in (4, 5):
            assert_close(g(torch.ones(b)), torch.zeros(b))
    t = info("cpu")
    assert t["num_nodes"] == 2 and len(g.signatures()) == 2
    replays = t["num_replays"]
    for b in (4, 5):
        g(torch.ones(b))
    assert info("cpu")["num_replays"] == replays + 2


def test_phased_shapes_still_evict_least_recently_used(tree_logs):
    # Each shape used several times in a row: evictions throw away recordings that did replay,
    # so plain LRU stays in charge.
    g = cudagraphify(lambda x: x + 3, max_recorded_shapes=2)
    for b in (1, 2, 3, 4, 5):
        for _ in range(3):
            g(torch.ones(b))
    t = info("cpu")
    assert t["num_evictions"] == 3 and t["num_replays"] == 5
    assert "Pass buckets=[...]" not in tree_logs.text


def _chain(g, calls):
    """One step of `calls` calls of g on its own outputs: rows 1 -> 2 -> 4 -> ..."""
    graphtrees.mark_step_begin()
    outs = [g(torch.ones(1, 4))]
    for _ in range(calls - 1):
        outs.append(g(outs[-1]))
    assert_close(outs[-1], torch.full((2**calls, 4), 2.0**calls))
    return outs


def test_signatures_past_the_bound_are_trimmed_once_idle(tree_logs):
    # Note [Signatures past the bound]: a new shape whose call finds every recorded signature on
    # the current path goes in past max_recorded_shapes. Once it has gone idle, a call that finds
    # its own signature evicts back down to the bound, although no new shape comes (before, the
    # extra recording stayed for good).
    g = cudagraphify(lambda x: torch.cat([x, x]) * 2, max_recorded_shapes=2, name="f")
    for _ in range(3):  # rows 1 and 2 recorded and replayed, the call on 1 row feeding 2 rows
        _chain(g, 2)
    for _ in range(3):  # then rows 4 too, past the bound: 1 and 2 are on the path
        _chain(g, 3)
    t = info("cpu")
    assert len(g.signatures()) == 3 and t["num_evictions"] == 0 and t["num_fallbacks"] == 0
    replays = t["num_replays"]
    for _ in range(5):  # rows 4 goes unused; 10 calls > 4 * max_recorded_shapes
        _chain(g, 2)
    t = info("cpu")
    assert sorted(s["name"] for s in g.signatures()) == ["f", "f#1"]
    assert t["num_evictions"] == 1 and t["num_replays"] == replays + 10
    assert "'f#2' is the least recently used of 3 recorded signatures" in tree_logs.text
    assert_invariants("cpu")


def test_signatures_past_the_bound_that_stay_in_use_keep_replaying(tree_logs):
    # Each step chains three shapes with max_recorded_shapes=2: the third always goes in past the
    # bound and must record and replay, not be trimmed before it records and then run eagerly by
    # the thrashing rule (review of the trim).
    g = cudagraphify(lambda x: torch.cat([x, x]) * 2, max_recorded_shapes=2, name="f")
    for _ in range(3):
        _chain(g, 2)
    for _ in range(20):
        _chain(g, 3)
    t = info("cpu")
    assert t["num_fallbacks"] == 0 and t["num_evictions"] == 0
    # 2 replays before; then rows 1 and 2 replay in every step, rows 4 from the third on
    assert t["num_recordings"] == 3 and t["num_replays"] == 2 + 2 * 20 + 18
    assert "keep coming" not in tree_logs.text
    assert_invariants("cpu")


def test_out_of_memory_after_a_new_step_runs_on_the_inputs_copies(tree_logs):
    # y is a replayed output of big from an earlier step, passed to a function whose warmup then
    # reuses y's memory (y is invalidated and the warmup runs on a copy) and runs out of memory:
    # the eager rerun must run on that copy too.
    big = cudagraphify(Outer(), name="big")
    other = cudagraphify(lambda y: torch.cat([y, y]) * 3, name="other")
    for _ in range(3):
        y = _call(big, 640)
    expected = torch.cat([y, y]) * 3
    graphtrees.mark_step_begin()
    graphtrees.set_memory_budget("cpu", info("cpu")["pool"]["reserved_bytes"])
    assert_close(other(y), expected)
    assert_overwritten(y)
    t = info("cpu")
    assert t["num_out_of_memory"] == 1
    assert "ran out of memory while warming it up" in tree_logs.text
    assert_invariants("cpu")
