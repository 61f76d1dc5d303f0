"""PyTorch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db) through
cudagraphify: each sample recorded, then replayed on a second sample of the same structure, and
compared with eager (issue 28's conformance suite). tests/test_opinfo.py runs a CI-sized
selection; scripts/opinfo_sweep.py runs all of it and writes the figures."""

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch.utils import _pytree

import graphtrees

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.int64, torch.bool)

# Outcomes, one per (op, variant, dtype, sample):
#   program   recorded; its replays ran the recorded op program (no Python), results equal eager
#   python    recorded; replays re-ran the Python function (the program was not proven faithful)
#   eager     graphtrees ran the call eagerly (with a logged reason), results equal eager
#   wrong     a result differed from eager's: a defect
#   error     graphtrees raised where eager did not: a defect
#   nondet    eager itself gives different results on the same input (listed with the reason)
#   skipped   the op raises eagerly on this sample, or no second sample of the same structure
OUTCOMES = ("program", "python", "eager", "wrong", "error", "nondet", "skipped")

# Ops whose eager result is not a function of their inputs: two eager runs may agree by chance
# (the allocator hands back the same uninitialised block), so they are listed, not compared.
NONDETERMINISTIC = {
    name: "returns uninitialised memory"
    for name in (
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "torch.empty",
    )
}


@dataclasses.dataclass
class Case:
    op: Any
    variant: str  # "functional" or "inplace"
    dtype: torch.dtype

    @property
    def name(self):
        full = self.op.name + (f".{self.op.variant_test_name}" if self.op.variant_test_name else "")
        return f"{full}[{self.variant},{str(self.dtype).replace('torch.', '')}]"


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def cases(dtypes=DTYPES, variants=("functional", "inplace")):
    for op in op_db():
        supported = op.supported_dtypes("cpu")
        for dtype in dtypes:
            if dtype not in supported:
                continue
            for variant in variants:
                if variant == "inplace" and op.inplace_variant is None:
                    continue
                yield Case(op, variant, dtype)


def _samples(case, seed, limit):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = []
        for s in case.op.sample_inputs("cpu", case.dtype, requires_grad=False):
            out.append(s)
            if len(out) == limit:
                break
    return out


def _structure(sample):
    leaves, spec = _pytree.tree_flatten((sample.input, sample.args, sample.kwargs))

    def of(x):
        if not isinstance(x, torch.Tensor):
            return repr(x)
        strides = x.stride() if x.layout == torch.strided else str(x.layout)
        return (tuple(x.shape), x.dtype, strides)

    return spec, [of(x) for x in leaves]


def _equal(a, b):
    la, sa = _pytree.tree_flatten(a)
    lb, sb = _pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or x.is_conj() != y.is_conj():
                return False
            if x.is_neg() != y.is_neg():
                return False
            try:
                torch.testing.assert_close(x, y, equal_nan=True, atol=0, rtol=0)
            except AssertionError:
                return False
        elif isinstance(x, float) and isinstance(y, float):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif x != y:
            return False
    return True


def _clone(sample):
    return _pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
        (sample.input, sample.args, sample.kwargs),
    )


def _variant(case):
    return case.op.op if case.variant == "functional" else case.op.inplace_variant


def run(case, samples=1, verify=False):
    """{outcome: count} for the case's first `samples` samples, and [(outcome, detail)] for those
    that are not program/python/eager."""
    counts = dict.fromkeys(OUTCOMES, 0)
    notes = []
    try:
        first = _samples(case, 0, samples)
        second = _samples(case, 1, samples)
    except Exception as e:  # noqa: BLE001 - the database's own sample generator failed
        counts["skipped"] += 1
        return counts, [("skipped", f"no samples: {type(e).__name__}")]
    fn = _variant(case)
    for a, b in zip(first, second):
        outcome, detail = _run_pair(case, fn, a, b, verify)
        counts[outcome] += 1
        if outcome not in ("program", "python", "eager"):
            notes.append((outcome, detail))
    return counts, notes


def _run_pair(case, fn, a, b, verify):
    if case.op.name in NONDETERMINISTIC:
        return "nondet", NONDETERMINISTIC[case.op.name]
    if _structure(a) != _structure(b):
        b = a  # replay on the same values: still a replay of the recording
    # Eager on copies: whether it runs, and whether it is deterministic.
    try:
        inp, args, kwargs = _clone(b)
        want = fn(inp, *args, **kwargs)
        inp2, args2, kwargs2 = _clone(b)
        again = fn(inp2, *args2, **kwargs2)
    except Exception as e:  # noqa: BLE001 - the op refuses the sample eagerly: no comparison
        return "skipped", f"eager raises {type(e).__name__}"
    if case.variant == "inplace":
        want, again = (want, inp), (again, inp2)
    if not _equal(want, again):
        return "nondet", "eager differs between two runs on the same input"
    graphtrees.reset()
    g = graphtrees.cudagraphify(
        lambda inp, args, kwargs: fn(inp, *args, **kwargs),
        name=case.name,
        verify=True if verify else None,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):  # warmup, recording
                inp, args, kwargs = _clone(a)
                g(inp, args, kwargs)
            for _ in range(2):  # replays on the second sample's values
                inp, args, kwargs = _clone(b)
                got = g(inp, args, kwargs)
                if case.variant == "inplace":
                    got = (got, inp)
                if not _equal(got, want):
                    return "wrong", "a replay differs from eager"
    except graphtrees.ReplayMismatchError as e:
        return "wrong", f"verify: {str(e)[:200]}"
    except Exception as e:  # noqa: BLE001 - graphtrees raised where eager did not: a defect
        return "error", f"{type(e).__name__}: {str(e)[:200]}"
    t = graphtrees.tree_info("cpu")
    if t["num_replays"] == 0:
        return "eager", "; ".join(filter(None, (s["eager_reason"] for s in g.signatures())))
    modes = {n["cpu_replay"] for n in t["nodes"]}
    return ("program" if modes == {"program"} else "python"), ""
