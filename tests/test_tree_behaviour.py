"""The behaviour suite: runs on every device graphtrees has a backend for (cpu always, cuda when a
GPU is present). Many tests port PyTorch's direct-API tree tests (test/inductor/
test_cudagraph_trees.py) to graphtrees' API; the comments name the original."""

import copy
import gc
import logging
import sys
import time

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import (
    assert_close,
    assert_invariants,
    assert_overwritten,
    info,
    pool_allocated_blocks,
)

pytestmark = pytest.mark.usefixtures("no_grad")


def test_warmup_record_replay_counts(device):
    calls = []

    def f(x, y):
        calls.append(1)
        return x * y + 1

    g = cudagraphify(f)
    x, y = torch.randn(8, device=device), torch.randn(8, device=device)
    kinds = []
    for _ in range(4):
        before = dict(info(device))
        out = g(x, y)
        assert_close(out, x * y + 1)
        after = info(device)
        for k in ("num_warmups", "num_recordings", "num_replays"):
            if after[k] > before.get(k, 0):
                kinds.append(k)
    assert kinds == ["num_warmups", "num_recordings", "num_replays", "num_replays"]
    assert len(calls) == 2  # a replay runs no Python, on CPU as on CUDA (Note [CPU graphs])
    assert info(device)["num_nodes"] == 1 and info(device)["num_roots"] == 1


def test_replay_sees_new_input_values(device):
    g = cudagraphify(lambda x: (x.sin() * 2, x.cos()))
    for _i in range(5):
        x = torch.randn(16, 16, device=device)
        a, b = g(x)
        assert_close(a, x.sin() * 2)
        assert_close(b, x.cos())
    assert info(device)["num_replays"] == 3


def test_result_structure_is_preserved(device):
    def f(d, scale, *, bias):
        return {"sum": d["a"] + d["b"], "pair": (d["a"] * scale, None), "k": [bias, 3, "s"]}

    g = cudagraphify(f)
    for _ in range(3):
        a, b = torch.randn(4, device=device), torch.randn(4, device=device)
        bias = torch.ones(4, device=device)
        out = g({"a": a, "b": b}, 2.0, bias=bias)
        assert set(out) == {"sum", "pair", "k"}
        assert_close(out["sum"], a + b)
        assert_close(out["pair"][0], a * 2.0)
        assert out["pair"][1] is None
        assert out["k"][1:] == [3, "s"]
        assert_close(out["k"][0], bias)


def test_namedtuple_arguments_and_results(device):
    from collections import namedtuple

    Pair = namedtuple("Pair", ["left", "right"])
    g = cudagraphify(lambda p: Pair(p.left + p.right, p.left - p.right))
    for _ in range(3):
        p = Pair(torch.randn(3, device=device), torch.randn(3, device=device))
        out = g(p)
        assert isinstance(out, Pair)
        assert_close(out.left, p.left + p.right)


def test_new_signature_is_a_new_function(device):
    # Port of test_dynamic_warmup: a new shape or a new non-tensor value warms up and records
    # again, as a separate function.
    g = cudagraphify(lambda i, x: x * i)
    for n in (2, 3):
        x = torch.randn(n, device=device)
        for _ in range(3):
            assert_close(g(n, x), x * n)
    t = info(device)
    assert (t["num_warmups"], t["num_recordings"], t["num_replays"]) == (2, 2, 2)
    assert t["num_roots"] == 2
    assert len(g.signatures()) == 2


def test_decorator_forms(device):
    @cudagraphify
    def a(x):
        return x + 1

    @cudagraphify(warmup_iters=2)
    def b(x):
        return x + 2

    x = torch.zeros(2, device=device)
    for _ in range(4):
        assert_close(a(x), x + 1)
        assert_close(b(x), x + 2)
    assert a.__name__ == "a" and b.__wrapped__.__name__ == "b"
    (sig,) = b.signatures()
    assert sig["name"].endswith("b") and sig["warmups"] == 2


