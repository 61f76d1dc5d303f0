"""CPU graphs replay like CUDA graphs (Note [CPU graphs] in csrc/cpu/CpuGraph.h): a replay runs
the recorded op program from C++ and no Python, so what a CUDA replay bakes, a CPU replay bakes
too; and verify=True, which catches it (Note [Verified replays] in csrc/Verifier.h)."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import graphtrees
from graphtrees import ReplayMismatchError, cudagraphify

from helpers import assert_close, assert_invariants, cpu_replays, info


class Scaled(torch.nn.Module):
    """Reads Python state in forward: a float, an int step counter, a bool that picks an op."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = 2.0
        self.step = 0
        self.subtract = False
        self.calls = []

    def forward(self, x):
        self.calls.append(1)
        self.step += 1
        h = self.lin(x) * self.scale + self.step
        return h - 1 if self.subtract else h + 1


@pytest.fixture
def x():
    return torch.randn(4, 8)


def test_side_effects_run_only_in_warmup_and_recording(x):
    model = Scaled()
    g = cudagraphify(model)
    with torch.no_grad():
        for _ in range(6):
            g(x)
    assert len(model.calls) == 2 and model.step == 2
    assert info("cpu")["num_replays"] == 4 and info("cpu")["num_program_replays"] == 4
    assert cpu_replays("cpu") == ["program"]
    assert_invariants("cpu")


def test_python_values_are_baked_as_a_cuda_replay_bakes_them(x):
    model = Scaled()
    g = cudagraphify(model)
    with torch.no_grad():
        g(x)
        recorded = g(x).clone()  # the recording: scale 2.0, step 2, +1
        model.scale, model.subtract = 3.0, True
        for _ in range(3):
            # A counter fed into the computation: 2, 2, 2 as on a GPU (not 3, 4, 5).
            assert_close(g(x), recorded)
        assert model.step == 2
        assert_close(recorded, model.lin(x) * 2.0 + 2 + 1)


def test_replays_see_new_input_values_and_parameter_updates():
    lin = torch.nn.Linear(8, 4)
    g = cudagraphify(lin)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 8)
            lin.weight.add_(0.1)  # in place: the recording reads the parameter where it is
            assert_close(g(x), lin(x))
    assert info("cpu")["num_program_replays"] == 3


def test_random_ops_draw_fresh_numbers_and_follow_the_seed(x):
    def noisy(x):
        return x + torch.rand_like(x) + torch.nn.functional.dropout(torch.ones_like(x), 0.5)

    g = cudagraphify(noisy)

    def run():
        torch.manual_seed(123)
        return [g(x).clone() for _ in range(5)]

    first = run()
    again = run()
    assert info("cpu")["num_program_replays"] == 8
    for a, b in zip(first, again):
        assert_close(a, b)  # reproducible under torch.manual_seed
    replayed = first[2:]
    assert not torch.equal(replayed[0], replayed[1]) and not torch.equal(replayed[1], replayed[2])
    # What eager draws from the same seed, call by call.
    torch.manual_seed(123)
    for got in first:
        assert_close(got, noisy(x))


def test_generator_arguments_advance_on_every_replay(x):
    g = cudagraphify(lambda x, gen: x + torch.rand(x.shape, generator=gen))
    gen = torch.Generator().manual_seed(7)
    outs = [g(x, gen).clone() for _ in range(4)]
    ref_gen = torch.Generator().manual_seed(7)
    for got in outs:
        assert_close(got, x + torch.rand(x.shape, generator=ref_gen))
    assert info("cpu")["num_program_replays"] == 2


def test_in_place_updates_of_a_buffer_are_replayed(x):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen.add_(1)
            return x * self.seen

    model = Counter()
    g = cudagraphify(model)
    with torch.no_grad():
        for i in range(1, 6):
            assert_close(g(x), x * i)
    assert model.seen.item() == 5
    assert cpu_replays("cpu") == ["program"]


