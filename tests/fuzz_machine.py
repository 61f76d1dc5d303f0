"""A stateful fuzzer of graphtrees' public API against an eager oracle (hypothesis
RuleBasedStateMachine), shared by tests/test_fuzz.py (a short run in CI) and scripts/fuzz.py (long
runs, results in benchmarks/results/).

Rules: calls of several graphed functions (views, several outputs, two shapes, an in-place update
of a static buffer, buckets, on_overwrite both ways) on fresh inputs and on held outputs; drops of
held outputs; mark_step_begin(); reset(); memory budgets; injected failures (capture, checkpoint,
restore, pool allocation) at random moments. After every step:
  - each result equals the eager oracle run on the same input values;
  - every held output still equals its value when returned, or raises the overwritten error on
    access (never wrong data);
  - the pool invariant holds.
"""

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import graphtrees

from helpers import as_list, value_or_none

# (number of tensor arguments, function, options)
FUNCS = [
    (1, lambda x: x + 1, {}),
    (2, lambda x, y: (x * y, x - y), {}),
    (1, lambda x: x.t(), {}),  # a view of its input
    (1, lambda x: ((x * 2).sum(0, keepdim=True) + x, x.abs()), {"on_overwrite": "copy"}),
    (2, lambda x, y: torch.cat([x, y], 0)[: x.shape[0]] * 3, {}),
    (1, lambda x: x.relu() - 1, {"buckets": [2, 4], "bucket_dim": 0}),
]
SHAPES = [(4, 4), (2, 4), (3, 4), (1, 4)]
# Failure points every call survives (the call runs eagerly; the tree stays consistent).
POINTS = [
    "restore",
    "backend_restore",
    "partial_restore",
    "checkpoint",
    "capture_end",
    "pool_alloc",
]


COUNTED = (
    "num_recordings",
    "num_replays",
    "num_checkpoints",
    "num_invalidations",
    "num_migrations",
    "num_out_of_memory",
    "num_evictions",
    "num_fallbacks",
)


class TreeMachine(RuleBasedStateMachine):
    device = "cpu"
    steps = 0  # over every machine run by this process (scripts/fuzz.py reports them)
    totals = dict.fromkeys(COUNTED, 0)

    def _count(self):
        info = graphtrees.tree_info(self.device)
        for k in COUNTED:
            TreeMachine.totals[k] += info[k]

    @initialize()
    def setup(self):
        graphtrees.reset()
        self.graphed = [graphtrees.cudagraphify(f, **opts) for _, f, opts in FUNCS]
        self.buf = torch.zeros(4, device=self.device)  # a static buffer updated in place
        self.buf_value = self.buf.clone()
        self.update = graphtrees.cudagraphify(lambda b, x: b.add_(x.sum()), static_argnums=(0,))
        self.held = []  # (tensor, expected value)
        self.grad = torch.no_grad()
        self.grad.__enter__()

    def teardown(self):
        if hasattr(self, "grad"):
            self.grad.__exit__(None, None, None)
        C = graphtrees._ext.get_ext()
        for point in POINTS:
            C._inject_failure(point, 0)
        graphtrees.set_memory_budget(self.device, None)
        self.held = []
        self._count()
        graphtrees.reset()

    def _fresh(self, shape, seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=gen).to(self.device)

    @rule(
        fi=st.integers(0, len(FUNCS) - 1),
        sources=st.lists(st.integers(-1, 30), min_size=2, max_size=2),
        shape=st.integers(0, len(SHAPES) - 1),
        seed=st.integers(0, 10_000),
    )
    def call(self, fi, sources, shape, seed):
        nargs, f, _ = FUNCS[fi]
        inputs = []
        for k, src in enumerate(sources[:nargs]):
            t = None
            if src >= 0 and self.held:
                t = self.held[src % len(self.held)][0]
                if inputs and t.shape != inputs[0].shape:
                    t = None
            if t is None:
                t = self._fresh(tuple(inputs[0].shape) if inputs else SHAPES[shape], seed + k)
            inputs.append(t)
        values = [value_or_none(t) for t in inputs]
        TreeMachine.steps += 1
        if any(v is None for v in values):
            # An overwritten input: the graphed call must refuse it, not compute on garbage.
            try:
                self.graphed[fi](*inputs)
            except RuntimeError as e:
                assert "overwritten" in str(e), str(e)
                return
            raise AssertionError("a graphed call read an overwritten input without raising")
        expected = as_list(f(*values))
        got = as_list(self.graphed[fi](*inputs))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
            self.held.append((g, e.clone()))

    @rule(seed=st.integers(0, 10_000))
    def update_static_buffer(self, seed):
        x = self._fresh((4,), seed)
        self.buf_value = self.buf_value + x.sum()
        TreeMachine.steps += 1
        out = self.update(self.buf, x)
        torch.testing.assert_close(out, self.buf_value)
        torch.testing.assert_close(self.buf, self.buf_value)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 50))
    def drop(self, i):
        self.held.pop(i % len(self.held))

    @rule()
    def mark_step(self):
        graphtrees.mark_step_begin()

    @rule()
    def reset(self):
        self._count()
        graphtrees.reset()

    @rule(budget=st.sampled_from([None, 0, 4096, 1 << 20]))
    def set_budget(self, budget):
        graphtrees.set_memory_budget(self.device, budget)

    @rule(point=st.sampled_from(POINTS), skip=st.integers(0, 3))
    def inject(self, point, skip):
        graphtrees._ext.get_ext()._inject_failure(point, 1, skip)

    @invariant()
    def held_outputs_are_right_or_refuse(self):
        if not hasattr(self, "held"):
            return
        still = []
        for t, e in self.held:
            v = value_or_none(t)
            if v is not None:
                torch.testing.assert_close(v, e)
                still.append((t, e))
        self.held = still

    @invariant()
    def pool_invariant_holds(self):
        ok, why = graphtrees.check_pool_invariants(self.device)
        assert ok, why
