"""torch.compile integration: the "graphtrees" backend, training, generations, shapes, skips."""

import copy
import json
import logging
import os
import re
import sys

import pytest
import torch

import graphtrees

from helpers import assert_close, assert_invariants, assert_replays_ran_programs, cpu_replays, info


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp(device, d_in=8, d_hidden=32, d_out=4):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(), torch.nn.Linear(d_hidden, d_out)
    ).to(device)


def test_backend_is_registered_by_entry_point():
    assert "graphtrees" in torch._dynamo.list_backends(exclude_tags=())


def test_inference_transformer_block_with_string_backend(device):
    torch.manual_seed(0)
    block = (
        torch.nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        .to(device)
        .eval()
    )
    compiled = torch.compile(block, backend="graphtrees")
    x = torch.randn(2, 5, 32, device=device)
    with torch.no_grad():
        ref = block(x)
        for call in range(4):
            assert_close(compiled(x), ref)
            if call == 1:
                nodes_after_recording = info(device)["num_nodes"]
    t = info(device)
    assert t["num_nodes"] == nodes_after_recording >= 1  # the third call recorded nothing new
    assert t["num_replays"] >= 2 and t["num_fallbacks"] == 0


def _assert_same_parameters(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)


def test_training_matches_eager(device):
    model = _mlp(device)
    ref = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner="aot_eager")
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 8, generator=gen).to(device), torch.randn(16, 4, generator=gen).to(device))
        for _ in range(20)
    ]
    recordings = []

    def run(m, f):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = ((f(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            if f is compiled:
                recordings.append(info(device)["num_recordings"])

    run(ref, ref)
    run(model, compiled)
    _assert_same_parameters(model, ref)
    t = info(device)
    nodes = {n["id"]: n for n in t["nodes"]}
    (fwd,) = [n for n in t["nodes"] if n["function"].endswith(".forward")]
    (bwd,) = [n for n in t["nodes"] if n["function"].endswith(".backward")]
    assert bwd["parent"] == fwd["id"] and fwd["parent"] is None
    assert "M" in bwd["input_kinds"]  # saved activations are used in place
    assert recordings[1] == 2 and recordings[-1] == 2  # nothing recorded after the warm-up steps
    assert t["num_replays"] == 2 * 18 and t["num_fallbacks"] == 0
    assert len(nodes) == 2
    assert_replays_ran_programs(device)  # the forward and the backward: recorded ops, no Python


@pytest.mark.parametrize(
    "schedule, micro_batches",
    [
        ("forwards_then_backward", 4),
        ("interleaved", 4),  # F1 B1 F2 B2 ...
        ("forwards_then_backward", 17),
        ("pipeline", 17),  # two forwards in flight: F1 F2 B1 F3 B2 ...
    ],
)
def test_gradient_accumulation_over_micro_batches(device, schedule, micro_batches):
    model = _mlp(device)
    ref = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner="aot_eager")
    gen = torch.Generator().manual_seed(micro_batches)
    steps = [
        [torch.randn(4, 8, generator=gen).to(device) for _ in range(micro_batches)]
        for _ in range(4)
    ]

    def run(m, f):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for micro in steps:
            opt.zero_grad()
            if schedule == "forwards_then_backward":
                torch.stack([f(x).pow(2).mean() for x in micro]).sum().backward()
            elif schedule == "interleaved":
                for x in micro:
                    f(x).pow(2).mean().backward()
            else:
                losses = [f(micro[0]).pow(2).mean()]
                for x in micro[1:]:
                    losses.append(f(x).pow(2).mean())
                    losses.pop(0).backward()
                losses.pop(0).backward()
            opt.step()

    run(ref, ref)
    run(model, compiled)
    _assert_same_parameters(model, ref)
    assert info(device)["num_replays"] > 0
    assert_invariants(device)


def test_graph_break_gives_two_functions_on_one_path(device):
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h) * 2

    m = Broken().to(device)
    compiled = graphtrees.compile(m, inner="aot_eager")
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        ref = m(x)
        for _ in range(4):
            assert_close(compiled(x), ref)
    t = info(device)
    assert t["num_nodes"] == 2 and t["num_roots"] == 1
    (root,) = [n for n in t["nodes"] if n["parent"] is None]
    (child,) = [n for n in t["nodes"] if n["parent"] == root["id"]]
    assert root["replays"] == 2 and child["replays"] == 2
    assert "M" in child["input_kinds"]  # the first graph's output feeds the second in place


def test_shape_changes_beyond_the_bound_evict(device, caplog):
    caplog.set_level(logging.INFO, logger="graphtrees")
    model = _mlp(device).eval()
    compiled = graphtrees.compile(model, inner="aot_eager", dynamic=True, max_recorded_shapes=3)
    reserved = []
    with torch.no_grad():
        for _cycle in range(3):
            for batch in (1, 2, 3, 4, 5, 6):
                x = torch.randn(batch, 8, device=device)
                for _ in range(3):
                    assert_close(compiled(x), model(x))
            reserved.append(info(device)["pool"]["reserved_bytes"])
    t = info(device)
    assert t["num_evictions"] > 0 and "evicted node" in caplog.text
    assert "max_recorded_shapes=3" in caplog.text
    per_graph = {}
    for n in t["nodes"]:
        per_graph.setdefault(n["function"].split("#")[0], []).append(n)
    # Batch 1 gets a specialised graph of its own; the dynamic graph holds at most 3 shapes.
    assert max(len(v) for v in per_graph.values()) == 3
    assert reserved[-1] == reserved[0]  # memory stays bounded


def test_forward_output_held_into_next_step_raises(device):
    model = _mlp(device).eval()
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
        compiled(x)  # the next step replays over `out`
    with pytest.raises(RuntimeError) as e:
        out.sum()
    msg = str(e.value)
    assert (
        "overwritten by a subsequent run" in msg and ".clone()" in msg and "mark_step_begin" in msg
    )


def test_forward_without_backward_does_not_get_stuck(device, caplog):
    caplog.set_level(logging.WARNING, logger="graphtrees")
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(4, 8, device=device)
    for _ in range(150):  # grad mode on, backward never called
        out = compiled(x)
        assert_close(out, model(x))
    assert "backward was pending" in caplog.text
    assert caplog.text.count("backward was pending") == 1
    assert info(device)["num_nodes"] <= 65  # the path restarts after 64 pending runs


def test_mark_step_begin_overrides_pending_backward(device):
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(4, 8, device=device)
    for _ in range(6):
        graphtrees.mark_step_begin()
        out = compiled(x)
    t = info(device)
    assert t["num_nodes"] == 1 and t["num_replays"] == 4
    del out


def test_a_training_loop_without_mark_step_replays_the_same_two_nodes(device, tree_logs):
    # A forward's outputs die after .sum(); its backward reads none of them, and its gradient
    # (a live output of the backward, held by .grad) kept the path going: the next forward used
    # to be recorded under the backward, a new node every other iteration. Once the backwards
    # closed the step's forwards, the next forward starts a new step.
    def foo(x):
        return torch.sin(x * 2) * x

    compiled = graphtrees.compile(foo, inner="aot_eager")
    inp = torch.rand(4, 4, device=device, requires_grad=True)
    ref = inp.detach().clone().requires_grad_()
    for _ in range(8):
        compiled(inp).sum().backward()
        foo(ref).sum().backward()
    assert_close(inp.grad, ref.grad)
    t = info(device)
    assert t["num_nodes"] == 2 and t["num_recordings"] == 2 and t["num_replays"] == 12
    assert "began a new training step (the last one's backward finished)" in tree_logs.text


def test_skip_item_is_logged_with_source_line(device, caplog):
    caplog.set_level(logging.WARNING, logger="graphtrees")

    def f(x):
        s = x.sum().long().item()  # an int: a data-dependent scalar (a float would be tensorified)
        return x * s

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = graphtrees.compile(f, inner="aot_eager")
        x = torch.ones(4, device=device)
        with torch.no_grad():
            for _ in range(3):
                assert_close(compiled(x), x * 4)
    assert "_local_scalar_dense" in caplog.text and "test_compile.py" in caplog.text
    assert info(device)["num_fallbacks"] == 3 and info(device)["num_nodes"] == 0

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        strict = graphtrees.compile(f, inner="aot_eager", strict=True)
        with pytest.raises(Exception, match="cannot record"):
            strict(x)


@pytest.mark.needs_values("nonzero's output shape is read from the device")
def test_skip_data_dependent_shape(device, caplog):
    caplog.set_level(logging.WARNING, logger="graphtrees")

    def f(x):
        return x.nonzero().float().sum() + x

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = graphtrees.compile(f, inner="aot_eager")
        x = torch.tensor([0.0, 1.0, 2.0], device=device)
        with torch.no_grad():
            for _ in range(3):
                assert_close(compiled(x), f(x))
    assert "nonzero" in caplog.text


def test_skip_mutation_of_eager_input_inductor(device, caplog):
    caplog.set_level(logging.WARNING, logger="graphtrees")

    def f(x, y):
        x.add_(1)
        return x * y

    compiled = graphtrees.compile(f, inner="inductor")
    x = torch.zeros(4, device=device)
    y = torch.ones(4, device=device)
    with torch.no_grad():
        for i in range(3):
            out = compiled(x, y)
            assert_close(x, torch.full((4,), float(i + 1), device=device))
            assert_close(out, x)
    assert "mutation of eager input #0" in caplog.text


def test_torch_dynamo_reset_frees_the_trees(device):
    model = _mlp(device).eval()
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    assert info(device)["num_nodes"] == 1
    torch._dynamo.reset()
    t = info(device)
    assert t["num_nodes"] == 0 and t["pool"]["reserved_bytes"] == 0


def test_compile_option_validation():
    with pytest.raises(ValueError, match="inner must be one of"):
        graphtrees.compile(torch.nn.Linear(2, 2), inner="tvm")
    with pytest.raises(TypeError, match="unexpected options"):
        graphtrees.compile(torch.nn.Linear(2, 2), colour="blue")
    with pytest.raises(ValueError, match="max_recorded_shapes"):
        graphtrees.compile(torch.nn.Linear(2, 2), max_recorded_shapes=0)


def test_training_with_graph_break_chains_forwards_then_backwards(device):
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    model = Broken().to(device)
    ref = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        x = torch.randn(4, 8, generator=gen).to(device)
        for _m, f, o in ((model, compiled, opts[0]), (ref, ref, opts[1])):
            o.zero_grad()
            f(x).pow(2).mean().backward()
            o.step()
    _assert_same_parameters(model, ref)
    nodes = info(device)["nodes"]
    by_id = {n["id"]: n for n in nodes}
    (root,) = [n for n in nodes if n["parent"] is None]
    chain, n = [], root
    while True:
        chain.append(n["function"].split(".")[1])
        if not n["children"]:
            break
        (c,) = n["children"]
        n = by_id[c]
    assert chain == ["forward", "forward", "backward", "backward"]
    assert all(n["replays"] == 6 for n in nodes)


def test_backend_string_works_without_importing_graphtrees():
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 4)\n"
        "c = torch.compile(m, backend='graphtrees')\n"
        "x = torch.randn(2, 4)\n"
        "with torch.no_grad():\n"
        "    for _ in range(3):\n"
        "        torch.testing.assert_close(c(x), m(x))\n"
        "import graphtrees\n"
        "print(graphtrees.tree_info('cpu')['num_replays'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "1"