def test_batch_norm_in_training_mode_updates_its_statistics_once_per_call():
    # aten::batch_norm writes the running statistics through a nested op: the proof must give
    # them their old bytes back before it runs the program again.
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(4).train()
    ref = torch.nn.BatchNorm1d(4).train()
    g = cudagraphify(bn)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(8, 4)
            assert_close(g(x), ref(x))
    assert_close(bn.running_mean, ref.running_mean)
    assert_close(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == 5 and cpu_replays("cpu") == ["program"]


def test_a_generator_read_from_a_closure_is_drawn_from_once_per_call(x):
    gen = torch.Generator().manual_seed(3)
    g = cudagraphify(lambda x: x + torch.rand(x.shape, generator=gen))
    outs = [g(x).clone() for _ in range(4)]
    ref = torch.Generator().manual_seed(3)
    for got in outs:
        assert_close(got, x + torch.rand(x.shape, generator=ref))
    assert_close(gen.get_state(), ref.get_state())
    assert cpu_replays("cpu") == ["program"]


def test_a_tensor_python_filled_is_caught_whatever_the_memory_held(caplog):
    def masked(x, y):
        flag = torch.tensor([True, False, True])  # aten::empty, then filled by Python
        return torch.where(flag, x, y)

    g = cudagraphify(masked, name="masked")
    with caplog.at_level(logging.WARNING, logger="graphtrees"):
        for _ in range(4):
            a, b = torch.randn(3), torch.randn(3)
            assert_close(g(a, b), torch.where(torch.tensor([True, False, True]), a, b))
    assert cpu_replays("cpu") == ["python"]


def test_a_write_outside_the_dispatcher_falls_back_to_the_python_replay(x, caplog):
    import ctypes

    def via_ctypes(x):
        out = torch.empty_like(x)
        ctypes.memmove(out.data_ptr(), x.data_ptr(), x.nbytes)  # no op is dispatched
        return out + 1

    g = cudagraphify(via_ctypes, name="via_ctypes")
    with caplog.at_level(logging.WARNING, logger="graphtrees"):
        for _ in range(4):
            y = torch.randn(4, 8)
            assert_close(g(y), y + 1)
    assert cpu_replays("cpu") == ["python"]
    assert info("cpu")["num_replays"] == 2 and info("cpu")["num_program_replays"] == 0
    logged = [r.getMessage() for r in caplog.records if "via_ctypes" in r.getMessage()]
    assert len(logged) == 1 and "outside the dispatcher (Tensor.data_ptr())" in logged[0], logged


def test_a_write_through_numpy_runs_eagerly_with_the_reason(x):
    def via_numpy(x):
        out = torch.empty_like(x)
        out.numpy()[:] = x.numpy() * 2  # numpy view of tensor memory: no op is dispatched
        return out + 1

    g = cudagraphify(via_numpy, name="via_numpy")
    for _ in range(4):
        y = torch.randn(4, 8)
        assert_close(g(y), y * 2 + 1)
    assert info("cpu")["num_replays"] == 0
    (sig,) = g.signatures()
    assert "Tensor.numpy()" in sig["eager_reason"], sig["eager_reason"]


def test_a_tensor_made_outside_the_dispatcher_keeps_the_python_replay(caplog):
    def detached(x):
        return x.data * 2  # Tensor.data: a new tensor over x's memory, made by no op

    g = cudagraphify(detached, name="detached")
    with caplog.at_level(logging.WARNING, logger="graphtrees"):
        for _ in range(4):
            y = torch.randn(4, 8)
            assert_close(g(y), y * 2)
    assert cpu_replays("cpu") == ["python"]
    logged = [r.getMessage() for r in caplog.records if "detached" in r.getMessage()]
    assert len(logged) == 1 and "made while the function ran, but not by an op" in logged[0]


def test_torch_tensor_filled_by_python_is_caught_by_the_proof(caplog):
    def with_constant(x):
        return x * torch.tensor([2.0])  # aten::empty is dispatched, Python fills it

    g = cudagraphify(with_constant, name="with_constant")
    with caplog.at_level(logging.WARNING, logger="graphtrees"):
        for _ in range(4):
            y = torch.randn(4, 8)
            assert_close(g(y), y * 2)
    assert cpu_replays("cpu") == ["python"]
    assert any("with_constant" in r.getMessage() for r in caplog.records)


def test_cpu_replay_python_forces_the_python_replay(x):
    model = Scaled()
    g = cudagraphify(model, cpu_replay="python")
    assert g.options["cpu_replay"] == "python"
    with torch.no_grad():
        for _ in range(4):
            g(x)
    assert len(model.calls) == 4  # the Python code runs on every replay
    assert cpu_replays("cpu") == ["python"] and info("cpu")["num_program_replays"] == 0
    with pytest.raises(ValueError, match="cpu_replay must be 'program' or 'python'"):
        cudagraphify(model, cpu_replay="numpy")


def test_program_replays_of_a_two_node_path_keep_live_outputs_safe():
    f = cudagraphify(lambda x: x.relu() * 3, name="f")
    h = cudagraphify(lambda y: (y + 1).sum(0), name="h")
    for _ in range(4):
        x = torch.randn(5, 6)
        y = f(x)
        z = h(y)
        assert_close(z, (x.relu() * 3 + 1).sum(0))
        assert_close(y, x.relu() * 3)
        graphtrees.mark_step_begin()
    assert cpu_replays("cpu") == ["program", "program"]
    assert info("cpu")["num_program_replays"] == 4
    assert_invariants("cpu")


def test_threads_replay_their_programs_at_once():
    # Each thread has its own tree; program replays release the GIL while they run.
    import threading

    errors = []

    def work(seed):
        try:
            torch.manual_seed(seed)
            lin = torch.nn.Linear(32, 32)
            g = cudagraphify(lin, name=f"lin{seed}")
            with torch.no_grad():
                for _ in range(50):
                    x = torch.randn(8, 32)
                    assert_close(g(x), lin(x))
            t = info("cpu")
            assert t["num_program_replays"] == t["num_replays"] == 48, t
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_ops_with_tensor_lists_views_and_indices_replay():
    def f(x, idx):
        a, b = x.chunk(2, dim=1)
        c = torch.cat([a.t().contiguous().t(), b * 2], dim=1)
        d = c[idx] + c[:3, 0:1]
        return torch.stack([d, d.flip(0)]).softmax(-1), x.view(-1)[::3]

    g = cudagraphify(f)
    idx = torch.tensor([3, 0, 1])
    for _ in range(4):
        x = torch.randn(4, 6)
        for got, want in zip(g(x, idx), f(x, idx)):
            assert_close(got, want)
    assert cpu_replays("cpu") == ["program"]


@pytest.mark.needs_values("verify compares a replay's values with an eager run's")
def test_verify_catches_a_baked_value_on_every_backend(device):
    k = {"v": 1.0}
    g = cudagraphify(lambda x: (x * k["v"], x.sum()), verify=True, name="baked")
    x = torch.ones(3, device=device)
    for _ in range(3):
        g(x)  # warmup, recording, a verified replay that matches
    k["v"] = 2.0
    with pytest.raises(ReplayMismatchError, match=r"'baked' .* output \[0\] differs .* by up to 1"):
        g(x)


def test_verify_raises_naming_the_output_and_the_baked_value(x):
    model = Scaled()
    g = cudagraphify(model, verify=True)
    with torch.no_grad():
        g(x), g(x)  # warmup and recording: the counter was 2 when recorded
        model.step = 1  # the eager run of a verified replay steps it to 2 again
        g(x)  # a replay that matches
        model.step, model.scale = 1, 3.0
        with pytest.raises(ReplayMismatchError) as e:
            g(x)
    msg = str(e.value)
    assert "the replay of 'Scaled'" in msg and "differs from the eager run's by up to" in msg
    assert "argument 'other' was 2.0 when recorded and is 3.0 now" in msg, msg
    assert "aten::mul.Tensor" in msg and isinstance(e.value, RuntimeError)


def test_verify_names_a_branch_that_a_python_bool_decided(x):
    model = Scaled()
    g = cudagraphify(model, verify=True)
    with torch.no_grad():
        g(x), g(x)
        model.subtract, model.step = True, 1
        with pytest.raises(
            ReplayMismatchError,
            match=r"ran aten::add.Tensor where the eager run ran aten::sub.Tensor",
        ):
            g(x)


def test_verify_warn_logs_once_and_returns_the_eager_result(x, caplog):
    model = Scaled()
    g = cudagraphify(model, verify="warn")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="graphtrees"):
        g(x), g(x)
        model.scale = 5.0
        for _ in range(3):
            model.step = 1
            assert_close(g(x), model.lin(x) * 5.0 + 2 + 1)
    warnings = [r for r in caplog.records if "does not match an eager run" in r.getMessage()]
    assert len(warnings) == 1


