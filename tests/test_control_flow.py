"""torch.cond and torch.while_loop inside graphed calls (Note [Control flow in a recording] in
graphtrees/_control_flow.py): values against eager, on every device; on CPU the recording holds
control steps that its program replay runs from C++ with no Python (Note [Control steps of a
program] in csrc/cpu/OpProgram.h); on CUDA the recording holds conditional nodes that read the
predicate on the device (Note [Conditional nodes on CUDA] in csrc/cuda/ConditionalNodes.cpp), or,
where none can serve (a driver before CUDA 12.4, random numbers in a branch), a cond takes the
tree-branch form from the second call (Note [A wrapper's cond split into tree branches]) and a
while_loop runs eagerly with a reason that names the op. CI runs the CUDA cases with the
stand-in's driver at CUDA 13.0 and at 12.3 (CUDA_STANDIN_DRIVER_VERSION)."""

import gc
import re
import sys

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import STANDIN, assert_close, assert_invariants, cpu_replays, info

pytestmark = [
    pytest.mark.usefixtures("no_grad"),
    # On CUDA only: a cond's predicate is computed on the device; without the stand-in's values
    # a conditional node would take whatever branch its poisoned bytes say, and a loop not end.
    pytest.mark.needs_values("predicates computed on the device decide the branches and loops"),
]


def _conditional_nodes(device):
    """Whether a recording on `device` holds conditional nodes (CUDA, with a driver that has them;
    torch's capture or graphtrees' own, by the torch)."""
    return device != "cpu" and not graphtrees._C._cuda_conditional_unavailable()


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
    """Replays happened and ran no Python of the control flow: on CPU a program's control steps
    (Note [Control steps of a program]), on CUDA conditional nodes; where none can serve, the
    function ran eagerly (the reason is asserted by the caller)."""
    t = info(device)
    if device != "cpu" and not _conditional_nodes(device):
        # A driver without them (CUDA_STANDIN_DRIVER_VERSION=12030): a loop runs eagerly, a cond
        # takes the tree-branch form from the second call (its nodes hold no control flow).
        assert not [n for n in t["nodes"] if n["conditionals"]], t["nodes"]
        return
    assert replay_files, "no replay happened"
    for files in replay_files:
        assert not [f for f in files if "_higher_order_ops" in f or "_control_flow" in f], files
    nodes = [n for n in t["nodes"] if n["conditionals"]]
    assert nodes and all(n["kind"] == "conditional" for n in nodes)
    assert [c["kind"] for c in nodes[0]["conditionals"]] == kinds
    form = "conditional-node" if device != "cpu" else None
    for c in nodes[0]["conditionals"]:
        assert c["form"] == (form or ("program-branch" if c["kind"] == "cond" else "program-loop"))
    assert (form or "program-") in graphtrees.tree_to_dot(device)
    if device == "cpu":
        assert t["num_program_replays"] == t["num_replays"] > 0
        assert set(cpu_replays(device)) == {"program"}
    assert_invariants(device)


def _assert_eager_where_no_node_serves(device, g, op):
    if device != "cpu" and not _conditional_nodes(device):
        assert any(op in r and "conditional nodes" in r for r in _eager_reason(g)), g.signatures()


def _eager_reason(g):
    return [s["eager_reason"] for s in g.signatures() if s["eager_reason"]]


def test_cond_on_a_predicate_that_alternates_every_call(device):
    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() + 1, (x,))

    base = torch.randn(16, device=device).abs() + 0.1
    calls = [((base if k % 2 == 0 else -base) * (k + 1),) for k in range(8)]
    g, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["cond"])
    _assert_eager_where_no_node_serves(device, g, "torch.cond")
    if _conditional_nodes(device):
        assert info(device)["nodes"][0]["conditionals"] == [
            {"kind": "cond", "form": "conditional-node"}
        ]
    elif device == "cpu":
        assert info(device)["nodes"][0]["conditionals"] == [
            {"kind": "cond", "form": "program-branch"}
        ]


@pytest.mark.needs_cuda
@pytest.mark.skipif(STANDIN is None, reason="host syncs are counted by the CUDA stand-in")
def test_replays_of_conditional_nodes_make_no_host_sync():
    # Counted on the stand-in (a stand-in run, not a GPU run): no stream, event or device
    # synchronisation and no synchronous copy while a recording with a cond and a while_loop
    # replays; the bodies that ran are counted too.
    device = "cuda"
    if not _conditional_nodes(device):
        pytest.skip("no CUDA conditional nodes here (the driver): the function runs eagerly")

    def f(x):
        y = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))
        return torch.while_loop(lambda z: z.sum() < 64, lambda z: (z * 2 + 1,), (y.abs(),))[0]

    def trips(v):
        z = abs(v * 2 if v > 0 else v - 1)
        n = 0
        while 4 * z < 64:
            z, n = z * 2 + 1, n + 1
        return n

    g = cudagraphify(f)
    replayed = 0
    for k, v in enumerate((1.0, -1.0, 2.0, -0.5, 100.0, 0.25)):
        mark_step_begin()
        x = torch.full((4,), v, device=device)
        replays = info(device)["num_replays"]
        before = STANDIN.stats()
        out = g(x)
        after = STANDIN.stats()
        if info(device)["num_replays"] > replays:
            replayed += 1
            assert after["host_waits"] == before["host_waits"], k
            # One IF (or IF/ELSE) body, and one WHILE body per iteration (none for 100.0).
            assert after["conditional_runs"] - before["conditional_runs"] == 1 + trips(v), k
        assert_close(out, f(x))
    assert replayed >= 4


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