def test_module_parameters_are_static_and_used_in_place(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(
        device
    )
    g = cudagraphify(m)
    x = torch.randn(5, 8, device=device)
    for _ in range(3):
        assert_close(g(x), m(x))
    # In-place parameter update: the graph reads the parameters in place.
    m[0].weight.add_(0.5)
    assert_close(g(x), m(x))
    assert info(device)["num_rerecords"] == 0
    # A replaced parameter (new address) records again; the old parameter is gone, so its
    # recording could never replay and is replaced (Note [Recordings that can never replay]).
    recordings = info(device)["num_recordings"]
    m[2].weight = torch.nn.Parameter(torch.randn(4, 16, device=device))
    assert_close(g(x), m(x))
    assert_close(g(x), m(x))
    t = info(device)
    assert t["num_recordings"] == recordings + 1 and t["num_nodes"] == 1
    assert t["num_rerecords"] == 0


def test_static_argnums_address_change_rerecords_then_falls_back(device, tree_logs):
    g = cudagraphify(lambda w, x: x @ w, static_argnums=(0,), rerecord_limit=2)
    x = torch.randn(3, 4, device=device)
    w = torch.randn(4, 4, device=device)
    for _ in range(3):
        assert_close(g(w, x), x @ w)
    kept = [w]  # each old weight stays alive: real churn, counted (one that died is replaced)
    for _i in range(4):
        w = torch.randn(4, 4, device=device)  # new address each time
        kept.append(w)
        assert_close(g(w, x), x @ w)
    t = info(device)
    assert t["num_rerecords"] == 2  # the third address change exceeds the limit: eager
    assert t["num_fallbacks"] >= 1
    assert (
        "rerecord_limit=2" in tree_logs.text and "static input 0 changed address" in tree_logs.text
    )
    (sig,) = g.signatures()
    assert "re-recorded" in sig["eager_reason"]


def test_output_aliasing_input(device):
    # Port of test_output_alias: outputs that alias an input stay views of the caller's input.
    inp = torch.randn(20, 20, device=device)
    g = cudagraphify(lambda x: (x, x[0]))
    for _ in range(3):
        out_1, out_2 = g(inp)
        assert out_1.untyped_storage()._cdata == out_2.untyped_storage()._cdata
        assert out_1.untyped_storage()._cdata == inp.untyped_storage()._cdata
        assert_close(out_2, inp[0])
        del out_1, out_2
        assert info(device)["live_outputs"] == 0


def test_output_aliasing_static_parameter(device):
    # Port of test_aliased_static_parameter.
    inp = torch.randn(20, 20, device=device)
    g = cudagraphify(lambda x: (x[0],), static_argnums=(0,))
    for _ in range(3):
        (out,) = g(inp)
        assert inp.untyped_storage()._cdata == out.untyped_storage()._cdata
    assert info(device)["live_outputs"] == 0


def test_outputs_sharing_storage(device):
    # Port of test_checkpoint_shared_output_storage_deallocation.
    def f(x):
        y = x * 2
        return y[0], y[1]

    g = cudagraphify(f)
    h = cudagraphify(lambda x: (x * x)[0])
    inp = torch.rand(2, 2, device=device)
    for _ in range(3):
        x1, x2 = g(inp)
    # h is warmed and recorded after g's replays while x1, x2 are alive: the pool is restored to
    # g's checkpoint each time.
    h(x1)
    mark_step_begin()
    x1, x2 = g(inp)
    h(x1)
    assert info(device)["num_checkpoints"] == 2
    assert x1.untyped_storage().data_ptr() == x2.untyped_storage().data_ptr()
    assert_close(x1, inp[0] * 2)
    assert pool_allocated_blocks(device) == 1  # x1/x2's one block; h's output died
    del x1
    assert pool_allocated_blocks(device) == 1
    del x2
    assert pool_allocated_blocks(device) == 0


def test_tensor_dies_between_checkpoint(device):
    # Port of test_tensor_dies_between_checkpoint and test_aliased_output_checkpoint: outputs that
    # die between a replay and the next recording are freed by the restore, exactly once.
    def f(x):
        y = x + 2
        return x + 1, y, y[0]

    g = cudagraphify(f)
    h = cudagraphify(lambda x: x * x * x)
    inp = torch.rand(4, 4, device=device)
    for _ in range(3):
        g(inp)
    h(g(inp)[0])  # h's warmup: checkpoint 1
    mark_step_begin()
    out1, out2, out3 = g(inp)
    del out2, out3
    assert info(device)["num_checkpoints"] == 1
    x = h(out1)  # h's recording: checkpoint 2 frees out2/out3's shared block
    assert info(device)["num_checkpoints"] == 2
    assert_close(x, (inp + 1) ** 3)
    assert pool_allocated_blocks(device) == 2  # out1 and x
    del x
    assert pool_allocated_blocks(device) == 1
    del out1
    assert pool_allocated_blocks(device) == 0


def test_tensor_no_longer_in_pool_rerecords(device):
    # Port of test_tensor_no_longer_in_pool: a managed input replaced by an eager tensor records
    # a second child under the same parent, after a checkpoint.
    g = cudagraphify(lambda x: (x + 1, x + 2))
    h = cudagraphify(lambda x: x * x * x)
    inp = torch.rand(4, device=device)
    for _ in range(2):
        x1, x2 = g(inp)
        h(x1)
    del x1, x2
    assert info(device)["num_checkpoints"] == 0
    x1, x2 = g(inp)
    out = h(torch.zeros_like(x1))
    assert_close(out, torch.zeros_like(x1))
    t = info(device)
    assert t["num_checkpoints"] == 1
    assert t["num_rerecords"] == 1
    (root,) = [n for n in t["nodes"] if n["parent"] is None]
    assert len(root["children"]) == 2


@pytest.mark.needs_values("the step branches on a value computed on the device (.item() > 0)")
def test_live_outputs_over_several_graphs_checkpoint_counts(device):
    # Port of test_live_outputs_multiple_graphs: three functions on one path, the third only on
    # some inputs; warming it up and then recording it each restore the pool once.
    g1 = cudagraphify(lambda x: ((x + x + x), (x + x + x) + 1))
    g2 = cudagraphify(lambda x: (x * x).sum())
    g3 = cudagraphify(lambda y: y + 1)

    def step(x):
        x3, y = g1(x)
        if g2(x3).item() > 0:
            return g3(y)
        return y

    for _ in range(2):
        step(torch.zeros(5, device=device))
    assert info(device)["num_checkpoints"] == 0
    for _ in range(2):
        out = step(torch.ones(5, device=device))
        assert_close(out, torch.full((5,), 5.0, device=device))
    assert pool_allocated_blocks(device) == 1
    del out
    assert pool_allocated_blocks(device) == 0
    assert info(device)["num_checkpoints"] == 2


def test_chained_calls_of_one_function_in_a_step(device):
    # Port of test_function_compiled_multiple_times: the same function called twice in one step
    # on its own output is a chain of two nodes, not a new step.
    a = cudagraphify(lambda x: x * x * x)
    b = cudagraphify(lambda y, z: y + z)

    def step(x):
        y = a(x)
        y2 = a(y)
        return b(y, y2)

    x = torch.rand(4, 4, device=device)
    ref = x**3 + x**9
    for _ in range(4):
        assert_close(step(x), ref)
    t = info(device)
    assert t["num_roots"] == 1 and t["num_nodes"] == 3
    (root,) = [n for n in t["nodes"] if n["parent"] is None]
    assert len(root["children"]) == 1


def test_end_recording_early(device):
    # Port of test_end_recording_early: when every output of the current path is dead, a root
    # function starts a new path instead of becoming a child.
    g1 = cudagraphify(lambda x: x * x * x)
    g2 = cudagraphify(lambda x, y: x + y)
    g3 = cudagraphify(lambda x: x + 4)
    for _ in range(3):
        x = torch.ones(4, 4, device=device)
        out = g2(x, g1(x))
        del out
        out = g3(x)
        del out
    roots = [n for n in info(device)["nodes"] if n["parent"] is None]
    assert sorted(len(r["children"]) for r in roots) == [0, 1]


def test_mark_step_starts_from_root(device):
    # Port of test_mark_step.
    g = cudagraphify(lambda x: x * x * x)
    mark_step_begin()
    out = g(torch.rand(4, 4, device=device))
    mark_step_begin()
    out = g(torch.rand(4, 4, device=device))
    assert info(device)["num_recordings"] == 1
    assert info(device)["num_roots"] == 1
    assert_close(out, out)  # the newest output is valid


def test_error_on_use_after_overwrite(device):
    # Port of test_error_on_dealloc_use / test_error_on_dealloc_use2, plus replay after replay,
    # which PyTorch's trees overwrite silently.
    g = cudagraphify(lambda x: x * x * x)
    inp = torch.rand(4, device=device)
    out = g(inp)  # warmup
    detached = g(inp).detach()  # recording; `out` belonged to the previous step
    assert_overwritten(out)
    out2 = g(inp)  # replay: overwrites the recording's output
    assert_overwritten(detached)
    assert_close(out2, inp**3)
    out3 = g(inp)  # replay after replay of the same node
    assert_overwritten(out2)
    assert_close(out3, inp**3)
    keep = out3.clone()
    g(inp)
    assert_close(keep, inp**3)
    assert info(device)["num_invalidations"] >= 3


def test_overwritten_message_names_the_functions(device):
    g = cudagraphify(lambda x: x + 1)
    inp = torch.rand(3, device=device)
    for _ in range(3):
        out = g(inp)
    mark_step_begin()
    g(inp)
    with pytest.raises(RuntimeError) as e:
        out.tolist()
    assert "<lambda>" in str(e.value) and "mark_step_begin" in str(e.value)
    assert ".clone()" in str(e.value) and 'on_overwrite="copy"' in str(e.value)  # both remedies


def test_outputs_not_overwritten_stay_valid(device):
    # Outputs of earlier calls in the same step are never overwritten by later calls.
    g1 = cudagraphify(lambda x: x.exp())
    g2 = cudagraphify(lambda x: x.log1p() * 3)
    g3 = cudagraphify(lambda x: x.sqrt() + 1)
    x = torch.rand(32, 32, device=device)
    for branch in (g2, g3, g2, g3, g2, g3):
        for _ in range(3):
            mark_step_begin()
            a = g1(x)
            b = branch(a)
            c = g3(b) if branch is g2 else g2(b)
            assert_close(a, x.exp())
            assert_close(b, branch.__wrapped__(x.exp()))
            assert_close(c, (g3 if branch is g2 else g2).__wrapped__(b))
            assert_invariants(device)


def test_exception_in_warmup_and_recording_leaves_tree_intact(device):
    state = {"fail": False}

    class Boom(ValueError):
        pass

    def f(x):
        y = x * 2  # allocates in the pool before failing
        if state["fail"]:
            raise Boom("boom at call")
        return y + 1

    g = cudagraphify(f)
    x = torch.rand(64, device=device)
    state["fail"] = True
    with pytest.raises(Boom, match="boom at call"):
        g(x)  # warmup fails
    t = info(device)
    assert t["pool"]["allocated_blocks"] == 0 and t["num_warmups"] == 0
    state["fail"] = False
    assert_close(g(x), x * 2 + 1)  # warmup
    state["fail"] = True
    with pytest.raises(Boom):
        g(x)  # recording fails
    t = info(device)
    assert t["num_nodes"] == 0 and t["pool"]["allocated_blocks"] == 0
    assert_invariants(device)
    state["fail"] = False
    for _ in range(3):
        assert_close(g(x), x * 2 + 1)
    assert info(device)["num_nodes"] == 1


def test_autograd_calls_run_eagerly_with_logged_reason(device, tree_logs):
    lin = torch.nn.Linear(4, 4).to(device)
    g = cudagraphify(lin)
    x = torch.randn(2, 4, device=device)
    with torch.enable_grad():
        for _ in range(3):
            out = g(x)
            assert out.requires_grad
            out.sum().backward()
    assert lin.weight.grad is not None
    assert info(device)["num_fallbacks"] == 3
    assert info(device)["num_nodes"] == 0
    assert tree_logs.text.count("needs autograd") == 1  # logged once


def test_inputs_on_several_devices_fall_back(tree_logs):
    if not torch.cuda.is_available():
        # Meta tensors are another device without a backend: same rule.
        g = cudagraphify(lambda a, b: a.sum() + b.sum())
        a = torch.ones(2)
        b = torch.ones(2, device="meta")
        out = g(a, b)
        assert out.device.type == "meta"
        assert "several devices" in tree_logs.text
    else:
        g = cudagraphify(lambda a, b: a.cpu() + b)
        a, b = torch.ones(2, device="cuda"), torch.ones(2)
        out = g(a, b)
        assert_close(out, a.cpu() + b)  # 2.0 on a GPU; on the stand-in, whatever `a` holds
        assert "several devices" in tree_logs.text


def test_unsupported_arguments_fall_back(device, tree_logs):
    class Opaque:
        __hash__ = None  # unhashable

    g = cudagraphify(lambda x, o: x + 1)
    x = torch.ones(3, device=device)
    assert_close(g(x, Opaque()), x + 1)
    assert "unhashable type 'Opaque'" in tree_logs.text
    h = cudagraphify(lambda: torch.ones(2))
    assert_close(h(), torch.ones(2))
    assert "no tensor arguments" in tree_logs.text


@pytest.mark.needs_values("reads the values a replay wrote back")
def test_inplace_mutation_of_a_copied_input_is_written_back(device, tree_logs):
    # Note [Copied inputs written back]: the caller's tensor gets what eager leaves in it.
    def f(x, y):
        x.add_(y)
        return x * 2

    g = cudagraphify(f)
    x = torch.zeros(4, device=device)
    for i in range(5):
        out = g(x, torch.ones(4, device=device))
        assert_close(x, torch.full((4,), float(i + 1), device=device))
        assert_close(out, x * 2)
    assert info(device)["num_nodes"] == 1 and info(device)["num_replays"] == 3
    assert "1 written back" in tree_logs.text
    # Another tensor each call, and a view: each gets its own values back.
    for _ in range(3):
        base = torch.zeros(3, 4, device=device)
        g(base[1], torch.full((4,), 2.0, device=device))
        assert_close(
            base, torch.stack([torch.zeros(4), torch.full((4,), 2.0), torch.zeros(4)]).to(device)
        )


@pytest.mark.parametrize("how", ["copy_", "slice"])
def test_a_copy_into_a_copied_input_is_written_back(device, tree_logs, how):
    # The same as above with mutations that are copies, which move bytes on the CUDA stand-in too:
    # the CUDA write-back runs there. Values are read through .cpu(), a copy; y is static, updated
    # by host copies (a replay fills placeholders with a _foreach_copy_ kernel, which the stand-in
    # does not execute).
    def f(x, y):
        if how == "copy_":
            x.copy_(y)
        else:
            x[1:] = y[1:]
        return x.clone()

    g = cudagraphify(f, static_argnums=(1,))
    x = torch.zeros(4).to(device)
    y = torch.zeros(4).to(device)
    for i in range(5):
        y.copy_(torch.full((4,), float(i + 1)))
        out = g(x, y)
        want = [float(i + 1)] * 4 if how == "copy_" else [0.0] + [float(i + 1)] * 3
        assert x.cpu().tolist() == want
        assert out.cpu().tolist() == want
    assert info(device)["num_nodes"] == 1 and info(device)["num_replays"] == 3
    assert "1 written back" in tree_logs.text
    y.copy_(torch.full((4,), 2.0))
    for _ in range(3):  # another tensor each call, and a view: each gets its own values back
        base = torch.zeros(3, 4).to(device)
        g(base[1], y)
        row = [2.0] * 4 if how == "copy_" else [0.0, 2.0, 2.0, 2.0]
        assert base.cpu().tolist() == [[0.0] * 4, row, [0.0] * 4]


def test_inplace_mutation_of_an_input_sharing_memory_with_another_falls_back(device, tree_logs):
    def f(x, part):
        part.add_(1)
        return x * 2

    g = cudagraphify(f)
    x = torch.zeros(4, device=device)
    for i in range(4):
        out = g(x, x[:2])
        assert_close(x[:2], torch.full((2,), float(i + 1), device=device))
        assert_close(out, x * 2)
    # x and x[:2] share a version counter: either may be named, with the other as the reason.
    assert "mutates its input tensor #" in tree_logs.text
    assert "cannot be written back into it (it shares its memory with input #" in tree_logs.text
    assert info(device)["num_nodes"] == 0


@pytest.mark.parametrize("how", ["add_", "out=", "view"])
def test_inplace_mutation_of_an_inference_tensor_is_detected(device, tree_logs, how):
    # Inference tensors have no version counter; the ops' schemas tell the warmup instead.
    def f(x):
        if how == "add_":
            x.add_(1)
        elif how == "out=":
            torch.add(x, 1, out=x)
        else:
            x[:2].mul_(3)
        return x * 2

    g = cudagraphify(f)
    with torch.inference_mode():
        x = torch.zeros(4, device=device)
        expected = torch.zeros(4, device=device)
        for _ in range(4):
            out = g(x)
            f(expected)
            assert_close(x, expected)
            assert_close(out, expected * 2)
    assert "mutates its input tensor #0 in place" in tree_logs.text
    assert info(device)["num_nodes"] == 0


def test_inplace_mutation_of_static_input_is_graphed(device):
    def f(buf, x):
        buf.add_(x)
        return buf * 1

    g = cudagraphify(f, static_argnums=(0,))
    buf = torch.zeros(4, device=device)
    x = torch.ones(4, device=device)
    for _i in range(5):
        out = g(buf, x)
    assert_close(buf, torch.full((4,), 5.0, device=device))
    assert_close(out, buf)
    assert info(device)["num_replays"] == 3


def test_changing_non_tensor_results_raise_then_run_eagerly(device):
    counter = {"n": 0}

    def f(x):
        counter["n"] += 1
        return x + 1, counter["n"]

    g = cudagraphify(f)
    x = torch.zeros(2, device=device)
    g(x)  # warmup returns (.., 1)
    with pytest.raises(RuntimeError, match="non-tensor values|returned"):
        g(x)  # recording returns (.., 2): cannot be graphed
    out, n = g(x)  # eager from now on
    assert n == counter["n"]
    (sig,) = g.signatures()
    assert "non-tensor results change" in sig["eager_reason"]


def test_unsupported_result_type_runs_eagerly_with_the_reason(device, tree_logs):
    # A result graphtrees cannot rebuild (a set here; transformers' DynamicCache in real life)
    # makes the function eager, like an argument it cannot graph: it never raises.
    g = cudagraphify(lambda x: {"sum": x + 1, "kinds": {1, 2}})
    x = torch.ones(3, device=device)
    for _ in range(4):
        out = g(x)
        assert_close(out["sum"], x + 1)
        assert out["kinds"] == {1, 2}
    (sig,) = g.signatures()
    assert "returned a value of type 'set'" in sig["eager_reason"]
    assert tree_logs.text.count("returned a value of type 'set'") == 1  # logged once
    assert info(device)["num_nodes"] == 0
    assert_invariants(device)


def test_nested_graphed_calls_run_inside_the_outer_run(device):
    inner = cudagraphify(lambda x: x * 3)
    outer = cudagraphify(lambda x: inner(x) + 1)
    x = torch.rand(4, device=device)
    for _ in range(4):
        assert_close(outer(x), x * 3 + 1)
    assert info(device)["num_nodes"] == 1


@pytest.mark.needs_values("verify=True compares the replay's values with an eager run's")
def test_a_verified_replay_runs_nested_graphed_calls_eagerly(device):
    # Review 4, #6: the verifier's eager run was outside the call-depth guard, so the nested
    # call became a top-level call of the locked tree: recorded under the outer node, advancing
    # the path, its replays free to overwrite memory.
    inner = cudagraphify(lambda x: x * 2)
    outer = cudagraphify(lambda x: inner(x) + 1, verify=True)
    x = torch.ones(8, device=device)
    for _ in range(5):
        assert_close(outer(x), x * 2 + 1)
    t = info(device)
    (outer_signature,) = outer.signatures()
    # One node, outer's: the nested call was never recorded (nor warmed up) on its own.
    assert [n["function"] for n in t["nodes"]] == [outer_signature["name"]]
    assert t["num_nodes"] == 1 and t["num_replays"] == 3
    assert inner.signatures() == []  # every call of inner ran inside outer's run, eagerly


def test_method_decorator(device):
    class Model:
        def __init__(self):
            self.scale = 3.0

        @cudagraphify
        def forward(self, x):
            return x * self.scale

    m = Model()
    x = torch.ones(2, device=device)
    for _ in range(3):
        assert_close(m.forward(x), x * 3)


def test_reset_invalidates_live_outputs_and_frees_the_pool(device):
    g = cudagraphify(lambda x: x + 1)
    x = torch.rand(128, device=device)
    for _ in range(3):
        out = g(x)
    assert info(device)["pool"]["reserved_bytes"] > 0
    graphtrees.reset()
    t = info(device)
    assert t["num_nodes"] == 0 and t["pool"]["reserved_bytes"] == 0 and t["nodes"] == []
    assert_overwritten_or_freed(out)
    # The wrapper works again: warmup, record, replay.
    for _ in range(3):
        assert_close(g(x), x + 1)
    assert info(device)["num_recordings"] == 1


def assert_overwritten_or_freed(t):
    with pytest.raises(RuntimeError, match="overwritten|reset"):
        t.sum()


def test_tree_info_without_tree_has_all_keys(device):
    t = info(device)
    for key in (
        "device",
        "num_nodes",
        "num_roots",
        "num_checkpoints",
        "num_rerecords",
        "num_fallbacks",
        "pool",
        "nodes",
    ):
        assert key in t
    assert t["num_nodes"] == 0 and t["nodes"] == [] and t["pool"]["reserved_bytes"] == 0
    assert "digraph" in graphtrees.tree_to_dot(device)


def test_tree_info_is_json_and_dot_marks_live_outputs(device):
    import json

    g1 = cudagraphify(lambda x: x + 1)
    g2 = cudagraphify(lambda x: x * 2)
    x = torch.rand(4, device=device)
    for _ in range(3):
        mark_step_begin()
        a = g1(x)
        b = g2(a)
    t = json.loads(json.dumps(info(device)))
    ids = {n["id"]: n for n in t["nodes"]}
    (root,) = [n for n in t["nodes"] if n["parent"] is None]
    (child,) = root["children"]
    assert ids[child]["parent"] == root["id"] and ids[child]["function"].endswith("<lambda>")
    dot = graphtrees.tree_to_dot(device)
    assert f"n{root['id']} -> n{child}" in dot
    assert "live outputs: 1" in dot and "fillcolor" in dot
    del a, b


def test_logging_of_recording_and_checkpoints(device, tree_logs):
    g1 = cudagraphify(lambda x: x + 1)
    g2 = cudagraphify(lambda x: x * 2)
    x = torch.rand(4, device=device)
    for _ in range(3):
        a = g1(x)
    g2(a)
    mark_step_begin()
    a = g1(x)
    g2(a)
    text = tree_logs.text
    assert "warmed up '" in text and "recorded node" in text
    assert "restored the pool to the checkpoint" in text
    levels = {r.levelno for r in tree_logs.records if r.name == "graphtrees"}
    assert logging.INFO in levels and logging.DEBUG in levels


def _run_threads(target, args_per_thread):
    """Runs target(*args) on one thread per entry, switching threads as often as Python allows,
    and waits for all of them."""
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=target, args=args) for args in args_per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def test_a_fallback_makes_no_tree_only_to_count_itself(device):
    # A call that cannot be graphed (no tensor argument on the device, here one that requires
    # grad under grad mode) is counted without making a tree, a pool or a CUDA stream for it.
    g = cudagraphify(lambda x: x * 2)
    x = torch.ones(3, device=device, requires_grad=True)
    with torch.enable_grad():
        g(x)
        g(x)
    t = info(device)
    assert t["backend"] is None and t["num_fallbacks"] == 2
    with torch.no_grad():
        g(x)  # graphed: the tree made now starts with the count
    t = info(device)
    assert t["backend"] is not None and t["num_fallbacks"] == 2 and t["num_warmups"] == 1


