"""Shared test helpers."""

import os

import torch

import graphtrees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def info(device):
    return graphtrees.tree_info(device)


def replays_run_python(device):
    """The CPU emulation re-runs the callable on replay; a CUDA graph does not."""
    return torch.device(device).type == "cpu"


def pool_allocated_blocks(device):
    return info(device)["pool"]["allocated_blocks"]


def assert_invariants(device):
    ok, why = graphtrees.check_pool_invariants(device)
    assert ok, why


def live_pool_blocks():
    """Allocated blocks in any private (graph) pool of the CUDA caching allocator."""
    n = 0
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        n += sum(1 for b in seg["blocks"] if b["state"] == "active_allocated")
    return n


def assert_overwritten(t):
    """Accessing `t` must raise graphtrees' overwritten-output error."""
    import pytest

    with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
        t + 1
    with pytest.raises(RuntimeError, match=r"\.clone\(\)"):
        t.sum()


def as_list(result):
    """A graphed function's result as a list of tensors (a tuple, or one tensor)."""
    return list(result) if isinstance(result, tuple) else [result]


def value_or_none(t):
    """A copy of `t`'s value, or None if graphtrees says it was overwritten (any other error
    fails the caller)."""
    try:
        return t.clone()
    except RuntimeError as e:
        assert "overwritten" in str(e), str(e)
        return None