@pytest.mark.needs_values(
    "the loop's predicate is computed on the device: without the stand-in's values it never "
    "changes, and torch's own loop (the CUDA refusal runs it eagerly) never ends"
)
def test_while_loop_on_the_device_whose_trip_count_changes_per_call(device):
    def f(x):
        def cond_fn(y):
            return y.sum() < 100

        def body_fn(y):
            return (y * 2 + 1,)

        return torch.while_loop(cond_fn, body_fn, (x,))

    calls = [(torch.full((4,), v, device=device),) for v in (0.0, 30.0, 1.0, 200.0, 0.5, 5.0)]
    g, replays = _run_against_eager(device, f, calls)
    _assert_program_replays(device, replays, ["while_loop"])
    _assert_eager_where_no_node_serves(device, g, "torch.while_loop")


def test_nested_cond_and_a_cond_inside_a_while_body(device):
    def inner(t):
        return torch.cond(t.mean() > 0.5, lambda u: u * 3, lambda u: u - 3, (t,))

    def f(x):
        y = torch.cond(x.sum() > 0, lambda t: inner(t) + 1, lambda t: t.abs(), (x,))

        def body(z):
            return (torch.cond(z.max() > 10, lambda u: u + 1, lambda u: u * 2, (z,)),)

        (w,) = torch.while_loop(lambda z: z.sum() < 200, body, (y.abs() + 1,))
        return y, w

    calls = [(torch.full((4,), v, device=device),) for v in (1.0, -1.0, 0.1, 2.0, -3.0, 0.3)]
    g, replays = _run_against_eager(device, f, calls)
    # A CPU program lists its steps outermost first; CUDA lists nodes in the order captured.
    kinds = ["cond", "cond", "while_loop", "cond"] if device != "cpu" else None
    _assert_program_replays(device, replays, kinds or ["cond", "while_loop", "cond", "cond"])
    _assert_eager_where_no_node_serves(device, g, "torch.cond")


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

    # Views of an operand: torch.cond's dynamo wrapper refuses them, but the cond op called
    # directly reaches graphtrees' kernel with them, which gives the results buffers of their own.
    def g(x):
        return torch.ops.higher_order.cond(x.sum() > 0, lambda t: t[:4], lambda t: t[4:], (x,))

    calls = [(torch.randn(8, device=device) + s,) for s in (3, -3, 3, -3, -3, 3)]
    _run_against_eager(device, g, calls)
    gc.collect()


def _against_eager(f, calls, **options):
    """f graphed and eagerly on copies of each call's arguments, a step each: results (and the
    arguments after the call) equal. Returns the graphed function."""
    g = cudagraphify(f, **options)
    for args in calls:
        mark_step_begin()
        copies = [a.clone() for a in args]
        out = g(*args)
        out = [o.clone() for o in (out if isinstance(out, (tuple, list)) else (out,))]
        expected = f(*copies)
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        assert len(out) == len(expected)
        for a, b in zip(out, expected):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(a, b), (a, b)
        for a, b in zip(args, copies):
            assert torch.equal(a, b)
    return g


def _signs(n):
    return [1, 1, -1, 1, -1, -1, 1, -1][:n]


_TORCH_REFUSES_ALIASING_AND_MUTATION = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12),
    reason="torch < 2.12 refuses branches whose results alias each other or that write in place "
    "itself, when it traces torch.cond (UncapturedHigherOrderOpError): graphtrees never sees them",
)


@_TORCH_REFUSES_ALIASING_AND_MUTATION
def test_true_branch_returning_one_tensor_twice_or_overlapping_views(device):
    # Review of issue 48, W1: results sharing memory get buffers of their own (overlapping views
    # at different offsets: torch refuses them eagerly).
    def twice(x):
        def t(u):
            y = u * 2
            return y, y

        return torch.cond(x.sum() > 0, t, lambda u: (u - 1, u + 5), (x,))

    def with_view(x):
        def t(u):
            y = u * 2
            return y, y.view(2, 4)

        return torch.cond(x.sum() > 0, t, lambda u: (u - 1, (u + 5).view(2, 4)), (x,))

    b = torch.rand(8, device=device) + 0.1
    for f in (twice, with_view):
        _against_eager(f, [(b * s * (k + 1),) for k, s in enumerate(_signs(8))])
    _against_eager(twice, [(b * s,) for s in _signs(6)], cpu_replay="python")


def test_branches_of_different_shapes_dtypes_or_strides_refuse(device):
    # W2, C3: whatever the predicate at the recording, one set of buffers cannot hold both.
    # (torch.cond's dynamo wrapper refuses some of these eagerly; the op itself reaches the kernel.)
    cond = torch.ops.higher_order.cond
    cases = [
        lambda x: cond(x.sum() > 0, lambda u: u * 2, lambda u: u.sum().reshape(1), (x,)),
        lambda x: cond(x.sum() > 0, lambda u: u[:2] * 1, lambda u: u * 3, (x,)),
        lambda x: cond(x.sum() > 0, lambda u: u * 2, lambda u: (u + 1).double(), (x,)),
        lambda x: cond(
            x.sum() > 0,
            lambda u: (u * 2).view(2, 2).t().contiguous().t(),
            lambda u: (u + 1).view(2, 2),
            (x,),
        ),
        lambda x: cond(
            x.sum() > 0, lambda u: u.sum().expand(4), lambda u: u.mean().expand(4), (x,)
        ),
    ]
    for f in cases:
        g = _against_eager(f, [(torch.arange(1.0, 5.0, device=device) * s,) for s in _signs(6)])
        assert _eager_reason(g), "the recording was not refused"
        # Without conditional nodes the cond's refusal is the driver's, and the tree-branch form
        # (values compared above) runs whatever dynamo accepts.
        assert info(device)["num_replays"] == 0 or not _conditional_nodes(device)


def test_cond_returning_a_python_number_refuses():
    def f(x):
        return torch.cond(x.sum() > 0, lambda u: (u * 2, 1), lambda u: (u + 1, 2), (x,))

    g = cudagraphify(f)
    for s in _signs(4):
        mark_step_begin()
        x = torch.ones(4) * s
        out, expected = g(x), f(x)
        assert torch.equal(out[0], expected[0]) and out[1] == expected[1]
    assert _eager_reason(g)