def test_threads_have_their_own_trees_and_steps(device):
    # Each thread has its own tree (pool, steps, live outputs): threads sharing one wrapper never
    # end each other's steps or overwrite each other's outputs, even while they read them.
    import threading

    g = cudagraphify(lambda x: x * 2 + 1)
    h = cudagraphify(lambda y: y - 1)
    errors = []
    trees = {}
    barrier = threading.Barrier(4)

    def worker(seed, wait=True):
        try:
            with torch.no_grad():
                gen = torch.Generator().manual_seed(seed)
                if wait:
                    barrier.wait()
                for _ in range(20):
                    graphtrees.mark_step_begin()
                    x = torch.rand(8, generator=gen).to(device)
                    y = g(x)
                    assert_close(y, x * 2 + 1)  # read while others run
                    assert_close(h(y), x * 2)
                    assert_close(y, x * 2 + 1)
                trees[seed] = info(device)
                assert_invariants(device)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker(-1, wait=False)  # alone, on the main thread: what each thread must see too
    alone = trees.pop(-1)
    graphtrees.reset()
    _run_threads(worker, [(i,) for i in range(4)])
    assert errors == []
    assert len({t["thread"] for t in trees.values()} | {alone["thread"]}) == 5
    keys = ("num_nodes", "num_replays", "num_recordings", "num_invalidations", "num_warmups")
    for t in trees.values():
        assert {k: t[k] for k in keys} == {k: alone[k] for k in keys}
    assert alone["num_replays"] == 36
    assert info(device)["num_nodes"] == 0  # the main thread's tree is its own
    assert_close(g(torch.ones(8, device=device)), torch.full((8,), 3.0, device=device))


