"""PyTorch's OpInfo database as a conformance suite (tests/opinfo_cases.py): every sample is
recorded, replayed on a second sample's values and compared with eager, bit for bit; samples
that require grad go through graphtrees.compile and their gradients are compared with eager's;
on CUDA every selected op must record and replay without a capture error or a crash (its values
are compared on a GPU; the CUDA stand-in runs no kernels). These are CI-sized selections;
scripts/opinfo_sweep.py runs every op, dtype and variant and writes the figures to
benchmarks/results/."""

import pytest
import torch
from opinfo_cases import DEFECTS, cases, run, run_isolated, run_training, training_cases

pytest.importorskip("expecttest")  # the OpInfo database imports it

# (dtype, variant, every k-th op), a CI-sized selection:
# every in-place variant, every other float32 op, every third complex64 op (the conjugate
# bit), every fourth int64 and bool op, every eighth float64 and bfloat16 op (float32's code
# paths). scripts/opinfo_sweep.py runs all of them, with more samples.
SELECTION = [
    (torch.float32, "functional", 2),
    (torch.float32, "inplace", 1),
    (torch.complex64, "functional", 3),
    (torch.int64, "functional", 4),
    (torch.bool, "functional", 4),
    (torch.float64, "functional", 8),
    (torch.bfloat16, "functional", 8),
]


def _add(totals, counts):
    for k, v in counts.items():
        totals[k] = totals.get(k, 0) + v


def _run_selection(dtype, variant, every, verify=False):
    selected = list(cases(dtypes=(dtype,), variants=(variant,)))[::every]
    assert len(selected) > 20, "the OpInfo database lists fewer ops than expected"
    totals, bad = {}, []
    for case in selected:
        counts, notes = run(case, samples=1, verify=verify)
        _add(totals, counts)
        bad += [f"{case.name}: {o} ({d})" for o, d in notes if o in DEFECTS]
    return selected, totals, bad


@pytest.mark.parametrize(
    "dtype, variant, every",
    SELECTION,
    ids=[f"{str(d).replace('torch.', '')}-{v}" for d, v, _ in SELECTION],
)
def test_every_selected_op_replays_equal_to_eager(dtype, variant, every):
    selected, totals, bad = _run_selection(dtype, variant, every)
    print(f"{len(selected)} cases: {totals}")
    assert not bad, "\n".join(bad)
    # Most samples must actually be recorded and replayed, not only run eagerly.
    recorded = totals["program"] + totals["python"]
    assert recorded > (0.3 if variant == "inplace" else 0.6) * len(selected), totals


def test_verify_reports_nothing_over_the_float32_ops():
    # verify=True over the same samples: an eager check of every replay, no false report.
    _, totals, bad = _run_selection(torch.float32, "functional", 6, verify=True)
    assert not bad, "\n".join(bad)
    assert totals["program"] > 0, totals


def test_gradients_through_graphtrees_compile_equal_eager():
    # Every twelfth float32 op that supports autograd, its samples requiring grad, trained
    # through graphtrees.compile: forward and backward graphs recorded, outputs and gradients
    # of four calls (warmup, recording, two replays on other values) equal eager's.
    selected = list(training_cases())[::12]
    assert len(selected) > 30, "the OpInfo database lists fewer ops than expected"
    totals, bad = {}, []
    for case in selected:
        counts, notes = run_training(case)
        _add(totals, counts)
        bad += [f"{case.name}: {o} ({d})" for o, d in notes if o in DEFECTS]
    print(f"{len(selected)} cases: {totals}")
    assert not bad, "\n".join(bad)
    assert totals["program"] + totals["python"] > 0.6 * len(selected), totals


# On CUDA: every float32 and complex64 op, functional and in-place, and every fourth op of the
# other dtypes, each in a worker process (the CUDA stand-in cannot run every op eagerly: an op
# that needs cuFFT, cuDNN or cuSOLVER raises there, and counts as skipped; a worker that dies is
# replaced, its case counted). scripts/opinfo_sweep.py --device cuda runs all of them.
CUDA_SELECTION = [
    (torch.float32, 1),
    (torch.complex64, 1),
    (torch.float64, 4),
    (torch.bfloat16, 4),
    (torch.int64, 4),
    (torch.bool, 4),
]


@pytest.mark.needs_cuda
def test_every_selected_op_records_and_replays_on_cuda():
    selected = []
    for dtype, every in CUDA_SELECTION:
        selected += list(cases(dtypes=(dtype,), device="cuda"))[::every]
    totals, bad = {}, []
    for case, counts, notes in run_isolated(selected):
        _add(totals, counts)
        bad += [f"{case.name}: {o} ({d})" for o, d in notes if o in DEFECTS]
    print(f"{len(selected)} cases: {totals}")
    assert not bad, "\n".join(bad)
    assert totals["graph"] > 0.5 * len(selected), totals