@_TORCH_REFUSES_ALIASING_AND_MUTATION
def test_writes_in_place_in_a_branch_or_loop_body_refuse(device):
    # W3: an arm that writes an input, a buffer or a closed-over tensor runs with torch's kernel.
    buf = torch.ones(4, device=device)
    ref = torch.ones(4, device=device)

    def closure(x, target):
        def e(u):
            target.mul_(2)
            return u - 1

        return torch.cond(x.sum() > 0, lambda u: u * 2, e, (x,))

    g = cudagraphify(lambda x: closure(x, buf))
    for s in _signs(8):
        mark_step_begin()
        x = torch.ones(4, device=device) * s
        assert torch.equal(g(x), closure(x, ref)) and torch.equal(buf, ref)
    assert any(
        ("in place" if device == "cpu" or _conditional_nodes(device) else "torch.cond") in r
        for r in _eager_reason(g)
    )

    def writes_input(x, p):
        def t(u, q):
            u.add_(10)
            return q * 2

        return torch.cond(p.sum() > 0, t, lambda u, q: q - 1, (x, p))

    g = cudagraphify(writes_input)
    for s in _signs(6):
        p = torch.ones(3, device=device) * s
        x_g, x_e = torch.zeros(3, device=device), torch.zeros(3, device=device)
        mark_step_begin()
        assert torch.equal(g(x_g, p), writes_input(x_e, p)) and torch.equal(x_g, x_e)

    def loop(x, steps):
        def body(y):
            steps.add_(1)
            return (y * 2,)

        return torch.while_loop(lambda y: y.sum() < 50, body, (x,))[0]

    steps_g, steps_e = torch.zeros((), device=device), torch.zeros((), device=device)
    g = cudagraphify(lambda x: loop(x, steps_g))
    for v in (1.0, 100.0, 3.0, 60.0, 100.0):
        mark_step_begin()
        x = torch.full((2,), v, device=device)
        assert torch.equal(g(x), loop(x, steps_e)) and torch.equal(steps_g, steps_e)
    assert _eager_reason(g)  # torch passes the loop's written tensors on: refused as such


def test_untaken_branch_that_raises_or_never_ends():
    # C2: the untaken branch runs on values no eager call gives it.
    table = torch.arange(10.0)

    def fa(i):
        return torch.cond(
            i < 10,
            lambda j: torch.index_select(table, 0, j.reshape(1)) * 2,
            lambda j: torch.zeros(1),
            (i,),
        )

    g = cudagraphify(fa)
    for i in (3, 12, 5, 12):
        mark_step_begin()
        assert torch.equal(g(torch.tensor(i)), fa(torch.tensor(i)))

    def fb(x):  # iterates only when |x| < 1: for 3.0 the loop would never end
        def t(u):
            return torch.while_loop(lambda y: y.abs().max() > 1e-6, lambda y: (y * y,), (u,))[0]

        return torch.cond(x.abs().max() < 1, t, lambda u: u.clone(), (x,))

    g = cudagraphify(fb)
    for v in (3.0, 0.5, 3.0, 3.0, 0.5):
        mark_step_begin()
        x = torch.full((2,), v)
        assert torch.equal(g(x), fb(x))


def test_random_draws_in_a_branch_match_eager(device):
    # The CPU program replays them; a CUDA conditional node cannot hold random numbers (torch
    # refuses them in a conditional body): there the warmup sees the draws and refuses.
    def f(x):
        return torch.cond(
            x.sum() > 0, lambda t: t + torch.rand_like(t), lambda t: t * torch.rand_like(t), (x,)
        )

    g = cudagraphify(f)
    x = torch.ones(8, device=device)
    for k in range(6):
        arg = x if k % 2 else -x
        mark_step_begin()
        torch.manual_seed(k)
        out = g(arg)
        torch.manual_seed(k)
        assert_close(out, f(arg))
    if device == "cpu":
        assert info("cpu")["num_program_replays"] > 0
        assert g._delegate is None
    else:
        # The first call ran eagerly for its reason; the later ones took the tree-branch form
        # (Note [A wrapper's cond split into tree branches]): each branch, with its draws, is a
        # tree node of its own.
        word = "random numbers" if _conditional_nodes(device) else "conditional nodes"
        assert any(word in r for r in _eager_reason(g)), _eager_reason(g)
        assert g._delegate is not None
        names = [n["function"] for n in info(device)["nodes"]]
        assert any(n.endswith(".cond1.true") for n in names), names
        assert any(n.endswith(".cond1.false") for n in names), names
        assert info(device)["num_replays"] > 0


def test_cond_under_torch_compile_records_and_replays(device):
    torch._dynamo.reset()

    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t.sin() + 1, lambda t: t.cos() - 1, (x,))

    compiled = torch.compile(f, backend="graphtrees")
    x = torch.randn(16, device=device).abs() + 0.1
    for k in range(6):
        mark_step_begin()
        arg = x if k % 2 else -x
        assert_close(compiled(arg), f(arg))
    t = info(device)
    if device != "cpu" and not _conditional_nodes(device):
        assert t["num_replays"] == 0
        return
    assert t["num_replays"] > 0
    if device == "cpu":
        assert t["num_program_replays"] == t["num_replays"]
    assert any(n["conditionals"] for n in t["nodes"])


def test_cond_in_a_training_step_with_backward_under_torch_compile(device):
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
    model = Model().to(device)
    reference = Model().to(device)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphtrees")
    with torch.enable_grad():
        for k in range(6):
            x = torch.randn(4, 8, device=device) * (1 if k % 2 else -1) + (2 if k % 2 else -2)
            mark_step_begin()
            compiled(x).sum().backward()
            reference(x).sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                assert_close(p.grad, q.grad)
    t = info(device)
    if device != "cpu" and not _conditional_nodes(device):
        assert t["num_replays"] == 0
        return
    assert t["num_replays"] > 0
    assert any(n["conditionals"] for n in t["nodes"])