def test_verify_keeps_the_rng_where_the_replay_left_it(x):
    g = cudagraphify(lambda x: x + torch.randn_like(x), verify=True)
    torch.manual_seed(0)
    outs = [g(x).clone() for _ in range(4)]  # every replay matches eager from the same state
    follow = torch.randn(3)
    torch.manual_seed(0)
    for got in outs:
        assert_close(got, x + torch.randn_like(x))
    assert_close(follow, torch.randn(3))


@pytest.mark.needs_values("reads on the host the state a replay wrote")
@pytest.mark.parametrize("mode", [True, "warn"], ids=["raise", "warn"])
def test_verify_updates_state_outside_the_arguments_once(device, mode, caplog):
    # A cache and its position counter held in a closure (transformers' StaticCache): the eager
    # check must start from the state the replay started from, and leave it as the replay did.
    position = torch.zeros(1, dtype=torch.long, device=device)
    cache = torch.zeros(8, device=device)

    def step(x):
        cache.index_copy_(0, position, x)
        position.add_(1)
        return cache * 2

    g = cudagraphify(step, verify=mode, name="step")
    want = torch.zeros(8)
    with caplog.at_level(logging.WARNING, logger="graphtrees"):
        for i in range(6):
            out = g(torch.full((1,), i + 1.0, device=device))
            want[i] = i + 1.0
            assert position.item() == i + 1
            assert_close(out, want.to(device) * 2)
            assert_close(cache, want.to(device))
    assert info(device)["num_replays"] == 4
    assert "does not match" not in caplog.text