def test_trees_of_exited_threads_are_freed_once_their_outputs_die(device):
    import threading

    g = cudagraphify(lambda x: x + 1)
    kept = []

    def worker():
        with torch.no_grad():
            for _ in range(3):
                y = g(torch.ones(4, device=device))
            kept.append(y)  # a replay's output: valid until its tree runs again

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    # The thread is gone; its outputs stay valid while the main thread holds them.
    for y in kept:
        assert_close(y, torch.full((4,), 2.0, device=device))
    del y
    kept.clear()
    gc.collect()
    # Graphed calls free the orphaned tree once its outputs are all dead. (Its thread's C++ exit
    # may come a moment after join() returned.)
    f = cudagraphify(lambda x: x * 3)
    pools = graphtrees._ext.get_ext()._cpu_pool_totals
    for _ in range(500):
        assert_close(f(torch.ones(4, device=device)), torch.full((4,), 3.0, device=device))
        if device != "cpu" or pools()[0] == 1:
            break
        time.sleep(0.01)
    if device == "cpu":
        assert pools()[0] == 1  # the main thread's only


def test_backward_on_another_thread_runs_in_its_forwards_tree(device):
    # Autograd may run a backward on a thread of its own (CUDA's device threads; here the thread
    # that calls .backward()): it runs in the tree of its forward, whose activations it reads.
    import threading

    torch.manual_seed(0)
    torch.set_grad_enabled(True)  # this module runs under no_grad; the fixture restores it
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(device)
    ref = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    errors = []
    for _step in range(5):
        x = torch.randn(4, 8, device=device)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = compiled(x).pow(2).mean()

        def backward(loss=loss):
            try:
                loss.backward()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=backward)
        t.start()
        t.join()
        ref(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
    assert errors == []
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)
    t = info(device)
    kinds = sorted(n["function"].split(" ")[0] for n in t["nodes"])
    assert t["num_nodes"] == 2 and t["num_replays"] >= 4, kinds  # forward and backward
    (fwd,) = [n for n in t["nodes"] if n["parent"] is None]
    assert fwd["children"], "the backward is recorded under its forward"
    torch._dynamo.reset()