@pytest.mark.needs_values("the replays' values are compared with eager's, on the device")
def test_while_loop_with_a_cpu_counter_in_the_devices_recording(device):
    # W4: the recording's backend decides, not the first tensor's device: on CUDA a loop whose
    # counter is a CPU tensor must not have its trip count baked into the graph.
    limit = torch.tensor(2)

    def f(x):
        return torch.while_loop(
            lambda i, y: i < limit,
            lambda i, y: (i + 1, y * 2 + 1),
            (torch.zeros((), dtype=torch.long), x),
        )[1]

    g = cudagraphify(f)
    x = torch.zeros(4, device=device)
    for n in (2, 2, 2, 0, 5, 1, 3):
        limit.fill_(n)
        mark_step_begin()
        assert torch.equal(g(x).cpu(), f(x).cpu())
    if device != "cpu":
        assert any("torch.while_loop" in r for r in _eager_reason(g))
        assert info(device)["num_replays"] == 0


def test_first_cond_of_a_process_replayed_in_python(tmp_path):
    # C1: dynamo must not compile graphtrees' profile hook while torch.cond compiles its wrapper
    # inside a recording (the Python replay then diverged). A fresh process: the first cond.
    import subprocess

    script = tmp_path / "first_cond.py"
    script.write_text(
        "import torch, graphtrees\n"
        "torch.set_grad_enabled(False)\n"
        "f = lambda x: torch.cond(x.sum() > 0, lambda u: u * 2, lambda u: u + 1, (x,))\n"
        "g = graphtrees.cudagraphify(f, cpu_replay='python')\n"
        "b = torch.rand(2, 4) + .1\n"
        "for k in range(6):\n"
        "    graphtrees.mark_step_begin()\n"
        "    x = b if k % 2 else -b\n"
        "    assert torch.equal(g(x), f(x)), k\n"
        "assert graphtrees.tree_info('cpu')['num_replays'] > 0\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_cond_first_reached_inside_the_recording_refuses_without_blaming_the_user():
    # M1: torch.cond's wrapper compiled by dynamo during the capture (not in the warmup).
    calls = [0]

    def f(x):
        calls[0] += 1
        if calls[0] % 2 == 0:  # the warmup takes the other path; the capture reaches the cond
            return torch.cond(x.sum() > 0, lambda u: u * 2, lambda u: u - 100, (x,))
        return torch.where(x.sum() > 0, x * 2, x - 100)

    g = cudagraphify(f)
    for s in (1, -1, 1, -1, 1, -1):
        x = torch.ones(3) * s
        mark_step_begin()
        assert torch.equal(g(x), torch.where(x.sum() > 0, x * 2, x - 100))
    assert not any("Generator" in r for r in _eager_reason(g))


def test_graphs_holding_a_cond_keep_inductor_only_where_graphtrees_cannot_record_it(device):
    # M2: the CPU backend records a cond, and CUDA where conditional nodes serve; elsewhere the
    # cond refuses the recording anyway, and Inductor stays.
    from graphtrees._dynamo_backend import _records_control_flow

    assert _records_control_flow([torch.ones(2), 3])
    assert not _records_control_flow([torch.ones(2), torch.ones(2, device="meta")])
    on_device = [torch.ones(2, device=device), 3]
    assert _records_control_flow(on_device) == (device == "cpu" or _conditional_nodes(device))


# Review of issue 48's conditional nodes: what a recording must refuse, or get right.


def test_cpu_operands_or_loop_counters_in_a_device_recording_refuse(device):
    # A CPU operand (or carried counter) beside a device predicate: on CUDA its work would run
    # once, at the capture, and be baked in; on the CPU backend the program replays it.
    scale = torch.tensor(3.0)

    def f(x):
        s = torch.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, (scale,))
        return x * s.to(x.device)

    def h(x):
        def body(i, z):
            return i + 1, z * 2

        return torch.while_loop(lambda i, z: z.sum() < 40, body, (torch.tensor(0), x.abs() + 1))[1]

    for fn, op in ((f, "torch.cond"), (h, "torch.while_loop")):
        g = cudagraphify(fn)
        for v in (1.0, -1.0, 2.0, -3.0, 4.0, 0.5):
            mark_step_begin()
            x = torch.full((4,), v, device=device)
            assert_close(g(x), fn(x))
        if _conditional_nodes(device):  # else the driver's reason comes first
            assert any(op in r and "not on the CUDA device" in r for r in _eager_reason(g))


@pytest.mark.parametrize("case", ["closure", "swap", "view"])
def test_results_that_share_memory_with_what_the_arm_did_not_make(device, case):
    # The false branch's results are copied into the true branch's: never into a tensor the true
    # branch merely returned. A loop body's results are copied into the carried buffers in turn:
    # a result that is another carried buffer (swapped) or a view of one is copied first.
    cond = torch.ops.higher_order.cond
    loop = torch.ops.higher_order.while_loop

    def closure(x):
        z = x * 2
        return cond(x.sum() > 0, lambda t: z, lambda t: t + 100, (x,)), z

    def swap(x):
        i0 = torch.zeros((), dtype=torch.long, device=x.device)
        return loop(lambda i, a, b: i < 1, lambda i, a, b: (i + 1, b, a), (i0, x, x * 10), ())

    def view(x):
        i0 = torch.zeros((), dtype=torch.long, device=x.device)
        return loop(lambda i, m: i < 3, lambda i, m: (i + 1, m.t()), (i0, x.view(2, 2)), ())

    fn = {"closure": closure, "swap": swap, "view": view}[case]
    g = cudagraphify(fn)
    for v in (1.0, -1.0, 2.0, -3.0, 4.0, -5.0):
        mark_step_begin()
        x = torch.arange(4.0, device=device) + v
        out = [o.clone() for o in g(x)]
        assert_close(out, list(fn(x.clone())))


