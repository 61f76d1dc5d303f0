"""Behaviour specific to the CPU emulation backend (allocation routing, replay of allocation
sequences, the pool allocator)."""

import threading

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import assert_invariants, info

pytestmark = pytest.mark.usefixtures("no_grad")


# Control flow on tensor values (`if x.sum() > 0`) is a host sync: the recording is rejected and
# the function runs eagerly (tests/test_hardening.py). Control flow on Python state that changes
# between calls is baked by a program replay, as by a CUDA graph (tests/test_cpu_graphs.py;
# verify=True reports it). The Python replay (cpu_replay="python") runs the function again, and
# the checks below catch where that run leaves the recording.


def test_data_dependent_control_flow_raises_a_clear_error():
    mode = {"double": True}

    def branchy(x):
        if mode["double"]:
            return x * 2
        return torch.cat([x, x])[: x.shape[0]] + 1

    g = cudagraphify(branchy, cpu_replay="python")
    pos = torch.ones(8)
    for _ in range(3):
        torch.testing.assert_close(g(pos), pos * 2)
    mode["double"] = False
    with pytest.raises(
        RuntimeError,
        match=r"replay of '.*branchy' diverged from its recording: "
        r"allocation #\d+ asked for 64 bytes where the "
        r"recording asked for \d+",
    ):
        g(pos)
    # Nothing is left half-done (Note [A failed replay]): the function runs eagerly from then on,
    # with the reason, and a call that would diverge again returns eager's result instead of
    # raising at every call.
    (sig,) = g.signatures()
    assert sig["eager_reason"].startswith("its replay failed: "), sig
    assert "diverged from its recording" in sig["eager_reason"], sig
    torch.testing.assert_close(g(pos), torch.cat([pos, pos])[:8] + 1)
    mode["double"] = True
    torch.testing.assert_close(g(pos * 3), pos * 6)
    assert_invariants("cpu")


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_the_users_own_error_in_a_python_replay_does_not_make_it_eager(error):
    # Note [A failed replay]: only graphtrees' own failures (a divergence, a copy) mark the
    # function eager; an error the function raises itself -- a RuntimeError too -- propagates, and
    # the next call replays again.
    state = {"raise": False, "runs": 0}

    def f(a):
        state["runs"] += 1
        b = a + 1
        if state["raise"]:
            raise error("the user's own")
        return b * 3

    g = cudagraphify(f, cpu_replay="python")
    x = torch.arange(4.0)
    for _ in range(3):
        torch.testing.assert_close(g(x), (x + 1) * 3)
    replays = info("cpu")["num_replays"]
    state.update({"raise": True, "runs": 0})
    with pytest.raises(error, match="the user's own"):
        g(x)
    assert state["runs"] == 1  # not run a second time
    state["raise"] = False
    torch.testing.assert_close(g(x + 1), (x + 2) * 3)
    assert g.signatures()[0]["eager_reason"] is None
    assert info("cpu")["num_replays"] == replays + 1
    assert_invariants("cpu")


def test_replay_with_fewer_allocations_raises():
    mode = {"twice": True}

    def f(x):
        y = x + 1
        if mode["twice"]:
            y = y * 2  # one more allocation
        return y

    g = cudagraphify(f, cpu_replay="python")
    x = torch.ones(4)
    for _ in range(3):
        g(x)
    mode["twice"] = False
    with pytest.raises(
        RuntimeError, match=r"the replay made \d+ allocations where the recording made \d+"
    ):
        g(x)


def test_routing_is_confined_to_the_calling_thread():
    kept = []

    def f(x):
        t = threading.Thread(target=lambda: kept.append(torch.empty(1 << 16)))
        t.start()
        t.join()
        return x + 1

    g = cudagraphify(f)
    x = torch.ones(4)
    for _ in range(3):
        g(x)
    # Tensors allocated by the other thread during warmup and capture are not in the pool: the
    # pool's blocks are exactly the tracked outputs. (The replay runs no Python: no third one.)
    assert len(kept) == 2
    assert_invariants("cpu")


def test_state_created_lazily_by_a_warmup_moves_out_of_the_pool(tree_logs):
    # Note [Kept state]: a cache a function creates on its first call and keeps is moved out of
    # the pool at the end of that warmup; later recordings see an ordinary tensor.
    cache = []

    def f(x):
        y = x * 2
        if not cache:
            cache.append(y * 3)  # created lazily during warmup, kept, never returned
        return y + cache[0]

    g = cudagraphify(f, name="lazy")
    h = cudagraphify(lambda y: y + 1)
    x = torch.ones(4)
    for _ in range(3):
        mark_step_begin()
        a = g(x)
        torch.testing.assert_close(h(a), x * 8 + 1)
    assert "that a warmup of 'lazy' created and kept" in tree_logs.text
    assert info("cpu")["num_replays"] >= 2 and info("cpu")["num_migrations"] == 1
    assert_invariants("cpu")


