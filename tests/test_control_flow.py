"""torch.cond and torch.while_loop inside graphed calls (Note [Control flow in a recording] in
graphtrees/_control_flow.py): values against eager, on every device; on CPU the recording holds
control steps that its program replay runs from C++ with no Python (Note [Control steps of a
program] in csrc/cpu/OpProgram.h); on CUDA the function runs eagerly, with a reason that names
the op, until conditional nodes come (issue 48)."""

import gc
import sys

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import assert_close, assert_invariants, cpu_replays, info

pytestmark = pytest.mark.usefixtures("no_grad")


def _python_calls_during(fn, *args):
    """The files of the Python functions called while fn(*args) runs (the call itself aside)."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, seen


def _run_against_eager(device, f, calls):
    """Calls f graphed and eagerly on each argument tuple (a new step each); compares results.
    Returns the results of the replays' Python-call sets (files)."""
    g = cudagraphify(f)
    replay_files = []
    for args in calls:
        mark_step_begin()
        before = info(device)["num_replays"]
        out, files = _python_calls_during(g, *args)
        expected = f(*args)
        assert_close(out, expected)
        if info(device)["num_replays"] > before:
            replay_files.append(files)
    return g, replay_files


def _assert_program_replays(device, replay_files, kinds):
    """On CPU: replays happened, ran programs, and no Python of control flow ran in them."""
    t = info(device)
    if device != "cpu":
        # CUDA: no conditional nodes yet -- eager, with a reason that names the op.
        assert t["num_replays"] == 0
        return
    assert replay_files, "no replay happened"
    assert t["num_program_replays"] == t["num_replays"] > 0
    assert set(cpu_replays(device)) == {"program"}
    for files in replay_files:
        assert not [f for f in files if "_higher_order_ops" in f or "_control_flow" in f], files
    nodes = [n for n in t["nodes"] if n["conditionals"]]
    assert nodes and all(n["kind"] == "conditional" for n in nodes)
    assert [c["kind"] for c in nodes[0]["conditionals"]] == kinds
    assert "program step" in graphtrees.tree_to_dot(device)
    assert_invariants(device)


def _eager_reason(g):
    return [s["eager_reason"] for s in g.signatures() if s["eager_reason"]]


def test_cond_on_a_predicate_that_alternates_every_call(device):
    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() + 1, (x,))

    base = torch.randn(16, device=device).abs() + 0.1
    calls = [((base if k % 2 == 0 else -base) * (k + 1),) for k in range(8)]
    g, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["cond"])
    if device != "cpu":
        assert any("torch.cond" in r and "issue 48" in r for r in _eager_reason(g))
    else:
        assert info(device)["nodes"][0]["conditionals"] == [
            {"kind": "cond", "form": "program-branch"}
        ]


def test_while_loop_whose_trip_count_changes_per_call():
    device = "cpu"  # the loop counter is a CPU tensor (the device case: the test below)

    def f(x, n):
        def cond_fn(i, y):
            return i < n

        def body_fn(i, y):
            return i + 1, y * 2 + 1

        return torch.while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.long), x))

    x = torch.randn(8, device=device)
    trips = [0, 1, 5, 3, 0, 7, 1, 2]
    calls = [(x, torch.tensor(n)) for n in trips]
    _, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["while_loop"])


def test_while_loop_on_the_device_runs_eagerly_there_or_replays_on_cpu(device):
    def f(x):
        def cond_fn(y):
            return y.sum() < 100

        def body_fn(y):
            return (y * 2 + 1,)

        return torch.while_loop(cond_fn, body_fn, (x,))

    calls = [(torch.full((4,), v, device=device),) for v in (0.0, 30.0, 1.0, 200.0, 0.5, 5.0)]
    g, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["while_loop"])
    if device != "cpu":
        assert any("torch.while_loop" in r for r in _eager_reason(g))