def test_an_arm_that_reads_the_host_refuses_and_leaves_the_process_usable(device):
    # .item() in an arm: a conditional body cannot hold it. Seen in the warmup on CUDA (the
    # reason names the read), rejected as any host read on the CPU backend.
    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t * t.max().item(), lambda t: t - 1, (x,))

    g = cudagraphify(f)
    for v in (1.0, -1.0, 2.0, -3.0):
        mark_step_begin()
        x = torch.full((4,), v, device=device)
        assert_close(g(x), f(x))
    # Without conditional nodes the driver's reason comes first, and torch.compile cannot trace
    # the read for the tree-branch form: the calls stay eager (logged).
    assert info(device)["num_replays"] == 0
    word = "item" if device == "cpu" or _conditional_nodes(device) else "conditional nodes"
    assert any(word in r for r in _eager_reason(g)), _eager_reason(g)
    assert_close(torch.ones(2, device=device) + 1, torch.full((2,), 2.0, device=device))
    assert not (device != "cpu" and torch.cuda.is_current_stream_capturing())


def test_random_numbers_in_a_loops_cond_fn_refuse_on_the_device(device):
    def f(x):
        def cond_fn(z):
            return (z.sum() + torch.rand((), device=z.device) * 0) < 40

        return torch.while_loop(cond_fn, lambda z: (z * 2,), (x,))[0]

    g = cudagraphify(f)
    for v in (1.0, 3.0, 0.5, 2.0):
        mark_step_begin()
        x = torch.full((4,), v, device=device)
        assert_close(g(x), f(x))
    if _conditional_nodes(device):
        assert any("random numbers" in r for r in _eager_reason(g)), _eager_reason(g)


@pytest.mark.needs_cuda
def test_freeing_a_tree_with_conditional_nodes_frees_its_pool():
    # torch 2.14's conditional-node capture keeps two pool references per body that its graph's
    # reset does not give back: graphtrees gives them back, or the pool would never be freed.
    device = "cuda"

    def f(x):
        y = torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))
        return torch.while_loop(lambda z: z.sum() < 64, lambda z: (z * 2 + 1,), (y.abs(),))[0]

    graphtrees.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_reserved()
    for _ in range(2):
        g = cudagraphify(f)
        for v in (1.0, -1.0, 2.0):
            mark_step_begin()
            g(torch.full((4,), v, device=device))
        assert info(device)["num_replays"] > 0 or not _conditional_nodes(device)
        del g
        graphtrees.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == baseline


# The tree-branch form (Note [Tree branches] in graphtrees/_piecewise.py).


def _tree_branch_backend(**options):
    return graphtrees.make_backend(inner="aot_eager", cond_form="tree-branch", **options)


def _wide(t):
    tmp = torch.cat([t] * 64).reshape(64, -1)
    return (tmp * tmp).sum(0) * 2 + 1


def _narrow(t):
    tmp = torch.cat([t] * 64).reshape(64, -1)
    return (tmp + tmp).mean(0) - 1


def _assert_sibling_branches_share_the_pool(device, reserved):
    """The branches of the tree-branch form (`_wide`, `_narrow` on 1 << 16 elements: each needs
    more than 16 MiB) were both replayed, are siblings under the piece before, and the second
    reused the first one's memory through the checkpoint: the pool holds the larger branch's,
    not the sum of both, and nothing grew once both were recorded (`reserved`: the pool's
    reserved bytes after each of 6 calls). Returns the two nodes."""
    nodes = {n["function"]: n for n in info(device)["nodes"]}
    true = next(n for name, n in nodes.items() if name.endswith(".cond1.true"))
    false = next(n for name, n in nodes.items() if name.endswith(".cond1.false"))
    assert true["parent"] == false["parent"] is not None  # siblings under the piece before
    assert true["replays"] > 0 and false["replays"] > 0
    assert min(true["pool_bytes"], false["pool_bytes"]) > 16 << 20
    both = true["pool_bytes"] + false["pool_bytes"]
    assert max(true["pool_bytes"], false["pool_bytes"]) <= reserved[-1] < both, (reserved, both)
    assert reserved[-1] == reserved[3]
    assert_invariants(device)
    return true, false


def test_tree_branch_form_records_each_branch_as_a_sibling_in_one_pool(device):
    torch._dynamo.reset()
    width = 1 << 16  # each branch's intermediates: 64 x 256 KiB = 16 MiB, well past a segment

    def f(x):
        y = x * 2 + 1
        z = torch.cond(y.sum() > 0, _wide, _narrow, (y,))
        return z.relu() + 1

    compiled = torch.compile(f, backend=_tree_branch_backend())
    x = torch.rand(width, device=device) + 0.1
    reserved = []
    for k in range(6):
        mark_step_begin()
        arg = x if k % 2 == 0 else -x
        assert_close(compiled(arg), f(arg))
        reserved.append(info(device)["pool"]["reserved_bytes"])
    _assert_sibling_branches_share_the_pool(device, reserved)


def test_tree_branch_form_in_a_training_step_with_backward(device):
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
    model = Model().to(device)
    reference = Model().to(device)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=_tree_branch_backend())
    with torch.enable_grad():
        for k in range(6):
            x = torch.randn(4, 8, device=device) * (1 if k % 2 else -1) + (2 if k % 2 else -2)
            mark_step_begin()
            compiled(x).sum().backward()
            reference(x).sum().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                assert_close(p.grad, q.grad)
    names = [n["function"] for n in info(device)["nodes"]]
    for part in ("forward", "backward"):
        for which in ("true", "false"):
            assert any(part in n and n.endswith(f".cond1.{which}") for n in names), names
    assert info(device)["num_replays"] > 0


