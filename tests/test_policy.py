"""graphtrees.install(): graphtrees records the graphs of torch.compile(mode="reduce-overhead")
through Inductor's cudagraph_policy hook (torch 2.14 and newer).

The CUDA tests run on a GPU or on the CUDA stand-in (where kernels are loaded but never run: they
check what graphtrees does -- nodes, counts, pool blocks -- not values). The last group re-expresses
cases of PyTorch's test/inductor/test_cudagraph_trees.py with install() on.
"""

import contextlib
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

import graphtrees
from graphtrees import _policy

from helpers import ROOT, assert_close, live_pool_blocks

needs_hook = pytest.mark.skipif(
    not _policy.hook_available(),
    reason=f"torch {torch.__version__} has no torch._inductor.config.cudagraph_policy "
    "(test_install_without_the_hook_names_the_torch_needed checks the error there)",
)


@pytest.fixture
def installed():
    torch._dynamo.reset()
    with graphtrees.install() as installation:
        yield installation
    torch._dynamo.reset()


def counts(info):
    keys = ("num_nodes", "num_warmups", "num_recordings", "num_replays", "num_rerecords")
    return {k[4:]: info[k] for k in keys}


def nodes(info):
    return [(n["function"], n["parent"], n["input_kinds"]) for n in info["nodes"]]


def pytorchs_manager():
    import torch._inductor.cudagraph_trees as trees

    container = trees.local.tree_manager_containers.get(0)
    return None if container is None else container.tree_manager


# ----------------------------------------------------------------------------------------------
# Installing, on any device


def test_install_without_the_hook_names_the_torch_needed(monkeypatch):
    if _policy.hook_available():  # torch 2.14: the torch 2.11 stage runs it without the patch
        monkeypatch.setattr(_policy, "hook_available", lambda: False)
    message = rf"torch 2\.14 and newer.*this is torch {re.escape(torch.__version__)}"
    with pytest.raises(RuntimeError, match=message):
        graphtrees.install()
    assert not graphtrees.installed() and graphtrees.uninstall() is False


@needs_hook
def test_install_uninstall_and_the_context_manager():
    import torch._inductor.config as config

    assert config.cudagraph_policy is None and not graphtrees.installed()
    first = graphtrees.install()
    assert graphtrees.installed() and config.cudagraph_policy is first.policy
    second = graphtrees.install(warmup_iters=2)  # replaces the options; uninstall restores None
    assert config.cudagraph_policy is second.policy and second.policy.options == {"warmup_iters": 2}
    assert graphtrees.uninstall() is True and config.cudagraph_policy is None
    assert graphtrees.uninstall() is False
    with graphtrees.install(rerecord_limit=1) as inst:
        assert config.cudagraph_policy is inst.policy
    assert config.cudagraph_policy is None
    # Someone else's policy stays under ours and comes back.
    from torch._inductor.cudagraph_utils import CUDAGraphPolicy

    theirs = CUDAGraphPolicy()
    with config.patch("cudagraph_policy", theirs):
        with graphtrees.install():
            assert graphtrees.installed()
        assert config.cudagraph_policy is theirs
        graphtrees.install()
        graphtrees.uninstall()
        assert config.cudagraph_policy is theirs


@needs_hook
def test_install_refuses_bad_options():
    with pytest.raises(TypeError, match=r"unexpected options \['inner'\]"):
        graphtrees.install(inner="aot_eager")
    with pytest.raises(ValueError, match="warmup_iters"):
        graphtrees.install(warmup_iters=-1)
    with pytest.raises(ValueError, match="on_overwrite"):
        graphtrees.install(on_overwrite="ignore")
    assert not graphtrees.installed()