@pytest.mark.needs_values("verify compares a replay's values with an eager run's")
def test_verify_names_state_a_replay_writes_differently(device):
    k = {"v": 1.0}
    state = torch.zeros(4, device=device)
    g = cudagraphify(lambda x: (state.fill_(k["v"]), x + 1)[1], verify=True, name="fills")
    x = torch.ones(4, device=device)
    for _ in range(3):
        g(x)
    k["v"] = 2.0
    with pytest.raises(ReplayMismatchError, match=r"a tensor it writes outside its arguments"):
        g(x)
    assert_close(state, torch.ones(4, device=device))  # as the replay left it


def test_verify_with_graphtrees_compile(x, monkeypatch):
    import graphtrees._verify as verify

    checked = []
    real_check = verify.check
    monkeypatch.setattr(verify, "check", lambda *a: checked.append(a[0]) or real_check(*a))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = graphtrees.compile(model, verify=True)
    with torch.no_grad():
        for _ in range(4):
            assert_close(compiled(x), model(x))
    assert len(checked) == info("cpu")["num_replays"] == 2


def test_graphtrees_verify_environment_variable():
    code = (
        "import torch, graphtrees\n"
        "k = {'v': 1.0}\n"
        "g = graphtrees.cudagraphify(lambda x: x * k['v'])\n"
        "x = torch.ones(3)\n"
        "g(x); g(x); k['v'] = 2.0\n"
        "try:\n"
        "    g(x)\n"
        "except graphtrees.ReplayMismatchError as e:\n"
        "    print('MISMATCH', 'was 1.0 when recorded and is 2.0 now' in str(e))\n"
    )
    env = dict(os.environ, GRAPHTREES_VERIFY="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "MISMATCH True", out.stderr
    env["GRAPHTREES_VERIFY"] = "True"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "MISMATCH True", out.stderr
    env["GRAPHTREES_VERIFY"] = "sometimes"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "GRAPHTREES_VERIFY must be 1 (or true, yes, on), warn, or 0" in bad.stderr