def test_failed_restore_records_into_a_fresh_pool(device, tree_logs):
    # PyTorch issue #140419: setCheckpointPoolState can fail. graphtrees then retires the tree
    # and records into a fresh pool instead of crashing; forced here through a testing hook.
    g1 = cudagraphify(lambda x: x * 2)
    g2 = cudagraphify(lambda a: a + 1)
    x = torch.rand(64, device=device)
    for _ in range(3):
        mark_step_begin()
        a = g1(x)
        g2(a)
    graphtrees._ext.get_ext()._inject_failure("restore", 1)
    h = cudagraphify(lambda a: a.exp())
    out = h(a)  # warmup after replays needs a restore, which fails
    assert_close(out, (x * 2).exp())
    assert_close(a, x * 2)  # the old tree's output is intact
    t = info(device)
    assert t["retired_trees"] == 1 and t["num_nodes"] == 0
    assert tree_logs.text.count("recording into a fresh pool") == 1
    for _ in range(3):
        mark_step_begin()
        a = g1(x)
        assert_close(h(a), (x * 2).exp())
    assert info(device)["num_nodes"] == 2  # g1 and h, recorded in the new pool
    assert_invariants(device)


def test_output_moved_out_of_the_pool_is_left_alone(device):
    # resize_() and share_memory_() move a storage out of the pool: it is the caller's now, and
    # the tree must neither hand its old block to it nor invalidate it.
    graphtrees._ext.get_ext()._set_debug_checks(False)
    w = cudagraphify(lambda x: x + 1, warmup_iters=5)
    f = cudagraphify(lambda z: z * 2)
    g = cudagraphify(lambda a: a - 1)
    x = torch.ones(128, device=device)
    y = w(x)  # a warmup output: owns a pool block
    y.resize_(100000)
    y.fill_(5.0)
    z = w(x)
    for _ in range(3):
        mark_step_begin()
        u = f(z)
    for _ in range(3):
        assert_close(g(u), u - 1)
    assert_close(y[:2], torch.full((2,), 5.0, device=device))
    assert_close(z, x + 1)
    assert_invariants(device)


