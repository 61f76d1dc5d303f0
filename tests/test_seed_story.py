"""The seed story: record and replay g1 -> g2, then g1 -> g3, in one tree and one pool."""

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import assert_close, assert_invariants, info


class Trunk(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Head(torch.nn.Module):
    """Three large intermediates, so that its memory dominates the pool."""

    def __init__(self, d, sign):
        super().__init__()
        self.a = torch.nn.Linear(d, d)
        self.b = torch.nn.Linear(d, d)
        self.sign = sign

    def forward(self, h):
        u = torch.tanh(self.a(h))
        v = self.b(u) * self.sign
        return u + v


@pytest.mark.parametrize("batch", [1024])
def test_seed_story(device, batch):
    torch.manual_seed(0)
    d = 1024  # activations of batch x d floats = 4 MiB: the allocator's large-block path
    trunk = Trunk(d).to(device)
    head2 = Head(d, 1.0).to(device)
    head3 = Head(d, -1.0).to(device)
    g1, g2, g3 = cudagraphify(trunk), cudagraphify(head2), cudagraphify(head3)
    x = torch.randn(batch, d, device=device)
    with torch.no_grad():
        h_ref = trunk(x)
        y2_ref = head2(h_ref)
        y3_ref = head3(h_ref)
        for _ in range(3):  # warmup, record, replay
            mark_step_begin()
            h = g1(x)
            y2 = g2(h)
            assert_close(y2, y2_ref)
            assert_invariants(device)
        t = info(device)
        assert (t["num_nodes"], t["num_roots"]) == (2, 1)
        reserved_after_g2 = t["pool"]["reserved_bytes"]
        del y2

        for _step in range(3):  # g3: warmup, record, replay -- with g1's output held throughout
            mark_step_begin()
            h = g1(x)
            h_copy = h.clone()
            y3 = g3(h)
            assert_close(y3, y3_ref)
            assert_close(h, h_copy)  # g1's output intact after g3's run
            assert_close(h, h_ref)
            assert_invariants(device)
        t = info(device)
        assert t["num_nodes"] == 3 and t["num_roots"] == 1
        (root,) = [n for n in t["nodes"] if n["parent"] is None]
        assert len(root["children"]) == 2
        assert t["num_checkpoints"] == 2  # before g3's warmup and before its recording
        # g3 needs the same memory as g2 and reuses it: the pool barely grows.
        growth = t["pool"]["reserved_bytes"] - reserved_after_g2
        assert growth < 0.1 * reserved_after_g2, (reserved_after_g2, growth)

        # Both branches still replay correctly, alternately.
        for _ in range(2):
            mark_step_begin()
            h = g1(x)
            assert_close(g2(h), y2_ref)
            mark_step_begin()
            h = g1(x)
            assert_close(g3(h), y3_ref)
        assert info(device)["num_nodes"] == 3


def _copies_only(device):
    """The seed story with functions made of copies only (a clone of a contiguous tensor is a
    device-to-device copy): their values are real on every device, the CUDA stand-in included,
    where kernels never run. Inputs are static (used in place) and filled by host copies."""
    n = 1 << 20  # 4 MiB of floats: the allocator's large-block path
    g1 = cudagraphify(lambda x: x.clone(), static_argnums=(0,))

    def chain(h):
        a = h.clone()
        b = a.clone()
        return b.clone()

    def tail(h):
        return h[n // 2 :].clone()  # the second half: a contiguous slice, copied

    return n, g1, cudagraphify(chain), cudagraphify(tail)


def test_seed_story_with_copies_moves_real_values(device):
    n, g1, g2, g3 = _copies_only(device)
    x = torch.zeros(n, device=device)
    reserved = {}
    with torch.no_grad():
        # g1 -> g2 three times, g1 -> g3 three times, then the branches alternating.
        for step, branch in enumerate([g2] * 3 + [g3] * 3 + [g2, g3, g2, g3]):
            value = torch.arange(n, dtype=torch.float32) + step
            x.copy_(value)  # a host-to-device copy into the static input, in place
            mark_step_begin()
            h = g1(x)
            y = branch(h)
            want = value if branch is g2 else value[n // 2 :]
            assert torch.equal(y.cpu(), want), (step, branch)
            assert torch.equal(h.cpu(), value), step  # g1's output is never overwritten
            assert_invariants(device)
            reserved[branch] = info(device)["pool"]["reserved_bytes"]
            del y, h
        t = info(device)
    assert (t["num_nodes"], t["num_roots"]) == (3, 1)
    assert t["num_replays"] >= 12 and t["num_checkpoints"] >= 2
    # One pool for both paths: the second branch fits in what the first one reserved.
    assert reserved[g3] == reserved[g2], reserved
    graphtrees.reset()
    assert info(device)["pool"]["reserved_bytes"] == 0


def test_eight_sibling_branches_switched_at_random_match_eager(device):
    """The seed story widened: one trunk, eight sibling heads (each allocating its own amount), the
    branch chosen at random for 1,000 steps, each step's input new. Every step compares the head's
    result and the trunk's live output with eager: a checkpoint that freed a live block, an input
    copy that missed, or a placeholder at the wrong address gives a wrong value here (on the CUDA
    stand-in too, whose value mode computes what each kernel would)."""
    torch.manual_seed(0)
    d, k, steps = 32, 8, 1000
    trunk = torch.nn.Linear(d, d).to(device)
    scales = [torch.randn(d * (i + 1), device=device) for i in range(k)]

    def head(i):
        def f(h):
            wide = h.repeat(1, i + 1) * scales[i]  # i + 1 times the trunk's width
            return wide.tanh().view(h.shape[0], i + 1, d).sum(1) + i

        return f

    heads = [head(i) for i in range(k)]
    g1 = cudagraphify(trunk)
    gs = [cudagraphify(f) for f in heads]
    rng = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(steps):
            i = int(torch.randint(k, (1,), generator=rng))
            x = torch.randn(4, d, generator=rng).to(device)
            mark_step_begin()
            h = g1(x)
            y = gs[i](h)
            h_ref = trunk(x)
            assert_close(y, heads[i](h_ref), msg=lambda m, s=step, b=i: f"step {s}, head {b}: {m}")
            assert_close(h, h_ref, msg=lambda m, s=step, b=i: f"step {s}, trunk after {b}: {m}")
            del h, y
        t = info(device)
    assert t["num_nodes"] == 1 + k and t["num_roots"] == 1
    assert t["num_replays"] >= 2 * steps - 4 * (k + 1)  # all but the warmups and recordings
    assert_invariants(device)