@pytest.mark.needs_cuda
def test_a_branch_that_draws_random_numbers_takes_the_tree_branch_form_on_cuda():
    # A conditional node cannot hold random numbers: under torch.compile such a cond is split out
    # and its branches recorded as tree nodes (rand_like(t) * 0 draws without changing a value).
    device = "cuda"
    torch._dynamo.reset()

    def f(x):
        return (
            torch.cond(
                x.sum() > 0,
                lambda t: t * 2 + torch.rand_like(t) * 0,
                lambda t: t - 1,
                (x * 1.5,),
            )
            + 1
        )

    compiled = torch.compile(f, backend=graphtrees.make_backend(inner="aot_eager"))
    for k in range(6):
        mark_step_begin()
        x = torch.full((8,), 1.0 if k % 2 == 0 else -1.0, device=device) * (k + 1)
        assert_close(compiled(x), f(x))
    names = [n["function"] for n in info(device)["nodes"]]
    assert any(n.endswith(".cond1.true") for n in names), names
    assert any(n.endswith(".cond1.false") for n in names), names
    assert info(device)["num_replays"] > 0


def test_cond_form_is_checked_and_shown():
    with pytest.raises(
        ValueError, match="cond_form must be 'auto' or 'tree-branch', got 'branches'"
    ):
        graphtrees.make_backend(cond_form="branches")
    with pytest.raises(ValueError, match="cond_form must be 'auto' or 'tree-branch', got 3"):
        cudagraphify(torch.sin, cond_form=3)
    with pytest.raises(ValueError, match="cond_form"):
        cudagraphify(cond_form="branches")(torch.sin)
    assert cudagraphify(torch.sin).options["cond_form"] == "auto"
    assert cudagraphify(torch.sin, cond_form="tree-branch").options["cond_form"] == "tree-branch"
    with pytest.raises(ValueError, match="buckets"):
        cudagraphify(torch.sin, cond_form="tree-branch", buckets=[1, 2])
    with pytest.raises(ValueError, match="cpu_replay"):
        cudagraphify(torch.sin, cond_form="tree-branch", cpu_replay="python")
    with pytest.raises(TypeError, match="name"):
        graphtrees.make_backend(name=3)


def test_a_function_recorded_whole_takes_the_tree_branch_form_when_asked(device):
    # Note [A wrapper's cond split into tree branches] (csrc/ThreadState.h): cudagraphify's
    # function is traced by torch.compile and split at the cond; the piece before it uses its
    # static argument in place; the branches are siblings whose memory the pool shares.
    torch._dynamo.reset()
    width = 1 << 16  # each branch's intermediates: 64 x 256 KiB = 16 MiB

    def f(x, w):
        y = x * w + 1
        z = torch.cond(y.sum() > 0, _wide, _narrow, (y,))
        return z.relu() + 1

    g = cudagraphify(f, cond_form="tree-branch", static_argnums=(1,))
    x = torch.rand(width, device=device) + 0.1
    w = torch.rand(width, device=device) + 0.5
    reserved = []
    for k in range(6):
        mark_step_begin()
        arg = x if k % 2 == 0 else -x - 2
        assert_close(g(arg, w), f(arg, w))
        reserved.append(info(device)["pool"]["reserved_bytes"])
    true, false = _assert_sibling_branches_share_the_pool(device, reserved)
    nodes = {n["function"]: n for n in info(device)["nodes"]}
    before = next(
        n for name, n in nodes.items() if re.search(r"f\.graph\d+\.inference\[1/2\]$", name)
    )
    assert before["input_kinds"].count("S") == 1, before  # w, in place
    assert true["parent"] == false["parent"] == before["id"]
    assert g.signatures() == []  # every call went to the split form


def test_the_tree_branch_form_of_a_function_has_no_bound_on_shapes_and_names_dynamos_reason():
    # cudagraphify's max_recorded_shapes (no bound by default, 0 too) holds in the split form; a
    # function dynamo cannot trace (a host read in a branch) is an error naming what dynamo said.
    torch._dynamo.reset()

    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x * 1.5,)) + 1

    for bound in ({}, {"max_recorded_shapes": 0}):
        g = cudagraphify(f, cond_form="tree-branch", **bound)
        for _ in range(3):
            for n in range(1, 11):
                mark_step_begin()
                x = torch.arange(float(n)) - n / 3
                assert_close(g(x), f(x))
        assert info("cpu")["num_evictions"] == 0
        graphtrees.reset()
        torch._dynamo.reset()

    def reads(x):
        return torch.cond(x.sum() > 0, lambda t: t * t.max().item(), lambda t: t - 1, (x,))

    g = cudagraphify(reads, cond_form="tree-branch")
    with pytest.raises(RuntimeError, match="cond_form='tree-branch'.*item"):
        g(torch.ones(4))


@pytest.mark.needs_cuda
def test_a_function_dynamo_cannot_trace_whole_runs_each_call_once_eagerly():
    # Unasked, the split form needs the function as one graph: a graph break fails its tracing
    # before any of the call has run, and the wrapper runs the call eagerly (not twice).
    torch._dynamo.reset()
    calls = []

    def f(x):
        calls.append(1)
        x.add_(1)
        torch._dynamo.graph_break()
        return torch.cond(x.sum() > 0, lambda t: t + torch.rand_like(t) * 0, lambda t: t - 1, (x,))

    g = cudagraphify(f)
    x, y = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    for k in range(4):
        mark_step_begin()
        out = g(x)
        expected = f(y)
        assert len(calls) == 2 * (k + 1)
        assert_close(x, y)
        assert_close(out, expected)
    assert g._delegate is None
    assert info("cuda")["num_replays"] == 0


@pytest.mark.needs_cuda
def test_a_random_branch_keeps_a_bucketed_function_eager_with_the_reason(caplog):
    # The tree-branch form cannot take buckets: the function stays eager, and the log says why.
    def f(x):
        return torch.cond(x.sum() > 0, lambda t: t + torch.rand_like(t), lambda t: t - 1, (x,))

    g = cudagraphify(f, buckets=[4, 8])
    with caplog.at_level("WARNING", logger="graphtrees"):
        for k in range(4):
            mark_step_begin()
            g(torch.full((4,), 1.0 if k % 2 else -1.0, device="cuda"))
    assert g._delegate is None
    assert info("cuda")["num_replays"] == 0
    assert "cannot take buckets" in caplog.text