def test_reset_inside_a_graphed_call_is_refused(device):
    def f(x):
        graphtrees.reset()
        return x * 2

    g = cudagraphify(f)
    with pytest.raises(RuntimeError, match="called from inside a graphed function"):
        g(torch.ones(2, device=device))
    assert_invariants(device)


def test_concurrent_first_calls_of_a_module(device):
    import threading

    m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]).to(device)
    g = cudagraphify(m)
    x = torch.randn(2, 4, device=device)
    errors = []
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        try:
            with torch.no_grad():
                for _ in range(3):
                    assert_close(g(x), m(x))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_threads(work, [()] * 4)
    assert errors == []
    with torch.no_grad():
        for _ in range(3):
            assert_close(g(x), m(x))


def test_pytorch_mark_step_begin_marks_a_step_for_graphtrees(device):
    # torch.compiler.cudagraph_mark_step_begin() is what PyTorch users call; it starts a new
    # step for graphtrees too, as graphtrees.mark_step_begin() does.
    f = cudagraphify(lambda x: x * 2)
    h = cudagraphify(lambda a: a + 1)
    x = torch.randn(8, device=device)
    a = f(x)
    g0 = info(device)["generation"]
    h(a)  # an output of this step: the path goes on
    assert info(device)["generation"] == g0
    a = f(x)
    g1 = info(device)["generation"]
    torch.compiler.cudagraph_mark_step_begin()
    assert_close(h(a), x * 2 + 1)
    assert info(device)["generation"] == g1 + 1


