"""Piecewise recording (Note [Piecewise graphs]): a compiled graph with ops that cannot be recorded
is split around them; each recorded piece is a node of the tree and replays, the rest runs
eagerly, and the results and gradients are eager's."""

import copy
import logging
import re

import pytest
import torch

import graphtrees

from helpers import assert_close, assert_invariants, info

INNERS = ("aot_eager", "inductor")
PIECE = re.compile(r"graph\d+\.(inference|forward|backward)\[(\d+)/(\d+)\](#\d+)?$")


@torch.library.custom_op(
    "graphtrees_test::host_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def host_scale(x: torch.Tensor) -> torch.Tensor:
    """Stands for an op that does host work no recording can repeat."""
    return x * 2


@host_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _host_scale_backward(ctx, grad):
    return grad * 2


host_scale.register_autograd(_host_scale_backward)


@torch.library.custom_op("graphtrees_test::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    """A plain custom op (recordable): splitting_ops keeps it out by name."""
    return x.flip(-1) + x


@mix.register_fake
def _(x):
    return torch.empty_like(x)


mix.register_autograd(lambda ctx, grad: grad.flip(-1) + grad)


@torch.library.custom_op("graphtrees_test::attention_into", mutates_args=("out",))
def attention_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Writes its result into `out`, as vLLM's attention op does with the output it is given."""
    out.copy_(torch.softmax(x, dim=-1))


@attention_into.register_fake
def _(x, out):
    return None


class Net(torch.nn.Module):
    """Two linear layers around `middle`, and `first`/`last` before and after them."""

    def __init__(self, middle, first=None, last=None):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.middle, self.first, self.last = middle, first, last

    def forward(self, x):
        if self.first is not None:
            x = self.first(x)
        h = torch.tanh(self.a(x)) * 2 + 1
        h = self.middle(h)
        out = torch.sigmoid(self.b(torch.relu(h) + 1)) * 3
        return self.last(out) if self.last is not None else out


def _nonzero(h):
    rows = (h[:, 0] == h[:, 0]).nonzero()[:, 0]  # every row: data-dependent, yet stable
    return h[rows] * 1.5


def _item(h):
    n = (h > -1e9).sum().long().item()  # h.numel(), read on the host
    return h * (n % 5)


def _host(h):
    return host_scale(h)


def _mix(h):
    return mix(h)


def _softmax(h):
    return torch.softmax(h, dim=-1) * 4


CASES = {
    # name: (Net(...) arguments, graphtrees options, dynamo config, op named in the log)
    "nonzero": ((_nonzero,), {}, {"capture_dynamic_output_shape_ops": True}, "aten.nonzero"),
    "item": ((_item,), {}, {"capture_scalar_outputs": True}, "aten._local_scalar_dense"),
    "unsafe_custom_op": ((_host,), {}, {}, "graphtrees_test.host_scale"),
    "splitting_ops": (
        (_mix,),
        {"splitting_ops": ["graphtrees_test::mix"]},
        {},
        "graphtrees_test.mix",
    ),
    "first_and_last": ((torch.cos, _host, _host), {}, {}, "graphtrees_test.host_scale"),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pieces(device):
    """(function, replays) of the tree's nodes that are pieces of a split graph."""
    return [
        (n["function"], n["replays"]) for n in info(device)["nodes"] if PIECE.match(n["function"])
    ]


def _functions(device):
    """The tree's nodes' function names, without the graph's number."""
    return [re.sub(r"^graph\d+\.", "", n["function"]) for n in info(device)["nodes"]]


def _assert_pieces_replayed(device, modes):
    pieces = _pieces(device)
    seen = {PIECE.match(f).group(1) for f, _ in pieces}
    assert set(modes) <= seen, (modes, info(device)["nodes"])
    assert all(r > 0 for _, r in pieces), pieces
    # No piece holds every op: the graph really was split.
    assert all(PIECE.match(f).group(3) != "1" for f, _ in pieces), pieces


def _case_params():
    # nonzero's output shape is read from the device: a value the CUDA stand-in has none of.
    kernels = pytest.mark.needs_values("nonzero's output shape is read from the device")
    return [pytest.param(c, marks=kernels) if c == "nonzero" else c for c in sorted(CASES)]


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("case", _case_params())
def test_inference_is_split_and_matches_eager(device, inner, case, caplog):
    caplog.set_level(logging.INFO, logger="graphtrees")
    args, options, dynamo, op = CASES[case]
    torch.manual_seed(0)
    model = Net(*args).to(device).eval()
    x = torch.randn(6, 8, device=device)
    with torch._dynamo.config.patch(**dynamo), torch.no_grad():
        compiled = graphtrees.compile(model, inner=inner, **options)
        for _ in range(4):
            assert_close(compiled(x), model(x))
    _assert_pieces_replayed(device, ["inference"])
    assert re.search(r"split 'graph\d+\.inference' into", caplog.text) and op in caplog.text
    (name, pieces), *_ = graphtrees.split_info().items()
    recorded = [p["piece"] for p in pieces if p["recorded"]]
    assert recorded == [f for f, _ in _pieces(device)]  # each recorded piece is a tree node
    assert all(op in " ".join(p["why_eager"]) for p in pieces if not p["recorded"]), pieces
    assert "test_piecewise.py" in caplog.text  # the source line of the op it split at
    assert info(device)["num_fallbacks"] == 0
    assert_invariants(device)


def _train_matches_eager(model, compiled, data):
    """SGD steps on `data` through `compiled` (which wraps `model`) and through an eager copy
    made first: the parameters must end the same."""
    ref = copy.deepcopy(model)
    for m, f in ((ref, ref), (model, compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for x in data:
            opt.zero_grad()
            f(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("case", _case_params())
def test_training_is_split_and_matches_eager(device, inner, case):
    args, options, dynamo, _ = CASES[case]
    torch.manual_seed(0)
    model = Net(*args).to(device)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(6, 8, generator=gen).to(device) for _ in range(5)]
    with torch._dynamo.config.patch(**dynamo):
        _train_matches_eager(model, graphtrees.compile(model, inner=inner, **options), data)
    _assert_pieces_replayed(device, ["forward"])
    t = info(device)
    # Each step is one path: the split graph counted once as a pending backward.
    assert not t["pending_backward"] and t["generation"] >= len(data) - 1, t
    nodes = {n["id"]: n for n in t["nodes"]}
    for n in nodes.values():  # every backward node is under a forward node of the same graph
        if ".backward" in n["function"]:
            parent = nodes[n["parent"]]["function"]
            assert ".forward" in parent or ".backward" in parent, (n, parent)
    assert_invariants(device)


@pytest.mark.parametrize("inner", INNERS)
def test_backward_is_split_too(device, inner):
    # splitting_ops on an op that has a backward: the backward graph holds its backward op (the
    # aten op F.scaled_dot_product_attention lowered to) and is split around it.
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x):
            q, k, v = self.qkv(torch.tanh(x) * 2).chunk(3, dim=-1)
            a = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])
            return torch.sigmoid(self.out(torch.relu(a[:, 0]) + 1)) * 3

    torch.manual_seed(0)
    model = Attn().to(device)
    data = [torch.randn(2, 5, 8, device=device) for _ in range(4)]
    compiled = graphtrees.compile(
        model, inner=inner, splitting_ops=["aten::scaled_dot_product_attention"]
    )
    _train_matches_eager(model, compiled, data)
    _assert_pieces_replayed(device, ["forward", "backward"])
    names = [f for f, _ in _pieces(device)]
    assert any(re.match(r"graph\d+\.backward\[\d/\d\]", f) for f in names), names


def test_recorded_pieces_run_recorded_ops_on_cpu():
    # On the CPU backend aot_eager pieces replay their recorded op programs, as on a GPU: the
    # eager piece between them is the only Python that runs.
    args, options, dynamo, _ = CASES["nonzero"]
    torch.manual_seed(0)
    model = Net(*args).eval()
    x = torch.randn(6, 8)
    with torch._dynamo.config.patch(**dynamo), torch.no_grad():
        compiled = graphtrees.compile(model, inner="aot_eager")
        for _ in range(4):
            assert_close(compiled(x), model(x))
    t = info("cpu")
    assert [n["cpu_replay"] for n in t["nodes"]] == ["program", "program"], t["nodes"]
    assert t["num_program_replays"] == t["num_replays"] == 4
    first, second = t["nodes"]
    assert second["parent"] == first["id"]  # the second piece is a child of the first
    assert "M" in second["input_kinds"]  # and reads the first piece's output in place


def test_consecutive_pieces_pass_outputs_in_place(device):
    # Two ops that must run eagerly, with recorded pieces around them: each piece is a child of
    # the piece before it, and reads the outputs of earlier pieces as managed inputs (in place,
    # never copied); only what the eager ops made is copied in.
    def f(x):
        h = torch.tanh(x) * 2 + 1
        s = host_scale(h)
        g = torch.sigmoid(s) * 3 - h
        s2 = host_scale(g)
        return torch.cos(s2) * 2 + g + h

    x = torch.randn(4, 8, device=device)
    compiled = graphtrees.compile(f, inner="aot_eager")
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), f(x))
    nodes = info(device)["nodes"]
    assert _functions(device) == ["inference[1/5]", "inference[3/5]", "inference[5/5]"]
    assert nodes[1]["parent"] == nodes[0]["id"] and nodes[2]["parent"] == nodes[1]["id"]
    assert [n["input_kinds"] for n in nodes] == ["C", "CM", "CMM"]
    assert [n["replays"] for n in nodes] == [1, 1, 1]