@pytest.mark.needs_cuda
@pytest.mark.skipif(STANDIN is None, reason="a driver's version is the CUDA stand-in's to set")
def test_a_driver_without_conditional_nodes_splits_conds_and_runs_loops_eagerly(tmp_path):
    # CUDA 12.3 (CUDA_STANDIN_DRIVER_VERSION): no conditional node serves, so a function's cond
    # takes the tree-branch form from its second call, under cudagraphify as under torch.compile;
    # a while_loop has no such form and runs eagerly with the reason.
    import os
    import subprocess

    script = tmp_path / "old_driver.py"
    script.write_text(
        "import torch, graphtrees\n"
        "torch.set_grad_enabled(False)\n"
        "why = graphtrees._C._cuda_conditional_unavailable()\n"
        "assert '12.3' in why, why\n"
        "def f(x):\n"
        "    y = x * 2 + 1\n"
        "    z = torch.cond(y.sum() > 0, lambda t: (t * t).sin() + 1, lambda t: t.cos() - t, "
        "(y,))\n"
        "    return z * 3 + 1\n"
        "def loop(x):\n"
        "    return torch.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a * 2), "
        "(torch.zeros((), dtype=torch.long, device=x.device), x))[1]\n"
        "g, h = graphtrees.cudagraphify(f), graphtrees.cudagraphify(loop)\n"
        "c = torch.compile(f, backend=graphtrees.make_backend(inner='aot_eager'))\n"
        "x = torch.arange(8.0, device='cuda')\n"
        "for k in range(6):\n"
        "    graphtrees.mark_step_begin()\n"
        "    a = x if k % 2 else -x - 1\n"
        "    torch.testing.assert_close(g(a), f(a))\n"
        "    torch.testing.assert_close(c(a), f(a))\n"
        "    torch.testing.assert_close(h(a), loop(a))\n"
        "names = [n['function'] for n in graphtrees.tree_info('cuda')['nodes']]\n"
        "for who in ('f.graph', 'graph'):\n"
        "    for arm in ('true', 'false'):\n"
        "        end = '.cond1.' + arm\n"
        "        assert any(n.startswith(who) and n.endswith(end) for n in names), names\n"
        "assert g._delegate is not None and h._delegate is None\n"
        "reasons = [s['eager_reason'] or '' for s in g.signatures()]\n"
        "assert any('conditional nodes' in r for r in reasons), reasons\n"
        "assert any('torch.while_loop' in (s['eager_reason'] or '') for s in h.signatures())\n"
        "assert not any('loop' in n for n in names), names\n"
        "assert graphtrees.tree_info('cuda')['num_replays'] > 0\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CUDA_STANDIN_DRIVER_VERSION="12030")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# Review of issue 48 (second round): arms the recording's inputs do not take, a user's generator
# in an untaken arm, verify=True, predicates torch accepts, and the tree-branch form's inputs.


def test_an_untaken_arm_whose_work_bypasses_the_dispatcher_fails_the_proof():
    # Note [Arms a recording did not run]: torch.tensor([...]) is filled by Python, not by an op.
    # Recorded while the other arm (or no trip of the loop) is taken, its program would replay it
    # unproven: the proof runs it too, and the node keeps the Python replay.
    def f(x):
        return torch.cond(
            x.sum() > 0, lambda t: t + 1, lambda t: t * torch.tensor([5.0, 6.0] * 8), (x,)
        )

    def h(x, n):
        def body(i, t):
            return i + 1, t * torch.tensor([2.0, 3.0] * 8) + 1

        return torch.while_loop(lambda i, t: i < n, body, (torch.zeros((), dtype=torch.long), x))

    x = torch.arange(16.0) + 1
    g = _against_eager(f, [(x,), (x,), (x * 2,), (-x,), (-x * 2,), (x,), (-x,)])
    assert cpu_replays("cpu") == ["python"], cpu_replays("cpu")
    assert info("cpu")["nodes"][0]["conditionals"] == [{"kind": "cond", "form": "python-replay"}]
    graphtrees.reset()
    n = [torch.tensor(k) for k in (0, 0, 0, 2, 3, 1)]
    _against_eager(h, [(x, k) for k in n])
    assert cpu_replays("cpu") == ["python"], cpu_replays("cpu")
    del g


def test_the_proof_runs_untaken_arms_as_the_recording_did():
    # A loop inside the untaken branch runs once at most, as when recorded (on these values it
    # would never end); a user's generator drawn from in the untaken branch is held in the proof
    # too, so that the program still proves and replays.
    def f(x):
        s = x.sum()

        def loop(t):
            i0 = torch.zeros(())
            return torch.while_loop(lambda i, a: i < 10, lambda i, a: (i + s, a + 1), (i0, t))[1]

        return torch.cond(s > 0, loop, lambda t: t - 1, (x,))

    x = torch.ones(4)
    _against_eager(f, [(x * s,) for s in (-1, -1, -1, 1, 1, -1)])
    assert cpu_replays("cpu") == ["program"], cpu_replays("cpu")
    graphtrees.reset()
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    cond = torch.ops.higher_order.cond

    def make(gen):  # the raw op: dynamo cannot trace a closure over a generator
        def h(x):
            noisy = lambda t: (t + torch.rand(t.shape, generator=gen),)  # noqa: E731
            taken = cond(x.sum() > 0, noisy, lambda t: (t - 1,), (x,))[0]
            return taken * torch.rand(4, generator=gen)

        return h

    g, h = cudagraphify(make(gens[0])), make(gens[1])
    for s in (-1, -1, -1, 1, 1, -1, 1):
        mark_step_begin()
        assert torch.equal(g(x * s), h(x * s))
    assert cpu_replays("cpu") == ["program"], cpu_replays("cpu")
    assert torch.equal(gens[0].get_state(), gens[1].get_state())


def test_an_untaken_arm_drawing_from_a_users_generator_does_not_advance_it(device):
    # The raw op takes plain callables: the arm reaches a torch.Generator of the user's through
    # its closure. Eager never draws from it on calls taking the other arm; nor may the warmup.
    cond = torch.ops.higher_order.cond
    gens = [torch.Generator(device=device).manual_seed(0) for _ in range(2)]

    def make(gen):
        def f(x):
            noisy = lambda t: (t + torch.rand(t.shape, generator=gen, device=t.device),)  # noqa
            return cond(x.sum() > 0, noisy, lambda t: (t - 1,), (x,))[0]

        return f

    g, f = cudagraphify(make(gens[0])), make(gens[1])
    x = torch.ones(4, device=device)
    for s in (-1, -1, -1, 1, 1, -1, 1):
        mark_step_begin()
        assert_close(g(x * s).clone(), f(x * s))
    assert_close(gens[0].get_state(), gens[1].get_state())
    if _conditional_nodes(device):  # a conditional body cannot hold the draws: seen in the warmup
        assert any("random numbers" in r for r in _eager_reason(g)), _eager_reason(g)


def test_verify_checks_replays_of_recordings_holding_control_flow(device):
    # verify=True runs a signature's first call under a dispatch mode: torch.cond and
    # torch.while_loop pass through it (and dynamo, compiling their wrappers, leaves it be).
    def f(x):
        y = torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() - 1, (x,))
        i0 = torch.zeros((), dtype=torch.long, device=x.device)
        return torch.while_loop(lambda i, z: i < 3, lambda i, z: (i + 1, z * 1.5), (i0, y))[1]

    g = cudagraphify(f, verify=True)
    x = torch.arange(1.0, 9.0, device=device)
    for s in _signs(7):
        mark_step_begin()
        assert_close(g(x * s), f(x * s))
    assert not _eager_reason(g) or not (device == "cpu" or _conditional_nodes(device))
    assert info(device)["num_replays"] > 0 or not (device == "cpu" or _conditional_nodes(device))