class _Marked(torch.Tensor):
    """A tensor subclass (the kind graphtrees runs eagerly)."""


@pytest.mark.parametrize("kind", ["nested", "meta", "sparse", "subclass"])
def test_odd_inputs_run_eagerly_with_a_clear_reason(kind, tree_logs):
    # Each is answered by graphtrees' own reason (never a PyTorch internal error) and counted.
    g = cudagraphify(lambda x: x * 2)
    if kind == "nested":
        x = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.strided)
        want = "nested tensor"
    elif kind == "meta":
        x = torch.ones(4, device="meta")
        want = "on the meta device"
    elif kind == "sparse":
        x = torch.eye(3).to_sparse()
        want = "a tensor argument with layout Sparse"
    else:
        x = torch.ones(4).as_subclass(_Marked)
        want = "tensor subclass type '_Marked'"
    for _ in range(3):
        out = g(x)
    if kind == "nested":
        assert [t.tolist() for t in out.unbind()] == [[2.0, 2.0], [2.0, 2.0, 2.0]]
    elif kind != "meta":
        assert_close(out.to_dense(), (x * 2).to_dense())
    assert tree_logs.text.count(want) == 1  # logged once
    if kind != "meta":
        assert info("cpu")["num_fallbacks"] == 3


def test_recordings_whose_static_inputs_died_are_replaced_not_counted(device, tree_logs):
    # Note [Recordings that can never replay]: a new buffer per call (HF's new StaticCache per
    # generate()) replaces the recording that read the old one; rerecord_limit counts real churn.
    g = cudagraphify(lambda buf, x: buf.add_(x).mul(2), static_argnums=(0,), rerecord_limit=2)
    x = torch.ones(16, device=device)
    for _ in range(12):
        buf = torch.zeros(16, device=device)  # the previous one dies here
        for k in range(1, 4):
            assert_close(g(buf, x), torch.full((16,), 2.0 * k, device=device))
    t = info(device)
    assert g.signatures()[0]["eager_reason"] is None
    assert t["num_rerecords"] == 0 and t["num_nodes"] == 1 and t["num_replays"] >= 12
    assert "its static inputs were freed" in tree_logs.text
    # Buffers that stay alive while their address changes are churn, and counted.
    keep = [torch.zeros(16, device=device) for _ in range(4)]
    for b in keep:
        for _ in range(2):
            g(b, x)
    assert info(device)["num_rerecords"] == 2
    assert "rerecord_limit=2" in g.signatures()[0]["eager_reason"]
    assert_invariants(device)