def test_tree_to_dot_shows_the_pieces(device):
    args, options, dynamo, _ = CASES["unsafe_custom_op"]
    model = Net(*args).to(device).eval()
    x = torch.randn(6, 8, device=device)
    compiled = graphtrees.compile(model, inner="aot_eager")
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    dot = graphtrees.tree_to_dot(device)
    assert re.search(r"graph\d+\.inference\[1/3\]", dot) and re.search(r"inference\[3/3\]", dot)


def test_small_pieces_run_eagerly(device, caplog):
    # A piece with fewer than min_piece_ops ops costs a replay for nothing: it runs eagerly.
    caplog.set_level(logging.INFO, logger="graphtrees")

    def f(x):
        h = torch.tanh(x) * 2  # 2 ops
        h = host_scale(h)
        return torch.cos(h) * 2 + h  # 3 ops

    x = torch.randn(4, 8, device=device)
    compiled = graphtrees.compile(f, inner="aot_eager")
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), f(x))
    assert _functions(device) == ["inference[2/2]"]
    assert "fewer than min_piece_ops=3" in caplog.text

    torch._dynamo.reset()
    graphtrees.reset()
    compiled = graphtrees.compile(f, inner="aot_eager", min_piece_ops=1)
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), f(x))
    assert _functions(device) == ["inference[1/3]", "inference[3/3]"]


