import gc
import logging
import os

import pytest
import torch

import graphtrees
from graphtrees._ext import get_ext, has_ext

from helpers import STANDIN, STANDIN_COMPARISONS, standin_values

if STANDIN is not None:
    # cuDNN carries its own static CUDA runtime and is not modelled by the stand-in (README.md in
    # tests/cuda_standin); convolutions take ATen's own kernels and cuBLAS instead.
    torch.backends.cudnn.enabled = False


def _cuda_usable():
    # The CUDA backend is enabled with GRAPHTREES_CUDA=1 until it has been verified on a GPU.
    return (
        has_ext()
        and "cuda" in get_ext().backends
        and os.environ.get("GRAPHTREES_CUDA") == "1"
        and torch.cuda.is_available()
    )


KERNELS_SKIP_PREFIX = "needs kernel results the CUDA stand-in does not compute"


def pytest_collection_modifyitems(config, items):
    if not has_ext():
        skip = pytest.mark.skip(reason="graphtrees._C is not built")
        for item in items:
            if "needs_ext" not in item.keywords and "no_ext_ok" not in item.keywords:
                item.add_marker(skip)
        return
    if _cuda_usable():
        if STANDIN is not None:
            # A CUDA test whose point is what a real kernel does (a device-side assert, NCCL,
            # cuFFT, a Triton kernel) cannot pass or fail meaningfully on the stand-in: it says
            # why with needs_kernels("..."). One whose point is a value computed on the device
            # says so with needs_values("..."): the stand-in's value mode computes those (Note
            # [Stand-in values]); with it off (CUDA_STANDIN_VALUES=0) they are skipped too.
            values = standin_values()
            for item in items:
                if "needs_cuda" not in item.keywords:
                    continue
                marker = item.get_closest_marker("needs_kernels")
                if marker is None and not values:
                    marker = item.get_closest_marker("needs_values")
                if marker is not None:
                    why = marker.args[0] if marker.args else "values computed by kernels"
                    item.add_marker(pytest.mark.skip(reason=f"{KERNELS_SKIP_PREFIX}: {why}"))
        return
    skip_cuda = pytest.mark.skip(
        reason="needs a CUDA device, graphtrees built with its CUDA backend, and GRAPHTREES_CUDA=1"
    )
    for item in items:
        if "needs_cuda" in item.keywords:
            item.add_marker(skip_cuda)


# Tests that brought bytes the value mode does not know to the host (.cpu(), .item(), printing):
# any comparison they made of those bytes compared nothing computed (stand-in stats
# "unknown_reads"); named in the summary, so that a pass there is not taken for a value check.
UNKNOWN_READS = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if STANDIN is None or not standin_values():
        yield
        return
    before = STANDIN.stats()["unknown_reads"]
    yield
    n = STANDIN.stats()["unknown_reads"] - before
    if n > 0:
        UNKNOWN_READS[item.nodeid] = n


def pytest_sessionstart(session):
    # The value mode is asked for but its engine did not load (it says why on stderr): the CUDA
    # tests would compare structure only, which must not pass for a value run.
    if STANDIN is None:
        return
    from cuda_standin.standin import values_requested

    if values_requested() and not standin_values():
        raise pytest.UsageError(
            "the CUDA stand-in's value mode is on (CUDA_STANDIN_VALUES is not 0) but its value "
            "engine is not loaded in this process (see the reason above; "
            "tests/cuda_standin/standin.py build-values builds it); CUDA_STANDIN_VALUES=0 runs "
            "the CUDA tests comparing structure only"
        )


def pytest_terminal_summary(terminalreporter):
    """On the CUDA stand-in: how many CUDA tests ran, passed, and were skipped for kernels, and
    what helpers.assert_close compared: values, or structure only."""
    if STANDIN is None:
        return
    stats = terminalreporter.stats

    def cuda(reports):
        return [r for r in reports if "needs_cuda" in getattr(r, "keywords", {})]

    passed = len([r for r in cuda(stats.get("passed", [])) if r.when == "call"])
    failed = len({r.nodeid for r in cuda(stats.get("failed", []) + stats.get("error", []))})
    skipped = cuda(stats.get("skipped", []))
    kernels = len([r for r in skipped if KERNELS_SKIP_PREFIX in str(r.longrepr)])
    mode = "values computed on the host" if standin_values() else "kernels not executed"
    terminalreporter.write_line(
        f"CUDA stand-in ({mode}): {passed + failed} CUDA tests ran, {passed} "
        f"passed, {failed} failed, {kernels} skipped for kernels, "
        f"{len(skipped) - kernels} skipped otherwise"
    )
    c = STANDIN_COMPARISONS
    terminalreporter.write_line(
        f"CUDA stand-in comparisons (helpers.assert_close): {c['values']} of values, "
        f"{c['structure']} of structure only, {c['unknown']} skipped for unknown values"
    )
    if UNKNOWN_READS:
        terminalreporter.write_line(
            f"CUDA stand-in: {len(UNKNOWN_READS)} test(s) read values it does not know to the "
            "host (their own comparisons of those bytes compared nothing computed): "
            + ", ".join(f"{k} ({v})" for k, v in sorted(UNKNOWN_READS.items()))
        )


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.needs_cuda),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


FAILURE_POINTS = tuple(get_ext().failure_points) if has_ext() else ()


def _cpu_totals():
    return list(get_ext()._cpu_pool_totals())


# Each test ends with full garbage collections (clean_trees, below), so that cycles holding pool
# tensors die before the pools are checked. With torch, transformers and diffusers loaded, a full
# collection walked some 400,000 objects (0.2-0.5 s) and the three of each test were most of the
# suite's time. What exists once the tests are collected (the libraries, the test modules) is
# moved out of the collector's sight (gc.freeze): it lives for the whole run, holds no pool tensor
# (no test has run yet), and a cycle through it would only show as a failed pool check, never hide
# one. The collections then walk what the tests made.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def clean_trees():
    """Every test starts and ends without trees; after reset() no pool block may stay alive."""
    if not has_ext():
        yield
        return
    _C = get_ext()
    _C._set_debug_checks(True)
    graphtrees.reset()
    gc.collect()
    yield
    for point in FAILURE_POINTS:
        _C._inject_failure(point, 0)
    for dev in ("cpu", "cuda:0") if _cuda_usable() else ("cpu",):
        graphtrees.set_memory_budget(dev, None)
    gc.collect()
    graphtrees.reset()
    gc.collect()
    pools, blocks, reserved = _cpu_totals()
    assert (pools, blocks, reserved) == (0, 0, 0), (
        f"after reset(): {pools} CPU pools alive, {blocks} blocks allocated, "
        f"{reserved} bytes reserved"
    )
    for dev in ("cpu", "cuda:0") if _cuda_usable() else ("cpu",):
        info = graphtrees.tree_info(dev)
        assert info["num_nodes"] == 0 and info["pool"]["reserved_bytes"] == 0
    if _cuda_usable():
        from helpers import live_pool_blocks

        assert live_pool_blocks() == 0


@pytest.fixture
def no_grad():
    """Graphed calls under torch.no_grad() (cudagraphify runs autograd calls eagerly)."""
    with torch.no_grad():
        yield


@pytest.fixture
def tree_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="graphtrees")
    return caplog