def test_an_output_that_is_its_managed_input_keeps_the_producers_output_valid(device):
    # Found on the CUDA stand-in: an output that is the input itself (AOTAutograd's forward
    # returns the inputs it saves for the backward) counted as memory the recording wrote, so each
    # replay of g2 invalidated g1's output, which g2 never writes.
    g1 = cudagraphify(lambda x: x * 2)
    g2 = cudagraphify(lambda h: (h, h + 1))
    x = torch.ones(64, device=device)
    for _ in range(4):
        mark_step_begin()
        h = g1(x)
        same, plus = g2(h)
        assert same.untyped_storage()._cdata == h.untyped_storage()._cdata
        assert_close(h, x * 2)  # readable: not overwritten by g2's replay
        assert_close(plus, x * 2 + 1)
    assert info(device)["num_replays"] >= 4


def test_a_quiet_logger_costs_no_message_text(device, caplog):
    # Note [No formatting nobody reads]: warmups, recordings, replays and branch switches build
    # no message while the graphtrees logger emits nothing below WARNING; at DEBUG the same calls
    # build and emit them. (It counts the messages GRAPHTREES_LOG builds: text built outside the
    # macro and then logged would not show here.)
    ext = graphtrees._ext.get_ext()

    def run(tag):
        f = cudagraphify(lambda x: x * 2 + 1, name=f"quiet_{tag}")
        h = cudagraphify(lambda x: x - 1, name=f"other_{tag}")
        x = torch.ones(4, device=device)
        for step in range(4):
            mark_step_begin()
            y = f(x)
            if step % 2:  # g1 -> g2 on odd steps, g1 alone on even: a branch to restore
                h(y)

    caplog.set_level(logging.WARNING, logger="graphtrees")
    before = ext._log_messages_built()
    run("quiet")
    assert ext._log_messages_built() == before
    assert graphtrees.tree_info(device)["num_recordings"] >= 2
    caplog.set_level(logging.DEBUG, logger="graphtrees")
    run("loud")
    built = ext._log_messages_built() - before
    assert built > 0
    assert any("recorded node" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("n", [1, 3])
def test_a_recording_made_under_inference_mode_replays_under_no_grad(device, n):
    # Inference mode is not part of a call's key, so a recording made under inference_mode (its
    # placeholders are inference tensors) replays under no_grad too. Its input copies raised
    # "Inplace update to inference tensor outside InferenceMode" there: on CPU always, on CUDA
    # from three inputs on (one or two are memcpys, past that check). Note [Input copies in
    # inference mode] in csrc/Backend.cpp.
    g = cudagraphify(lambda *xs: [x * 2 for x in xs])

    def inputs(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(5, generator=gen).to(device) for _ in range(n)]

    with torch.inference_mode():
        for seed in range(2):
            g(*inputs(seed))  # warmup, recording
    for seed in range(2, 4):
        xs = inputs(seed)
        assert_close(g(*xs), [x * 2 for x in xs])
    assert info(device)["num_replays"] == 2
    assert [s["eager_reason"] for s in g.signatures()] == [None]