def test_piecewise_false_runs_the_whole_graph_eagerly(device, caplog):
    caplog.set_level(logging.WARNING, logger="graphtrees")
    args, _, _, _ = CASES["unsafe_custom_op"]
    model = Net(*args).to(device).eval()
    x = torch.randn(6, 8, device=device)
    compiled = graphtrees.compile(model, inner="aot_eager", piecewise=False)
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), model(x))
    t = info(device)
    assert t["num_nodes"] == 0 and t["num_fallbacks"] == 3
    assert (
        re.search(r"running 'graph\d+\.inference' eagerly", caplog.text)
        and "host_scale" in caplog.text
    )


def test_strict_raises_only_for_what_cannot_be_split(device):
    args, _, _, _ = CASES["unsafe_custom_op"]
    model = Net(*args).to(device).eval()
    x = torch.randn(6, 8, device=device)
    with torch.no_grad():
        strict = graphtrees.compile(model, inner="aot_eager", strict=True)
        assert_close(strict(x), model(x))  # split: no error
        torch._dynamo.reset()

        def only_unrecordable(x):
            return host_scale(x) + 1  # no piece of min_piece_ops ops is left

        strict = graphtrees.compile(only_unrecordable, inner="aot_eager", strict=True)
        with pytest.raises(Exception, match="no piece left to record") as raised:
            strict(x)
        # dynamo wraps what the backend raised
        inner = getattr(raised.value, "inner_exception", raised.value)
        assert isinstance(inner, graphtrees.SkipError), type(inner)


def test_splitting_ops_are_validated():
    with pytest.raises(ValueError, match="names no registered op"):
        graphtrees.compile(torch.nn.Linear(2, 2), splitting_ops=["mylib::no_such_op"])
    with pytest.raises(ValueError, match="is not an op name"):
        graphtrees.compile(torch.nn.Linear(2, 2), splitting_ops=["softmax"])
    with pytest.raises(TypeError, match="must be a list of op names"):
        graphtrees.compile(torch.nn.Linear(2, 2), splitting_ops="aten::softmax")
    with pytest.raises(ValueError, match="min_piece_ops"):
        graphtrees.compile(torch.nn.Linear(2, 2), min_piece_ops=0)
    with pytest.raises(ValueError, match="needs piecewise=True"):
        graphtrees.compile(torch.nn.Linear(2, 2), piecewise=False, splitting_ops=["aten::add"])


