"""Shared test helpers."""

import os

import torch

import graphtrees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def info(device):
    return graphtrees.tree_info(device)


def cpu_replays(device):
    """How each node of the device's tree replays on CPU ("program" or "python"); [] on CUDA."""
    return [n["cpu_replay"] for n in info(device)["nodes"] if n["cpu_replay"] is not None]


def assert_replays_ran_programs(device):
    """On CPU, every node replays its recorded op program and every replay ran one (Note [CPU
    graphs]): the test's results came from replays that run no Python, as on a GPU."""
    if torch.device(device).type != "cpu":
        return
    t = info(device)
    assert cpu_replays(device) and set(cpu_replays(device)) == {"program"}, cpu_replays(device)
    assert t["num_program_replays"] == t["num_replays"] > 0, t


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