@needs_hook
@pytest.mark.parametrize(
    "value, expected", [("1", "True"), ("on", "True"), ("0", "False"), (None, "False")]
)
def test_graphtrees_install_in_the_environment(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "GRAPHTREES_INSTALL"}
    if value is not None:
        env["GRAPHTREES_INSTALL"] = value
    code = (
        "import torch._inductor.config as c, graphtrees\n"
        "print(graphtrees.installed(), type(c.cudagraph_policy).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    policy = "GraphtreesPolicy" if expected == "True" else "NoneType"
    assert out.stdout.split() == [expected, policy]


@needs_hook
def test_graphtrees_install_refuses_a_value_it_does_not_know():
    env = dict(os.environ, GRAPHTREES_INSTALL="maybe")
    out = subprocess.run(
        [sys.executable, "-c", "import graphtrees"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "GRAPHTREES_INSTALL must be 1/true/yes/on or 0/false/no/off, got 'maybe'" in out.stderr


@needs_hook
def test_nested_installations_give_back_the_outer_one():
    import torch._inductor.config as config

    assert config.cudagraph_policy is None
    with graphtrees.install(warmup_iters=2) as outer:
        with graphtrees.install(rerecord_limit=1) as inner:
            assert config.cudagraph_policy is inner.policy
        assert config.cudagraph_policy is outer.policy
        assert outer.policy.options == {"warmup_iters": 2}
    assert config.cudagraph_policy is None


def _dynamo_reset():
    """torch._dynamo.reset(), which calls torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    (the function install() wraps) once CUDA is initialized; without CUDA (a CPU-only run) that
    call is made here, as torch._dynamo.reset() makes it."""
    torch._dynamo.reset()
    if not torch.cuda.is_initialized():
        import torch._inductor.cudagraph_trees as trees

        trees.reset_cudagraph_trees()


def _policy_function(policy, example):
    """A function of the installed policy, made as Inductor asks for one (a CPU graph here)."""
    boxed = policy.cudagraphify(
        lambda args: [args[0] * 3 + 1],
        [example],
        [],
        device_index=0,
        is_backward=False,
        is_inference=True,
    )
    return lambda x: boxed([x])[0]


@needs_hook
@pytest.mark.usefixtures("no_grad")
def test_dynamo_reset_frees_only_the_policys_functions_and_only_while_installed():
    # Any library may call torch._dynamo.reset(): after install() it used to free every tree,
    # plain cudagraphify ones included, even after uninstall().
    from graphtrees import cudagraphify, mark_step_begin, tree_info

    _dynamo_reset()
    x = torch.randn(8)
    mine = cudagraphify(lambda t: t * 2)
    with graphtrees.install() as installation:
        policy_fn = _policy_function(installation.policy, x)
        for _ in range(3):
            policy_fn(x)
        mark_step_begin()
        for _ in range(3):
            out = mine(x)  # a replay: the path is on mine's recording
        assert tree_info("cpu")["num_nodes"] == 2
        _dynamo_reset()
        info = tree_info("cpu")
        assert [n["function"].startswith("inductor") for n in info["nodes"]] == [False]
        assert info["num_evictions"] == 1
        assert_close(out, x * 2)  # and its output stays valid
        # A path that starts with a policy recording ends, and the recording goes.
        second = _policy_function(installation.policy, x)
        mark_step_begin()
        for _ in range(3):
            second(x)
        assert tree_info("cpu")["num_nodes"] == 2
        _dynamo_reset()
        assert tree_info("cpu")["num_nodes"] == 1
    _dynamo_reset()  # not installed: graphtrees is not touched at all
    info = tree_info("cpu")
    assert info["num_nodes"] == 1 and info["num_replays"] >= 2
    out = mine(x)
    assert_close(out, x * 2)
    assert tree_info("cpu")["num_replays"] == info["num_replays"] + 1


@needs_hook
@pytest.mark.usefixtures("no_grad")
def test_dynamo_reset_frees_a_tree_left_with_only_the_policys_functions():
    from graphtrees import tree_info

    _dynamo_reset()
    x = torch.randn(8)
    with graphtrees.install() as installation:
        policy_fn = _policy_function(installation.policy, x)
        for _ in range(3):
            policy_fn(x)
        assert tree_info("cpu")["pool"]["reserved_bytes"] > 0
        _dynamo_reset()
        info = tree_info("cpu")
        assert info["backend"] is None and info["pool"]["reserved_bytes"] == 0


_unsafe_copy_calls = [0]


@torch.library.custom_op(
    "graphtrees_test::unsafe_copy", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _unsafe_copy(x: torch.Tensor) -> torch.Tensor:
    _unsafe_copy_calls[0] += 1
    return x.clone()


@_unsafe_copy.register_fake
def _(x):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------------------------
# reduce-overhead graphs as graphtrees nodes (CUDA: a GPU or the stand-in)

cuda = [needs_hook, pytest.mark.needs_cuda]


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).cuda()


@pytest.mark.usefixtures("installed")
class TestReduceOverheadOnGraphtrees:
    pytestmark = cuda

    def test_an_mlp_is_one_node_and_pytorchs_trees_are_never_made(self):
        eager = mlp()
        model = torch.compile(eager, mode="reduce-overhead")
        x = torch.randn(8, 16, device="cuda")
        with torch.no_grad():
            for _ in range(4):
                assert_close(model(x), eager(x))  # values on a GPU; shapes on the stand-in
        info = graphtrees.tree_info("cuda")
        # First call warms up, the second records (and runs the recording), two replays.
        assert counts(info) == dict(nodes=1, warmups=1, recordings=1, replays=2, rerecords=0)
        # The input is copied, the four parameters are Inductor's static inputs.
        ((name, parent, kinds),) = nodes(info)
        assert parent is None and kinds == "CSSSS"
        assert re.fullmatch(r"inductor\d+\.inference", name)
        assert pytorchs_manager() is None
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0

    def test_a_training_step_is_forward_then_backward(self):
        model = mlp()
        ref = mlp()
        ref.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        step = torch.compile(model, mode="reduce-overhead")
        x = torch.randn(8, 16, device="cuda")
        for i in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            loss = step(x).sum()
            if i == 3:
                assert graphtrees.tree_info("cuda")["pending_backward"] == 1
            loss.backward()
            ref(x).sum().backward()
            assert_close([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
            for o in (opt, ref_opt):  # outside the compiled graphs
                o.step()
                o.zero_grad()
        info = graphtrees.tree_info("cuda")
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=4, rerecords=0)
        (fwd, fwd_parent, _k), (bwd, bwd_parent, _kinds) = nodes(info)
        assert fwd.endswith(".forward") and bwd.endswith(".backward")
        assert fwd_parent is None and bwd_parent == info["nodes"][0]["id"]
        assert info["pending_backward"] == 0
        assert pytorchs_manager() is None

    def test_a_graph_break_gives_two_nodes_in_a_chain(self):
        @torch.compile(mode="reduce-overhead")
        def f(x):
            y = x.sin() * 2
            torch._dynamo.graph_break()
            return y.cos() + 1

        x = torch.ones(64, device="cuda")
        for _ in range(3):
            assert_close(f(x), (x.sin() * 2).cos() + 1)
        info = graphtrees.tree_info("cuda")
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=2, rerecords=0)
        (_, first_parent, first_kinds), (_, second_parent, second_kinds) = nodes(info)
        # The second graph reads the first one's output in place: it is its child.
        assert first_parent is None and second_parent == info["nodes"][0]["id"]
        assert (first_kinds, second_kinds) == ("C", "M")

    def test_a_mutated_static_buffer_and_a_mutated_input_are_used_in_place(self):
        class Counter(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)
                self.register_buffer("steps", torch.zeros(()))

            def forward(self, x):
                self.steps.add_(1)
                return self.lin(x) * 2

        model = Counter().cuda()
        steps_address = model.steps.data_ptr()
        compiled = torch.compile(model, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):
                compiled(torch.ones(2, 8, device="cuda"))

        @torch.compile(mode="reduce-overhead")
        def f(acc, y):
            acc.add_(1)  # a mutated input that is not static: Inductor declares it
            return y * 2

        acc, y = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
        address = acc.data_ptr()
        for _ in range(3):
            assert_close(f(acc, y), y * 2)
        assert_close(acc, torch.full_like(acc, 3.0))  # three calls, three increments in place
        assert_close(model.steps, torch.tensor(3.0, device="cuda"))
        info = graphtrees.tree_info("cuda")
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=2, rerecords=0)
        kinds = [k for _, _, k in nodes(info)]
        # The buffer is among the module's static inputs; the mutated input is used in place
        # (S), the other input copied (C). PyTorch's trees would run f eagerly on every call.
        assert sorted(kinds[0]) == sorted("CSSS") and kinds[1] == "SC"
        assert acc.data_ptr() == address and model.steps.data_ptr() == steps_address
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0

    def test_dynamic_shapes_record_each_size_once(self):
        @torch.compile(mode="reduce-overhead", dynamic=True)
        def f(x):
            return (x * 2).relu() + 1

        for n in (4, 8, 16, 8, 4):
            for _ in range(2):
                x = torch.full((n,), -1.5, device="cuda")
                assert_close(f(x), (x * 2).relu() + 1)
        info = graphtrees.tree_info("cuda")
        # Three sizes: each warmed up, recorded, then replayed on its later calls.
        assert counts(info) == dict(nodes=3, warmups=3, recordings=3, replays=4, rerecords=0)
        names = [n for n, _, _ in nodes(info)]
        assert len(set(n.split("#")[0] for n in names)) == 1  # one compiled graph

    def test_inductors_partitions_are_kept(self):
        # With graph_partition=True (the default), Inductor splits a graph around its CPU ops
        # and the ops tagged cudagraph_unsafe: each CUDA partition is a node, the code between
        # them runs eagerly.
        assert torch._inductor.config.graph_partition

        @torch.compile(mode="reduce-overhead")
        def f(x, c):
            a = x.sin() * 2
            b = (c * 2 + 1).sum()  # on the CPU, before the one partition
            return a.cos() + b.cuda()

        @torch.compile(mode="reduce-overhead")
        def g(x):
            a = x.sin() * 2
            return (_unsafe_copy(a) + a).cos()

        x, c = torch.ones(64, device="cuda"), torch.ones(4)
        with torch.no_grad():
            for _ in range(3):
                f(x, c)
            info = graphtrees.tree_info("cuda")
            assert counts(info) == dict(nodes=1, warmups=1, recordings=1, replays=1, rerecords=0)
            # Both inputs of the partition are copied: x, and the CPU sum moved to the device.
            assert nodes(info)[0][2] == "CC"
            graphtrees.reset()
            for _ in range(3):
                assert_close(g(x), ((x.sin() * 2) * 2).cos())
        info = graphtrees.tree_info("cuda")
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=2, rerecords=0)
        names = [n for n, _, _ in nodes(info)]
        assert [n[-5:] for n in names] == ["[1/2]", "[2/2]"] and names[0][:-5] == names[1][:-5]
        assert _unsafe_copy_calls[0] == 3  # eager between the partitions on every call

    def test_a_graph_inductor_skips_stays_skipped_with_its_reason(self):
        # With input-mutation support off, a mutated eager input is one of Inductor's reasons.
        @torch.compile(mode="reduce-overhead")
        def f(acc, y):
            acc.add_(1)
            return y * 2

        # Inductor says why on its "cudagraphs" artifact log (TORCH_LOGS=cudagraphs).
        reasons = []
        keep = logging.Handler()
        keep.emit = lambda record: reasons.append(record.getMessage())
        artifact = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
        before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        acc, y = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
        torch._logging.set_logs(cudagraphs=True)
        artifact.addHandler(keep)
        disabled, artifact.disabled = artifact.disabled, False  # a dictConfig may have disabled it
        try:
            with torch._inductor.config.patch("triton.cudagraph_support_input_mutation", False):
                for _ in range(3):
                    f(acc, y)
        finally:
            artifact.removeHandler(keep)
            artifact.disabled = disabled
            torch._logging.set_logs()
        assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == before + 1
        assert graphtrees.tree_info("cuda")["num_nodes"] == 0
        assert any("skipping cudagraphs due to mutated inputs" in r for r in reasons), reasons

    @pytest.mark.needs_kernels("the loop's predicate is computed by Inductor's Triton kernels")
    def test_a_while_loop_runs_between_recorded_partitions(self):
        # Issue 48: with graph_partition=True Inductor keeps a torch.while_loop out of its CUDA
        # partitions (its loop runs in the wrapper code, the predicate read on the host): the
        # partitions before and after it are recorded, and every trip count replays them.
        def f(x, n):
            i0 = torch.zeros((), dtype=torch.long, device=x.device)
            body = lambda i, a: (i + 1, a * 2 + 1)  # noqa: E731
            return torch.while_loop(lambda i, a: i < n, body, (i0, x.sin()))[1].relu() + 1

        model = torch.compile(f, mode="reduce-overhead")
        with torch.no_grad():
            for k in (0, 1, 3, 2, 5, 0):
                torch.compiler.cudagraph_mark_step_begin()
                x, n = torch.randn(8, device="cuda"), torch.tensor(k, device="cuda")
                assert_close(model(x, n), f(x, n))
        info = graphtrees.tree_info("cuda")
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=8, rerecords=0)
        assert [n[-5:] for n, _, _ in nodes(info)] == ["[1/2]", "[2/2]"]

    def test_reset_gives_every_pool_block_back(self):
        model = torch.compile(mlp(), mode="reduce-overhead")
        x = torch.randn(8, 16, device="cuda")
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            out = model(x)
        pool = graphtrees.tree_info("cuda")["pool"]
        assert pool["reserved_bytes"] > 0 and pool["segments"] > 0
        del out
        graphtrees.reset()
        pool = graphtrees.tree_info("cuda")["pool"]
        assert live_pool_blocks() == 0 and pool["reserved_bytes"] == 0
        torch.cuda.empty_cache()
        segments = torch.cuda.memory_snapshot()
        assert not [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]

    def test_dynamo_reset_frees_graphtrees_trees_too(self):
        model = torch.compile(mlp(), mode="reduce-overhead")
        x = torch.randn(8, 16, device="cuda")
        with torch.no_grad():
            for _ in range(3):
                model(x)
        assert graphtrees.tree_info("cuda")["num_nodes"] == 1
        torch._dynamo.reset()  # as PyTorch's own tests do between cases
        info = graphtrees.tree_info("cuda")
        assert info["num_nodes"] == 0 and info["pool"]["reserved_bytes"] == 0
        assert live_pool_blocks() == 0