@pytest.mark.needs_cuda
def test_a_predicate_a_conditional_node_cannot_read_is_named_with_its_dtype_and_shape():
    # torch.cond takes a one-element tensor of any dtype; a CUDA conditional node's kernel reads
    # a boolean scalar. The call runs eagerly, and the reason says what the predicate was.
    for make, said in (
        (lambda x: x.sum(0, keepdim=True) > 0, "torch.bool and shape [1]"),
        (lambda x: (x.sum() > 0).long(), "torch.int64 and shape []"),
    ):
        graphtrees.reset()

        def f(x, make=make):
            return torch.cond(make(x), lambda t: t * 2, lambda t: t - 1, (x,))

        g = cudagraphify(f)
        for s in (1.0, -1.0, 1.0, -1.0):
            mark_step_begin()
            x = torch.full((4,), s, device="cuda")
            assert_close(g(x), f(x))
        if _conditional_nodes("cuda"):
            assert any(said in r for r in _eager_reason(g)), _eager_reason(g)


def test_tree_branches_use_parameters_in_place_and_keep_inductor(device):
    # The branches' static inputs are the graph's (no copy of a weight into the pool per
    # replay), and with cond_form="tree-branch" Inductor compiles the pieces (no cond stays in
    # a recording for its host read to matter).
    torch._dynamo.reset()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64) * 0.1)
            self.pre = torch.nn.Linear(64, 64)

        def forward(self, x):
            y = self.pre(x).relu()
            return torch.cond(
                x.sum() > 0, lambda t, w: (t @ w).sin(), lambda t, w: (t @ w.t()).cos(), (y, self.w)
            )

    m = M().to(device).requires_grad_(False)
    compiled = torch.compile(m, backend=_tree_branch_backend())
    x = torch.randn(4, 64, device=device)
    for k in range(8):
        mark_step_begin()
        if k == 5:
            m.w.mul_(1.5)  # an optimizer's step: used in place, so the replays see it
        arg = x if k % 2 else -x
        assert_close(compiled(arg), m(arg))
    branches = [n for n in info(device)["nodes"] if ".cond1." in n["function"]]
    # The weight is a static input ("S"), not copied ("C") into the pool on every replay.
    kinds = sorted((n["function"][-5:], n["input_kinds"]) for n in branches)
    assert [k for _, k in kinds] == ["SM", "SM"], kinds
    if device == "cpu":
        torch._dynamo.reset()
        graphtrees.reset()
        compiled = torch.compile(
            m, backend=graphtrees.make_backend(inner="inductor", cond_form="tree-branch")
        )
        for k in range(4):
            mark_step_begin()
            assert_close(compiled(x if k % 2 else -x), m(x if k % 2 else -x))
        # Inductor's CPU kernels are called outside the dispatcher: its graphs replay in Python.
        assert set(cpu_replays("cpu")) == {"python"}, cpu_replays("cpu")


def test_a_cond_nested_in_a_tree_branch_keeps_the_traced_graph():
    # The outer cond takes the tree-branch form; the inner one is recorded with its branch, as a
    # program step: Inductor, whose code reads a predicate on the host, is not used there.
    torch._dynamo.reset()

    def f(x):
        inner = lambda t: torch.cond(t.mean() > 1, lambda u: u * 2, lambda u: u + 3, (t,))  # noqa
        return torch.cond(x.sum() > 0, inner, lambda t: t - 1, (x,)).relu()

    backend = graphtrees.make_backend(inner="inductor", cond_form="tree-branch")
    compiled = torch.compile(f, backend=backend)
    x = torch.arange(1.0, 5.0)
    for s in (1, 1, -1, 1, -1, 0.1):
        mark_step_begin()
        assert_close(compiled(x * s), f(x * s))
    true = [n for n in info("cpu")["nodes"] if n["function"].endswith(".cond1.true")]
    assert true and true[0]["conditionals"] == [{"kind": "cond", "form": "program-branch"}], true
