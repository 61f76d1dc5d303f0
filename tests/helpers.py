"""Shared test helpers."""

import os

import torch
from cuda_standin.standin import current as current_standin

import graphtrees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


STANDIN = current_standin()  # the CUDA stand-in this process runs on, or None


def on_standin(device="cuda"):
    """True when `device` is CUDA and CUDA is the stand-in (tests/cuda_standin): a fake CUDA
    runtime, not a GPU. Its value mode (on unless CUDA_STANDIN_VALUES=0) computes what each kernel
    would; without it, values computed on the device mean nothing (standin_values())."""
    return STANDIN is not None and torch.device(device).type == "cuda"


def standin_values():
    """True when the CUDA stand-in computes values (its value engine is loaded: Note [Stand-in
    values] in tests/cuda_standin/values.cpp)."""
    return STANDIN is not None and STANDIN.values_enabled()


# What helpers.assert_close compared on the CUDA stand-in, for the stage's closing line
# (conftest.py): values, structure only (the value mode off), or skipped for unknown values.
STANDIN_COMPARISONS = {"values": 0, "structure": 0, "unknown": 0}


def _is_standin_tensor(t):
    return isinstance(t, torch.Tensor) and t.device.type == "cuda" and STANDIN is not None


def _same_structure(actual, expected, path="result"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__}, not a tensor"
        got = (tuple(actual.shape), actual.dtype, actual.device)
        want = (tuple(expected.shape), expected.dtype, expected.device)
        assert got == want, f"{path}: {got} vs {want}"
        actual.cpu()  # reading it raises if graphtrees says it was overwritten
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same_structure(a, e, f"{path}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for k in expected:
            _same_structure(actual[k], expected[k], f"{path}[{k!r}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _any_standin_tensor(x):
    if _is_standin_tensor(x):
        return True
    if isinstance(x, (list, tuple)):
        return any(_any_standin_tensor(v) for v in x)
    if isinstance(x, dict):
        return any(_any_standin_tensor(v) for v in x.values())
    return False


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()  # a copy: bytes moved by the stand-in, no kernel
    if isinstance(x, (list, tuple)):
        return [_to_cpu(v) for v in x] if isinstance(x, list) else tuple(_to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def assert_close(actual, expected, **kwargs):
    """torch.testing.assert_close, and on the CUDA stand-in:
    - with its value mode (the default), the values are compared on host copies; a tensor whose
      values the stand-in could not compute (a Triton kernel wrote it) skips the test with that
      reason, never a silent pass;
    - with the value mode off (CUDA_STANDIN_VALUES=0), only what does not depend on kernels'
      results: structure, shapes, dtypes, devices, and that the result can be read (which raises
      if graphtrees says it was overwritten).
    Each is counted in STANDIN_COMPARISONS."""
    if not (_any_standin_tensor(actual) or _any_standin_tensor(expected)):
        torch.testing.assert_close(actual, expected, **kwargs)
        return
    _same_structure(actual, expected)
    if not standin_values():
        STANDIN_COMPARISONS["structure"] += 1
        return
    for t in (*_tensors(actual), *_tensors(expected)):
        known, why = STANDIN.values_known(t)
        if not known:
            STANDIN_COMPARISONS["unknown"] += 1
            import pytest

            pytest.skip(f"cannot compare values on the CUDA stand-in: {why}")
    torch.testing.assert_close(_to_cpu(actual), _to_cpu(expected), **kwargs)
    STANDIN_COMPARISONS["values"] += 1


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