@needs_hook
@pytest.mark.needs_cuda
@pytest.mark.usefixtures("no_grad")
def test_uninstall_gives_new_graphs_back_to_pytorchs_trees():
    torch._dynamo.reset()
    graphtrees.install()
    f = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    x = torch.ones(8, device="cuda")
    for _ in range(3):
        f(x)
    assert graphtrees.tree_info("cuda")["num_nodes"] == 1
    graphtrees.uninstall()
    g = torch.compile(lambda x: x * 3 + 1, mode="reduce-overhead")
    for _ in range(3):
        g(x), f(x)  # f stays graphtrees'
    assert graphtrees.tree_info("cuda")["num_nodes"] == 1
    assert graphtrees.tree_info("cuda")["num_replays"] == 4
    assert pytorchs_manager() is not None
    torch._dynamo.reset()


@needs_hook
@pytest.mark.needs_cuda
@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("engine", ["pytorch", "graphtrees"])
def test_a_graph_holding_a_cond_is_left_to_inductor_by_both_engines(engine):
    # Issue 48 under install(): Inductor lowers torch.cond to a branch of its wrapper code that
    # reads the predicate on the host, and refuses CUDA graphs for a graph holding one on the
    # device before any policy sees the graph (torch/_inductor/lowering.py, torch 2.14): PyTorch's
    # trees and graphtrees alike run it as Inductor compiled it, with Inductor's reason. The same
    # cond under backend="graphtrees" is recorded (tests/test_control_flow.py).
    def f(x):
        y = x * 2
        return torch.cond(y.sum() > 0, lambda a: a + 1, lambda a: a - 1, (y,)).relu()

    torch._dynamo.reset()

    def skips():  # torch._dynamo.reset() and compiling may replace the counters
        return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]

    before = skips()
    got, want = [], []
    with graphtrees.install() if engine == "graphtrees" else contextlib.nullcontext():
        model = torch.compile(f, mode="reduce-overhead")
        for s in (1.0, -1.0, 1.0, -1.0):
            torch.compiler.cudagraph_mark_step_begin()
            x = torch.full((8,), s, device="cuda")
            got.append(model(x))
            want.append(f(x))
    assert skips() == before + 1
    assert graphtrees.tree_info("cuda")["num_nodes"] == 0
    assert pytorchs_manager() is None  # PyTorch's trees were never asked to record
    torch._dynamo.reset()
    assert_close(got, want)  # values on a GPU (the stand-in computes no Triton kernel)


