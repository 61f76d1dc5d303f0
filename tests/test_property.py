"""Property-based test: random programs over several graphed functions never return wrong data.

Each program is a sequence of calls (on fresh inputs or on outputs held from earlier calls),
drops of held outputs, mark_step_begin() and reset(). After every step:
  - each graphed result equals the eager result on the same input values;
  - every held output either still equals the value it had when it was returned, or raises the
    overwritten-output error on access (never wrong data);
  - the pool's allocated blocks are exactly the live outputs that own pool memory.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphtrees
from graphtrees import cudagraphify

from helpers import as_list, assert_close, assert_invariants, value_or_none

FUNCS = [
    (1, lambda x: x + 1),
    (2, lambda x, y: (x * y, x - y)),
    (1, lambda x: x.t()),  # a view of its input
    (1, lambda x: ((x * 2).sum(0, keepdim=True) + x, x.abs())),
    (2, lambda x, y: torch.cat([x, y], 0)[: x.shape[0]] * 3),
]
SHAPES = [(4, 4), (2, 4)]

arg = st.one_of(
    st.tuples(st.just("fresh"), st.sampled_from([0, 0, 0, 1]), st.integers(0, 10_000)),
    st.tuples(st.just("held"), st.integers(0, 50)),
)
call = st.tuples(
    st.just("call"), st.integers(0, len(FUNCS) - 1), st.lists(arg, min_size=2, max_size=2)
)
# A typical step: a new step begins, f_i runs on a fresh input and f_j on f_i's first output.
step_op = st.tuples(
    st.just("step"),
    st.integers(0, len(FUNCS) - 1),
    st.integers(0, len(FUNCS) - 1),
    st.integers(0, 3),
)
# Weighted: calls dominate, so that functions get warmed up, recorded and replayed.
op = st.one_of(
    step_op,
    step_op,
    step_op,
    call,
    call,
    call,
    call,
    call,
    st.tuples(st.just("drop"), st.integers(0, 50)),
    st.tuples(st.just("mark_step")),
    st.tuples(st.just("mark_step")),
    st.tuples(st.just("reset")),
)


COUNTERS = (
    "num_replays",
    "num_recordings",
    "num_checkpoints",
    "num_invalidations",
    "num_rerecords",
)


def _add_counters(totals, device):
    t = graphtrees.tree_info(device)
    for k in COUNTERS:
        totals[k] = totals.get(k, 0) + t[k]


def run_program(device, program):
    """Runs `program`; returns the tree counters summed over the program (resets included)."""
    totals = {}
    graphtrees.reset()
    graphed = [cudagraphify(f) for _, f in FUNCS]
    held = []  # (tensor, expected value)
    expanded = []
    for step in program:
        if step[0] == "step":
            _, i, j, seed = step
            expanded += [
                ("mark_step",),
                ("call", i, [("fresh", 0, seed), ("fresh", 0, seed + 1)]),
                ("call", j, [("held", -1), ("fresh", 0, seed + 2)]),
            ]
        else:
            expanded.append(step)
    for step in expanded:
        kind = step[0]
        if kind == "call":
            _, fi, args = step
            nargs, f = FUNCS[fi]
            inputs = []
            for a in args[:nargs]:
                if a[0] == "held" and held:
                    t, _ = held[a[1] % len(held)]
                    if inputs and t.shape != inputs[0].shape:
                        t = None
                else:
                    t = None
                if t is None:
                    shape = SHAPES[a[1]] if a[0] == "fresh" else SHAPES[0]
                    if inputs:
                        shape = tuple(inputs[0].shape)
                    gen = torch.Generator().manual_seed(a[-1])
                    t = torch.randn(shape, generator=gen).to(device)
                inputs.append(t)
            values = [value_or_none(t) for t in inputs]
            if any(v is None for v in values):
                # An overwritten input: the graphed call must refuse it, not compute on garbage.
                with pytest.raises(RuntimeError, match="overwritten"):
                    graphed[fi](*inputs)
                continue
            expected = as_list(f(*values))
            got = as_list(graphed[fi](*inputs))
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                assert_close(g, e)
                held.append((g, e.clone()))
        elif kind == "drop" and held:
            held.pop(step[1] % len(held))
        elif kind == "mark_step":
            graphtrees.mark_step_begin()
        elif kind == "reset":
            _add_counters(totals, device)
            graphtrees.reset()
        still = []
        for t, e in held:
            v = value_or_none(t)
            if v is not None:
                assert_close(v, e)
                still.append((t, e))
        held = still
        assert_invariants(device)
    del held
    _add_counters(totals, device)
    graphtrees.reset()
    return totals


@settings(
    max_examples=int(os.environ.get("GRAPHTREES_HYPOTHESIS_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(program=st.lists(op, min_size=12, max_size=40))
def test_random_programs_never_return_wrong_data(device, program):
    with torch.no_grad():
        run_program(device, program)


def test_long_program_exercises_all_paths(device):
    """A fixed long program that reaches replays, branch switches and restores for sure."""
    prog = []
    for i in range(8):
        prog += [("mark_step",), ("call", 0, [("fresh", 0, i), ("fresh", 0, 0)])]
        prog += [("call", 1 + i % 2, [("held", 0), ("fresh", 0, 3)])]
        prog += [("call", 3, [("held", 1), ("fresh", 0, 1)])]
        if i % 3 == 2:
            prog += [("drop", 0)]
    with torch.no_grad():
        totals = run_program(device, prog)
    for k in ("num_replays", "num_recordings", "num_checkpoints", "num_invalidations"):
        assert totals[k] > 0, totals