@pytest.mark.parametrize("zero_grad", ["keep_buffers", "accumulate_over_steps"])
def test_gradient_reaching_a_leaf_through_a_view_stays_valid(device, zero_grad):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 16, device=device))
    w_ref = torch.nn.Parameter(w.detach().clone())
    compiled = graphtrees.compile(lambda x, wt: torch.tanh(x @ wt), inner="aot_eager")
    gen = torch.Generator().manual_seed(2)
    data = [torch.randn(4, 16, generator=gen).to(device) for _ in range(6)]

    def run(p, fn):
        opt = torch.optim.SGD([p], lr=0.05)
        for i, x in enumerate(data):
            if zero_grad == "keep_buffers":
                opt.zero_grad(set_to_none=False)
            fn(x, p.t()).pow(2).mean().backward()  # the gradient reaches `p` through a view
            if zero_grad == "keep_buffers" or i % 2 == 1:
                opt.step()
                if zero_grad == "accumulate_over_steps":
                    opt.zero_grad()

    run(w_ref, lambda x, wt: torch.tanh(x @ wt))
    run(w, compiled)
    assert_close(w, w_ref)


def test_shape_churn_beyond_the_bound_keeps_memory_bounded(device):
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner="aot_eager", max_recorded_shapes=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    live = []
    for step in range(30):
        x = torch.randn((2, 3, 5)[step % 3], 8, device=device)
        opt.zero_grad()
        compiled(x).pow(2).mean().backward()
        opt.step()
        live.append(info(device)["live_outputs"])
    assert max(live[10:]) <= max(live[:10]) + 4  # no pile-up of pinned or live outputs
    assert info(device)["generation"] >= 20  # each call is a step


