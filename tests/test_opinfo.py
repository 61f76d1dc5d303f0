"""PyTorch's OpInfo database as a conformance suite (tests/opinfo_cases.py): every sample is
recorded, replayed on a second sample's values and compared with eager, bit for bit. This is the
CI-sized selection; scripts/opinfo_sweep.py runs every op, dtype and variant and writes the
figures to benchmarks/results/."""

import pytest
import torch
from opinfo_cases import cases, run

pytest.importorskip("expecttest")  # the OpInfo database imports it

pytestmark = pytest.mark.usefixtures("no_grad")

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


def _run_selection(dtype, variant, every, verify=False):
    selected = list(cases(dtypes=(dtype,), variants=(variant,)))[::every]
    assert len(selected) > 20, "the OpInfo database lists fewer ops than expected"
    totals, bad = {}, []
    for case in selected:
        counts, notes = run(case, samples=1, verify=verify)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        bad += [f"{case.name}: {o} ({d})" for o, d in notes if o in ("wrong", "error")]
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