def test_state_created_and_kept_by_a_recording_gives_a_clear_error():
    # Only warmups may create state: a recording's memory belongs to the graph. On the CPU
    # emulation's Python replay the replay that no longer creates it is caught; with a program
    # replay, as on CUDA, the next restore is.
    graphtrees._ext.get_ext()._set_debug_checks(False)
    cache, calls = [], []

    def f(x):
        calls.append(1)
        y = x * 2
        if len(calls) == 2:
            cache.append(y * 3)  # created by the recording, kept, never returned
        return y

    g = cudagraphify(f, cpu_replay="python")
    x = torch.ones(4)
    g(x)
    g(x)
    with pytest.raises(RuntimeError, match="diverged from its recording"):
        g(x)
    cache.clear()


def test_tensor_kept_by_every_run_is_refused_on_replay():
    graphtrees._ext.get_ext()._set_debug_checks(False)
    stash = []

    def f(x):
        y = x * 2
        stash.append(y * 3)  # kept on every call
        return y

    g = cudagraphify(f, cpu_replay="python")  # a program replay runs no Python: keeps nothing
    x = torch.ones(4)
    g(x)
    g(x)
    with pytest.raises(RuntimeError, match=r"kept 1 tensor\(s\) it allocated without returning"):
        g(x)
    stash.clear()


def test_non_dense_and_non_contiguous_inputs():
    g = cudagraphify(lambda a, b: a * 2 + b)
    for _ in range(3):
        a = torch.randn(4, 1).expand(4, 8)  # stride 0
        b = torch.randn(8, 4).t()  # transposed
        torch.testing.assert_close(g(a, b), a * 2 + b)


def test_empty_and_integer_tensors():
    g = cudagraphify(lambda x, e, m: (x // 2, e * 2, m & True, torch.empty(0)))
    for _ in range(3):
        x = torch.arange(10)
        e = torch.empty(0, 3)
        m = torch.rand(5) > 0.5
        a, b, c, d = g(x, e, m)
        torch.testing.assert_close(a, x // 2)
        assert b.shape == (0, 3) and d.numel() == 0
        torch.testing.assert_close(c, m)


def test_pool_segments_follow_size_classes():
    small = cudagraphify(lambda x: x + 1)
    for _ in range(3):
        out = small(torch.ones(1000))
    t = info("cpu")
    assert t["pool"]["reserved_bytes"] == 2 << 20  # one small segment
    large = cudagraphify(lambda x: x + 1)
    big = torch.ones(3 << 20 >> 2)  # 3 MiB
    for _ in range(3):
        mark_step_begin()
        out = large(big)
    t = info("cpu")
    assert t["pool"]["reserved_bytes"] == (2 << 20) + (20 << 20)
    # Blocks are multiples of 512 bytes inside 64-byte aligned segments.
    mark_step_begin()
    out = large(big)
    assert out.untyped_storage().data_ptr() % 64 == 0
    del out


def test_restore_keeps_live_outputs_and_frees_dead_ones():
    g1 = cudagraphify(lambda x: (x + 1, x + 2, x + 3))
    g2 = cudagraphify(lambda a: a * 2)
    x = torch.ones(256)
    for _ in range(3):
        mark_step_begin()
        a, b, c = g1(x)
    del b  # dies between the replay and the restore
    before = info("cpu")["num_checkpoints"]
    g2(a)  # warmup after replays: restore
    assert info("cpu")["num_checkpoints"] == before + 1
    # a and c own their blocks again; b's was freed; g2's warmup output died.
    assert info("cpu")["pool"]["allocated_blocks"] == 2
    torch.testing.assert_close(a, x + 1)
    torch.testing.assert_close(c, x + 3)
    assert_invariants("cpu")


def test_data_dependent_output_shape_raises():
    keep = {"k": 3}

    def f(x):
        t = x * 2
        return t[: keep["k"]]

    g = cudagraphify(f, cpu_replay="python")
    a = torch.tensor([1.0, 2.0, 3.0, -1.0, -2.0])
    for _ in range(3):
        torch.testing.assert_close(g(a), f(a))
    keep["k"] = 5
    with pytest.raises(
        RuntimeError, match=r"output 0 has shape \[5\] where the recording's had \[3\]"
    ):
        g(a)


def test_data_dependent_temporary_lifetime_raises():
    mode = {"keep": False}

    def f(x):
        a = x * 2
        keep = a if mode["keep"] else None  # the lifetime of `a` depends on Python state
        del a
        b = x.flip(0) + 0
        return b + (keep if keep is not None else x)

    g = cudagraphify(f, cpu_replay="python")
    neg = -torch.arange(1.0, 9.0)
    for _ in range(3):
        mark_step_begin()
        torch.testing.assert_close(g(neg), f(neg))
    mode["keep"] = True
    with pytest.raises(RuntimeError, match="still alive in this replay"):
        g(neg)