def test_inductor_inner_records_after_a_plain_inductor_compile(device):
    model = _mlp(device).eval()
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        plain = torch.compile(model)
        for _ in range(2):
            plain(x)
        torch._dynamo.reset()
        compiled = graphtrees.compile(model, inner="inductor")
        for _ in range(3):
            assert_close(compiled(x), model(x))
    assert info(device)["num_replays"] == 1


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_sliced_input_keeps_its_strides(device, inner):
    # A copied input's placeholder keeps the strides the compiled graph was made for: a slice
    # such as tokens[:, :-1] (strides (33, 1)) must not become a contiguous copy.
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)).to(device).eval()
    )
    compiled = graphtrees.compile(model, inner=inner)
    with torch.no_grad():
        for _step in range(4):
            tokens = torch.randint(0, 50, (8, 33), device=device)
            assert_close(compiled(tokens[:, :-1]), model(tokens[:, :-1]))
    assert info(device)["num_replays"] >= 2
    if device == "cpu":
        # Inductor's CPU kernels are called outside the dispatcher: its graphs re-run on replay.
        assert set(cpu_replays(device)) == {"python" if inner == "inductor" else "program"}


def test_modes_torch_compile_users_pass_are_accepted(device, caplog):
    # HF's CompileConfig passes mode="reduce-overhead" by default: it means what graphtrees does.
    caplog.set_level(logging.INFO, logger="graphtrees")
    graphtrees._dynamo_backend._logged_modes.clear()
    model = _mlp(device)
    x = torch.randn(2, 8, device=device)
    for compiled in (
        torch.compile(model, backend="graphtrees", mode="reduce-overhead"),
        graphtrees.compile(model, inner="aot_eager", mode="reduce-overhead"),
        torch.compile(model, backend="graphtrees", mode="default"),
    ):
        graphtrees.reset()
        with torch.no_grad():
            for _ in range(4):
                assert_close(compiled(x), model(x))
        assert info(device)["num_replays"] >= 2
    assert caplog.text.count("graphtrees records the CUDA graphs itself") == 1  # once per mode
    # The autotuning modes select Inductor's autotuning, never Inductor's own cudagraphs.
    opts = graphtrees._dynamo_backend._mode_options("max-autotune", "inductor")
    assert opts["max_autotune"] is True and "triton.cudagraphs" not in opts
    assert graphtrees._dynamo_backend._mode_options("max-autotune-no-cudagraphs", "inductor")
    with pytest.raises(TypeError, match="use inner='inductor'"):
        graphtrees.compile(model, inner="aot_eager", mode="max-autotune")
    with pytest.raises(TypeError, match="unknown torch.compile mode 'fastest'"):
        graphtrees.compile(model, mode="fastest")
    with torch.no_grad(), pytest.raises(Exception, match="unknown torch.compile mode"):
        torch.compile(model, backend="graphtrees", mode="fastest")(x)
    with pytest.raises(ValueError, match="inner_options must be a dict"):
        graphtrees.compile(model, inner="aot_eager", inner_options={"max_autotune": True})