def test_splitting_ops_by_the_python_function_an_aten_op_came_from(device):
    # "aten::softmax" matches aten._softmax, which torch.softmax lowered to.
    torch.manual_seed(0)
    model = Net(_softmax).to(device).eval()
    x = torch.randn(6, 8, device=device)
    compiled = graphtrees.compile(model, inner="aot_eager", splitting_ops=["aten::softmax"])
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), model(x))
    assert _functions(device) == ["inference[1/3]", "inference[3/3]"]


@pytest.mark.parametrize("inner", INNERS)
def test_splitting_ops_on_an_op_that_writes_into_its_output_argument(device, inner):
    # Functionalization wraps such an op in auto_functionalized; splitting_ops still names it.
    def f(x):
        h = torch.tanh(x) * 2 + 1
        out = torch.empty_like(h)
        attention_into(h, out)
        return torch.cos(out) * 3 + h

    x = torch.randn(4, 8, device=device)
    compiled = graphtrees.compile(f, inner=inner, splitting_ops=["graphtrees_test::attention_into"])
    with torch.no_grad():
        for _ in range(4):
            assert_close(compiled(x), f(x))
    assert _functions(device) == ["inference[1/3]", "inference[3/3]"]
    _assert_pieces_replayed(device, ["inference"])


@pytest.mark.needs_cuda
@pytest.mark.parametrize("inner", INNERS)
def test_cpu_op_in_the_middle_of_a_cuda_graph(inner):
    def f(x, table):
        h = torch.tanh(x) * 2 + 1
        on_cpu = h.cpu() * table  # a device copy and a CPU op
        return torch.sigmoid(on_cpu.to(x.device)) * 3 + h

    x = torch.randn(4, 8, device="cuda")
    table = torch.randn(4, 8)
    compiled = graphtrees.compile(f, inner=inner)
    with torch.no_grad():
        for _ in range(4):
            assert_close(compiled(x, table), f(x, table))
    _assert_pieces_replayed("cuda", ["inference"])


@pytest.mark.needs_cuda
def test_a_zero_dim_copy_to_the_host_is_split_out_of_a_cuda_graph():
    # Review 4, #16: 0-dim CPU results were exempt from the CPU checks, so loss.cpu() was planned
    # into a recorded piece whose capture then failed: the whole piece ran eagerly, forever.
    f = graphtrees.compile(lambda x: (torch.tanh(x) * 2 + 1).sum().cpu() + 0, inner="aot_eager")
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            out = f(x)
    assert out.device.type == "cpu" and out.dim() == 0
    (pieces,) = graphtrees.split_info().values()
    eager = [p for p in pieces if not p["recorded"]]
    assert any("to CPU" in " ".join(p["why_eager"]) for p in eager), pieces
    assert info("cuda")["num_replays"] >= 2 and info("cuda")["num_fallbacks"] == 0


class _LazyState(torch.nn.Module):
    """Creates its state on its first call, after a splitting op (as transformers' StaticCache
    makes its later layers' tensors inside the first forward)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.state = None

    def forward(self, x):
        h = self.lin(x) * 2 + 1
        h = mix(h)
        if self.state is None:
            self.state = torch.zeros(4, 8, device=x.device)
        self.state.add_(h[:4])
        return (self.lin(h) + 1).relu(), self.state


@pytest.mark.parametrize("inner", INNERS)
def test_state_a_split_graph_creates_stays_valid_in_the_graphs_that_read_it(device, inner):
    # Issue 31, #1: the state is an output of a recorded piece, in the pool; the next graph
    # reads it in its last piece, and a step that began at that graph's first piece invalidated
    # it ("overwritten ... a new step began"). A split graph now spares its inputs as a whole
    # graph does (Note [Inputs of a split graph]).
    torch.manual_seed(0)
    model = _LazyState().to(device).eval()
    ref = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner=inner, splitting_ops=["graphtrees_test::mix"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(6, 8, generator=gen).to(device)
            out, state = compiled(x)
            want, want_state = ref(x)
            assert_close(out, want)
            assert_close(model.state, ref.state)
    assert info(device)["num_replays"] > 0
