"""on_overwrite="copy": outputs the user still holds are copied out of the pool before a later run
writes their memory, instead of being invalidated; chain_limit bounds a function's runs on its
own outputs within one step."""

import gc

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin

from helpers import assert_close, assert_invariants, assert_overwritten, info

pytestmark = pytest.mark.usefixtures("no_grad")


def enc_fn(ids, table):
    return torch.tanh(table[ids].sum(0))


def test_two_calls_of_one_function_keep_the_first_result(device):
    # y1 = f(x1); y2 = f(x2); print(y1): the second call starts a new step, and reuses the pool.
    f = cudagraphify(lambda x: (x * 3).sin(), on_overwrite="copy")
    for _i in range(5):
        x1, x2 = torch.randn(64, device=device), torch.randn(64, device=device)
        y1 = f(x1)
        y2 = f(x2)
        assert_close(y1, (x1 * 3).sin())
        assert_close(y2, (x2 * 3).sin())
    assert info(device)["num_replays"] >= 4
    assert info(device)["num_migrations"] >= 4
    assert_invariants(device)


def test_raise_is_the_default(device):
    f = cudagraphify(lambda x: (x * 3).sin())
    for _ in range(4):
        y1 = f(torch.randn(64, device=device))
        f(torch.randn(64, device=device))
    assert_overwritten(y1)
    assert info(device)["num_migrations"] == 0


def test_classifier_free_guidance_written_the_natural_way(device):
    torch.manual_seed(0)
    table = torch.randn(100, 32, device=device)
    enc = cudagraphify(enc_fn, static_argnums=(1,), on_overwrite="copy")
    denoise = cudagraphify(lambda x, c: x - 0.1 * torch.tanh(x + c), on_overwrite="copy")
    ids = torch.randint(0, 100, (6,), device=device)
    null_ids = torch.zeros(6, dtype=torch.long, device=device)
    for _ in range(4):
        cond = enc(ids, table)
        uncond = enc(null_ids, table)  # a new step: cond's memory is reused, cond is copied out
        x = torch.randn(32, device=device)
        ref = x.clone()
        for step in range(6):
            guide = cond if step % 2 == 0 else uncond  # guidance on some steps, off on others
            x = denoise(x, guide)
            ref = ref - 0.1 * torch.tanh(
                ref + (enc_fn(ids, table) if step % 2 == 0 else enc_fn(null_ids, table))
            )
        assert_close(x, ref)
        assert_close(cond, enc_fn(ids, table))
        assert_close(uncond, enc_fn(null_ids, table))
    assert info(device)["num_replays"] > 0 and info(device)["num_migrations"] > 0
    assert_invariants(device)


def test_nothing_is_copied_for_outputs_that_are_dead(device):
    f = cudagraphify(lambda x: x * 2 + 1, on_overwrite="copy")
    for _ in range(8):
        y = f(torch.randn(256, device=device))
        del y
        gc.collect()
    assert info(device)["num_replays"] >= 6
    assert info(device)["num_migrations"] == 0


def test_copies_are_logged_at_debug_with_the_function_name(device, tree_logs):
    f = cudagraphify(lambda x: x + 5, on_overwrite="copy", name="shift")
    for _ in range(3):
        a = f(torch.randn(16, device=device))
        f(torch.randn(16, device=device))
    assert_close(a, a.clone())
    assert "copied a live output of 'shift'" in tree_logs.text


def test_sampler_loop_of_50_steps_keeps_its_condition(device, tree_logs):
    torch.manual_seed(0)
    w = torch.randn(16, 16, device=device) * 0.1
    make_cond = cudagraphify(lambda z: torch.tanh(z @ w), on_overwrite="copy")
    step = cudagraphify(lambda x, c: x + 0.01 * (c - x), on_overwrite="copy", chain_limit=16)
    for _ in range(2):
        mark_step_begin()
        z = torch.randn(4, 16, device=device)
        cond = make_cond(z)
        x = torch.zeros(4, 16, device=device)
        ref = x.clone()
        for _ in range(50):
            x = step(x, cond)
            ref = ref + 0.01 * (torch.tanh(z @ w) - ref)
        assert_close(cond, torch.tanh(z @ w))
        assert_close(x, ref)
    assert "chain_limit=16" in tree_logs.text  # the new steps it started are logged once
    # The INFO line is logged once (each path's end is logged at DEBUG, naming the limit too).
    assert tree_logs.text.count("a new step starts every chain_limit=16 such calls") == 1
    assert "this is expected" in tree_logs.text


def test_chain_limit_bounds_the_recordings_of_a_loop(device):
    f = cudagraphify(lambda h: h * 0.5 + 1, chain_limit=4)
    for _ in range(3):
        mark_step_begin()
        h = torch.ones(8, device=device)
        for _ in range(12):
            h = f(h)
    assert info(device)["num_nodes"] <= 4


def test_gradients_use_the_same_mechanism(device):
    # Backward outputs were always copied out (Note [Pinned gradients]); the policy generalises it.
    torch._dynamo.reset()
    model = torch.nn.Linear(8, 4).to(device)
    compiled = graphtrees.compile(model, inner="aot_eager")
    x = torch.randn(16, 8, device=device)
    with torch.enable_grad():
        for _ in range(4):
            compiled(x).sum().backward()
        (expected,) = torch.autograd.grad(model(x).sum(), model.weight)
    assert_close(model.weight.grad, expected * 4)
    torch._dynamo.reset()


@pytest.mark.parametrize("bad", ["keep", 3, None])
def test_on_overwrite_is_validated(bad):
    with pytest.raises(ValueError, match="on_overwrite must be 'raise' or 'copy'"):
        cudagraphify(lambda x: x, on_overwrite=bad)
    with pytest.raises(ValueError, match="on_overwrite must be 'raise' or 'copy'"):
        graphtrees.compile(torch.nn.Linear(2, 2), on_overwrite=bad)


def test_chain_limit_is_validated():
    with pytest.raises(ValueError, match="chain_limit must be an int >= 1"):
        cudagraphify(lambda x: x, chain_limit=0)


def test_keeping_every_output_of_a_feedback_loop_names_the_chain_limit(device):
    # h = f(h) kept in a list: after chain_limit runs a new step begins and the oldest outputs
    # are released; touching one says why and how to keep them.
    f = cudagraphify(lambda h: h * 0.5 + 1)
    h = torch.ones(8, device=device)
    kept = []
    for _ in range(40):
        h = f(h)
        kept.append(h)
    with pytest.raises(RuntimeError) as err:
        kept[0] + 1
    msg = str(err.value)
    assert "chain_limit=16" in msg and "on_overwrite='copy'" in msg and ".clone()" in msg
    assert_close(kept[-1], _loop_reference(40, device))


def _loop_reference(n, device):
    h = torch.ones(8, device=device)
    for _ in range(n):
        h = h * 0.5 + 1
    return h