def test_autotuning_mode_reaches_the_inner_compiler(device, monkeypatch):
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(*args, **kwargs):
        seen.append(kwargs.get("config_patches"))
        return real(*args, **{**kwargs, "config_patches": None})  # no autotuning run here

    monkeypatch.setattr(cfx, "compile_fx", spy)
    model = _mlp(device)
    x = torch.randn(2, 8, device=device)
    compiled = torch.compile(model, backend="graphtrees", mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    assert seen[0]["max_autotune"] is True and "triton.cudagraphs" not in seen[0]


def test_inductor_options_reach_the_inner_compiler(device, monkeypatch):
    import torch._inductor.compile_fx as cfx

    seen = []
    real = cfx.compile_fx

    def spy(*args, **kwargs):
        seen.append(kwargs.get("config_patches"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner_options={"freezing": False, "max_fusion_size": 32})
    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert_close(compiled(x), model(x))
    # (compile_fx applies its patches, then calls itself without them.)
    assert seen and seen[0] == {"freezing": False, "max_fusion_size": 32}
    before = len(seen)
    via_torch = torch.compile(model, backend="graphtrees", options={"max_fusion_size": 16})
    with torch.no_grad():
        assert_close(via_torch(x), model(x))
    assert {"max_fusion_size": 16} in seen[before:]


def test_training_after_an_eager_graph_replays_every_step(device, caplog):
    # The first graph cannot be recorded (.item() on an int; piecewise=False keeps it whole)
    # and runs eagerly; the graph after the break must still be recorded once and replayed at
    # every step. Counted as a forward waiting for its backward, the eager forward would hold
    # the path open into the next step, and the second graph would be warmed up again at every
    # step instead. (test_piecewise.py splits such graphs.)
    caplog.set_level(logging.WARNING, logger="graphtrees")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):
            h = self.a(x) * (x.abs().sum().long().item() % 3 + 1)
            torch._dynamo.graph_break()
            return self.b(torch.relu(h))

    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    steps = 8
    gen = torch.Generator().manual_seed(4)
    data = [torch.randn(4, 8, generator=gen).to(device) for _ in range(steps)]
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = graphtrees.compile(model, inner="aot_eager", piecewise=False)
        for m, f in ((ref, ref), (model, compiled)):
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            for x in data:
                opt.zero_grad()
                f(x).pow(2).mean().backward()
                opt.step()
    _assert_same_parameters(model, ref)
    eager = set(re.findall(r"running '(graph\d+)\.forward' eagerly", caplog.text))
    assert len(eager) == 1 and "_local_scalar_dense" in caplog.text
    # (The first graph's backward reads the int as an input: it is recorded, once per value.)
    nodes = [n for n in info(device)["nodes"] if n["function"].split(".")[0] not in eager]
    assert len({n["function"].split(".")[0] for n in nodes}) == 1  # the second graph
    assert sorted(n["function"].split(".")[1] for n in nodes) == ["backward", "forward"]
    assert all(n["replays"] == steps - 2 for n in nodes), nodes


def test_a_forward_that_turned_eager_does_not_hold_the_step_open(device):
    # A forward whose parameter moves every step re-records until rerecord_limit, then runs
    # eagerly. An eager forward saved nothing in the pool, so no backward waits for it: each
    # step still starts a new path instead of growing one path for 64 runs.
    torch.manual_seed(0)
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner="aot_eager", rerecord_limit=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _step in range(24):
        model[0].weight.data = model[0].weight.data.clone()  # a new address every step
        x = torch.randn(4, 8, device=device)
        opt.zero_grad()
        compiled(x).pow(2).mean().backward()
        opt.step()
    t = info(device)
    assert t["generation"] >= 20
    # The recordings made before the forward turned eager, not one more per step (24 steps).
    assert t["num_nodes"] <= 8 and not t["pending_backward"]


_COUNT_BREAKS = """
import json, sys, warnings
import torch, transformers
if sys.argv[1] == "1":
    import graphtrees  # noqa: F401
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                               max_position_embeddings=64)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval()


class Sliced(torch.nn.Module):  # a forward that slices a ModuleList registers submodules
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with torch.no_grad():
        a = torch._dynamo.explain(model)(torch.randint(0, 64, (1, 8)))
        b = torch._dynamo.explain(Sliced())(torch.randn(2, 8))
print(json.dumps([a.graph_count, a.graph_break_count, b.graph_count, b.graph_break_count,
                  [str(w.message)[:200] for w in caught if "graphtrees" in str(w.message)]]))
"""


def test_importing_graphtrees_changes_nothing_for_torch_compile():
    # Code that does not use graphtrees compiles to the same graphs, with no break and no
    # warning, whether graphtrees was imported or not (issue: its module hooks broke graphs).
    pytest.importorskip("transformers")
    import subprocess
    import sys

    def counts(with_import):
        r = subprocess.run(
            [sys.executable, "-c", _COUNT_BREAKS, "1" if with_import else "0"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    without, with_ = counts(False), counts(True)
    assert with_ == without
    assert with_[1] == 0 and with_[3] == 0 and with_[4] == []


def test_backwards_of_eager_forwards_run_in_the_callers_tree(device, tree_logs):
    # Found on the CUDA stand-in: autograd runs CUDA backwards on a device thread of its own; a
    # backward whose forward ran eagerly (nothing of the tree to read) got a tree and a pool of
    # its own there, whose steps never begin. It counts as the thread that called backward().
    model = _mlp(device)
    compiled = graphtrees.compile(model, inner="aot_eager", max_recorded_shapes=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(9):
        x = torch.randn((2, 3, 5)[step % 3], 8, device=device)  # 3 shapes: one runs eagerly
        opt.zero_grad()
        compiled(x).pow(2).mean().backward()
        opt.step()
    assert tree_logs.text.count(f"created the {torch.device(device).type}") == 1, tree_logs.text


def test_a_compiled_replay_runs_no_python_of_graphtrees(device):
    # Note [The boxed call in C++]: AOTAutograd calls the recorded graph as compiled_fn(args); a
    # replay goes from its runtime wrapper straight into C++, with no frame of graphtrees' own.
    def f(x):
        return torch.relu(x * 2 + 1)

    # aot_eager: a CPU replay then runs the recorded ops from C++ (Inductor's CPU kernels are not
    # dispatcher ops, and the CPU backend replays them by running the compiled function).
    compiled = graphtrees.compile(f, inner="aot_eager")
    x = torch.randn(16, device=device)
    frames = []

    def profiler(frame, event, arg):
        if event == "call":
            frames.append(frame.f_code.co_filename)

    with torch.no_grad():
        for _ in range(3):  # warm up, record, replay
            compiled(x)
        replays = info(device)["num_replays"]
        sys.setprofile(profiler)
        try:
            out = compiled(x)
        finally:
            sys.setprofile(None)
    assert info(device)["num_replays"] == replays + 1
    assert_close(out, f(x))
    package = os.path.dirname(graphtrees.__file__)
    ours = [path for path in frames if os.path.abspath(path).startswith(package)]
    assert frames and not ours, ours


def test_the_boxed_call_takes_a_list_and_empties_it(device):
    graphed = graphtrees._C.GraphedCallable(lambda a, b: a * b + 1, {}, None, "boxed")
    boxed = graphtrees._C.BoxedCall(graphed)
    assert boxed._boxed_call is True  # AOTAutograd's mark of the boxed convention
    a, b = torch.randn(4, device=device), torch.randn(4, device=device)
    with torch.no_grad():
        for _ in range(3):
            inputs = [a, b]
            assert_close(boxed(inputs), a * b + 1)
            assert inputs == []  # the callee owns the inputs, as AOTAutograd expects
    with pytest.raises(TypeError, match="one list"):
        boxed((a, b))