def test_nested_cond_and_a_cond_inside_a_while_body():
    device = "cpu"

    def inner(t):
        return torch.cond(t.mean() > 0.5, lambda u: u * 3, lambda u: u - 3, (t,))

    def f(x):
        y = torch.cond(x.sum() > 0, lambda t: inner(t) + 1, lambda t: t.abs(), (x,))

        def body(z):
            return (torch.cond(z.max() > 10, lambda u: u + 1, lambda u: u * 2, (z,)),)

        (w,) = torch.while_loop(lambda z: z.sum() < 200, body, (y.abs() + 1,))
        return y, w

    calls = [(torch.full((4,), v),) for v in (1.0, -1.0, 0.1, 2.0, -3.0, 0.3)]
    _, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["cond", "while_loop", "cond", "cond"])


def test_branches_that_allocate_different_amounts(device):
    def big(t):
        tmp = torch.cat([t] * 64).reshape(64, -1)
        return (tmp * tmp).sum(0)

    def small(t):
        return t + 1

    def f(x):
        return torch.cond(x[0] > 0, big, small, (x,))

    x = torch.randn(32, device=device)
    calls = [((x.abs() if k % 3 else -x.abs()),) for k in range(7)]
    _, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["cond"])


def test_branches_returning_views(device):
    def f(x):
        # Views of what each branch made (torch wants one layout for both): one result address
        # whichever branch ran.
        return torch.cond(
            x.sum() > 0,
            lambda t: (t * 2).view(2, 4).t(),
            lambda t: (t + 1).view(2, 4).t(),
            (x,),
        )

    calls = [(torch.randn(8, device=device) + s,) for s in (3, -3, 3, -3, -3, 3)]
    _, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["cond"])

    def g(x):  # views of an input: torch refuses them eagerly, and so inside a graphed call
        return torch.cond(x.sum() > 0, lambda t: t[:4], lambda t: t[4:], (x,))

    def raised(fn, x):
        try:
            fn(x)
        except RuntimeError as e:  # its traceback holds the warmup's tensors: not kept
            return type(e)
        return None

    x = torch.randn(8, device=device)
    eager = raised(g, x)
    assert eager is not None and raised(cudagraphify(g), x) is eager
    gc.collect()


def test_random_draws_in_a_branch_match_eager():
    def f(x):
        return torch.cond(
            x.sum() > 0, lambda t: t + torch.rand_like(t), lambda t: t * torch.rand_like(t), (x,)
        )

    g = cudagraphify(f)
    x = torch.ones(8)
    for k in range(6):
        arg = x if k % 2 else -x
        mark_step_begin()
        torch.manual_seed(k)
        out = g(arg)
        torch.manual_seed(k)
        assert_close(out, f(arg))
    assert info("cpu")["num_program_replays"] > 0


def test_cond_under_torch_compile_records_and_replays():
    torch._dynamo.reset()

    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t.sin() + 1, lambda t: t.cos() - 1, (x,))

    compiled = torch.compile(f, backend="graphtrees")
    x = torch.randn(16).abs() + 0.1
    for k in range(6):
        mark_step_begin()
        arg = x if k % 2 else -x
        assert_close(compiled(arg), f(arg))
    t = info("cpu")
    assert t["num_replays"] > 0 and t["num_program_replays"] == t["num_replays"]
    assert any(n["conditionals"] for n in t["nodes"])


def test_cond_in_a_training_step_with_backward_under_torch_compile():
    torch._dynamo.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            return torch.cond(h.sum() > 0, lambda t: self.b(t).relu(), lambda t: t.tanh(), (h,))

    torch.manual_seed(0)
    model = Model()
    reference = Model()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphtrees")
    with torch.enable_grad():
        for k in range(6):
            x = torch.randn(4, 8) * (1 if k % 2 else -1) + (2 if k % 2 else -2)
            mark_step_begin()
            compiled(x).sum().backward()
            reference(x).sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                assert_close(p.grad, q.grad)
    t = info("cpu")
    assert t["num_replays"] > 0
    assert any(n["conditionals"] for n in t["nodes"])