# ----------------------------------------------------------------------------------------------
# Cases of PyTorch's test/inductor/test_cudagraph_trees.py, re-expressed with install() on. Its
# teardown checks are the conftest's: no tree left after reset(), no live private-pool block.


@pytest.mark.usefixtures("installed")
class TestPytorchsCases:
    pytestmark = cuda

    @pytest.fixture(autouse=True)
    def no_pytorch_manager_left(self):
        # PyTorch's tearDown: no tree manager of theirs (graphtrees recorded everything); the
        # conftest checks graphtrees' side: no tree after reset(), no live private-pool block.
        yield
        assert pytorchs_manager() is None

    def test_run_simple(self):
        # PyTorch: one root after two calls of one function, nothing below it.
        def foo(x):
            return x * x * x

        foo_opt = torch.compile(foo, mode="reduce-overhead")
        ones = torch.ones([4, 4], device="cuda")
        for _ in range(3):
            foo_opt(ones)
        info = graphtrees.tree_info("cuda")
        assert info["num_roots"] == 1 and info["nodes"][0]["children"] == []

    def test_function_compiled_multiple_times(self):
        # PyTorch: the same function compiled twice is two functions: two roots.
        def foo(x):
            y = foo2(x)
            y2 = foo2(y)
            return y + y2

        def foo2(x):
            torch._dynamo.graph_break()
            return x * x * x

        foo_opt = torch.compile(foo, mode="reduce-overhead")
        ones = torch.ones([4], device="cuda")
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            foo_opt(ones)
        info = graphtrees.tree_info("cuda")
        # foo's graphs and foo2's one graph called twice: a chain, one root.
        assert info["num_roots"] == 1 and info["num_recordings"] == info["num_nodes"] >= 3

    def test_mark_step(self):
        # PyTorch: after mark_step_begin a new call starts a new generation at the root.
        @torch.compile(mode="reduce-overhead")
        def foo(x):
            return x * 2

        x = torch.ones(4, device="cuda")
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            foo(foo(x))
        info = graphtrees.tree_info("cuda")
        # foo(x) at the root and foo(foo(x)) under it, replayed as one path per step.
        assert info["num_roots"] == 1 and info["num_nodes"] == 2
        assert info["nodes"][1]["parent"] == info["nodes"][0]["id"]

    def test_rerecord_if_static_input_address_changed(self):
        # PyTorch: a static input (a buffer) that moves makes a re-recording.
        class Goo(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(2, 2, device="cuda")

            def forward(self, x):
                return self.linear(x)

        class Foo(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("static_tensor", torch.zeros((2, 2), device="cuda"))
                self.goo = Goo()

            def forward(self, x):
                self.static_tensor.add_(torch.ones((2, 2), device="cuda"))
                return self.static_tensor + x + self.goo(x)

        foo = Foo()
        compiled = torch.compile(foo, mode="reduce-overhead")
        x = torch.ones((2, 2), device="cuda")
        with torch.no_grad():
            for _ in range(3):
                compiled(x)
            assert graphtrees.tree_info("cuda")["num_rerecords"] == 0
            foo.static_tensor = torch.ones((2, 2), device="cuda")
            for _ in range(3):
                compiled(x)
        assert (
            graphtrees.tree_info("cuda")["num_rerecords"]
            + graphtrees.tree_info("cuda")["num_recordings"]
            >= 2
        )

    def test_no_rerecord_with_mark_static_address(self):
        # PyTorch: an input marked static keeps its recording while its address does not move.
        class Mod(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(2, 2)

            def forward(self, x):
                return self.linear(x)

        mod = Mod().cuda()

        def fn_eager(x, marked_static_y):
            return torch.cos(x) + mod(marked_static_y)

        y = torch.randn(2, 2, device="cuda")
        torch._dynamo.mark_static_address(y)
        fn = torch.compile(fn_eager, mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(4):
                fn(torch.randn(2, 2, device="cuda"), y)
        info = graphtrees.tree_info("cuda")
        assert info["num_rerecords"] == 0 and info["num_recordings"] == 1
        assert "S" in info["nodes"][0]["input_kinds"]

    def test_forward_backward(self):
        # PyTorch's test_forward_backward: a forward and its backward, each recorded once. Here
        # the backward reads no output of the forward (Inductor saves only the input, a static
        # input of the backward), and the forward's one output is dead by the time the backward
        # runs: graphtrees ends that path, so the backward starts at the root (PyTorch's trees
        # keep it under the forward). Either way it cannot overwrite a live tensor.
        @torch.compile(mode="reduce-overhead")
        def foo(x):
            y = x * 2
            return torch.sin(y) * torch.nn.functional.dropout(x, p=0.0)

        inp = torch.rand([4, 4], requires_grad=True, device="cuda")
        for _ in range(4):
            foo(inp).sum().backward()
        info = graphtrees.tree_info("cuda")
        # Each step is one warmup, one recording or one replay of the forward and the backward.
        assert counts(info) == dict(nodes=2, warmups=2, recordings=2, replays=4, rerecords=0)
        (fwd, _, fwd_kinds), (bwd, bwd_parent, bwd_kinds) = nodes(info)
        assert fwd.endswith(".forward") and bwd.endswith(".backward")
        assert bwd_parent is None and (fwd_kinds, bwd_kinds) == ("C", "CS")
        assert info["pending_backward"] == 0
