"""Issue 28's classes of wrong results: each replay equals eager, or graphtrees runs the call
another way and says why. Each test failed before its fix."""

import numpy as np
import pytest
import torch

from graphtrees import cudagraphify

from helpers import assert_close, cpu_replays, info

pytestmark = pytest.mark.usefixtures("no_grad")


def _calls(g, make_args, n=4):
    """n calls on fresh arguments (warmup, recording, replays): each call's (conj, neg) bits, its
    values (cloned: a later call overwrites the result) and eager's result."""

    def keep(t):
        return t.resolve_conj().resolve_neg().clone()  # its values; the bits are kept apart

    results = []
    for _ in range(n):
        args = make_args()
        got = g(*args)
        results.append(((got.is_conj(), got.is_neg()), keep(got), g.__wrapped__(*args)))
    return results


@pytest.mark.parametrize(
    "fn",
    [
        lambda z: (z * 2).conj(),
        lambda z: z.conj().imag,
        lambda z: (z + 1).mH,
        lambda z: torch._neg_view(z * 3),  # resolved by a kernel torch compiles with NVRTC
        pytest.param(
            lambda z: torch.fft.ifft(z.real),
            marks=pytest.mark.needs_kernels("cuFFT, which the stand-in does not model"),
        ),
    ],
    ids=["conj", "conj-imag", "mH", "neg-view", "ifft-of-real"],
)
def test_conjugate_and_negative_views_keep_their_bit(device, fn):
    g = cudagraphify(fn)
    for bits, got, want in _calls(
        g, lambda: (torch.randn(3, 3, dtype=torch.complex64, device=device),)
    ):
        assert bits == (want.is_conj(), want.is_neg())
        assert_close(got, want)
    assert info(device)["num_replays"] == 2


def test_a_quantized_result_runs_eagerly_with_the_reason():
    def f(x):
        return torch.quantize_per_tensor(x * 2, 0.1, 0, torch.qint8)

    g = cudagraphify(f)
    for _ in range(3):
        x = torch.randn(4)
        got = g(x)
        assert got.q_scale() == 0.1 and torch.equal(got.int_repr(), f(x).int_repr())
    (sig,) = g.signatures()
    assert "quantized tensor" in sig["eager_reason"]
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    h = cudagraphify(lambda q: q.dequantize() + 1)
    for _ in range(3):
        assert torch.equal(h(q), q.dequantize() + 1)
    assert info("cpu")["num_recordings"] == 0


def test_an_efficient_zero_tensor_runs_eagerly_with_the_reason(device):
    # Autograd's ZeroTensor has no memory: rebuilt as a result it pointed at nothing (the CPU
    # proof read it and the process crashed; found by the OpInfo training sweep, sgn's backward).
    def f(x):
        return torch._efficientzerotensor(x.shape, device=x.device), x + 1

    g = cudagraphify(f)
    for _ in range(3):
        x = torch.randn(4, device=device)
        zeros, plus = g(x)
        assert zeros._is_zerotensor() and zeros.shape == x.shape
        assert_close(plus, x + 1)
    (sig,) = g.signatures()
    assert "efficient zero tensor" in sig["eager_reason"]
    h = cudagraphify(lambda z, x: z + x)
    z = torch._efficientzerotensor(4, device=device)
    for _ in range(3):
        x = torch.randn(4, device=device)
        assert_close(h(z, x), x)
    assert info(device)["num_recordings"] == 0


def test_training_through_a_backward_that_returns_an_efficient_zero_tensor():
    # sgn's backward returns a ZeroTensor for a real input: that backward runs eagerly, the
    # forward is recorded, and the gradients are eager's.
    import graphtrees

    f = graphtrees.compile(torch.sgn, inner="aot_eager")
    with torch.enable_grad():
        for _ in range(4):
            x = torch.randn(8, requires_grad=True)
            (f(x) * x).sum().backward()
            y = x.detach().clone().requires_grad_()
            (torch.sgn(y) * y).sum().backward()
            assert torch.equal(x.grad, y.grad)
    assert info("cpu")["num_replays"] == 2  # the forward's


def test_arguments_with_equal_hashes_are_different_signatures(device):
    # hash(-1) == hash(-2) in CPython, so np.int64(-1) and np.int64(-2) hash alike.
    assert hash(np.int64(-1)) == hash(np.int64(-2))
    g = cudagraphify(lambda x, k: x * float(k))
    x = torch.ones(2, device=device)
    for _ in range(3):
        for k in (np.int64(-1), np.int64(-2)):
            assert_close(g(x, k), x * float(k))
    assert len(g.signatures()) == 2


class _SameHash:
    """A value-hashed argument whose values all hash alike: each value is a variant key."""

    def __init__(self, v):
        self.v = v

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return isinstance(other, _SameHash) and other.v == self.v


def test_an_evicted_variant_leaves_no_hole_that_duplicates_a_later_one():
    # Three values with one hash: keys k, k+variant0, k+variant1. With max_recorded_shapes=2 the
    # third evicts the first (k): the second, at variant0, must still be found (it was recorded
    # again as a duplicate at k).
    import graphtrees

    g = cudagraphify(lambda x, s: x * s.v, max_recorded_shapes=2)
    x = torch.ones(2)
    with torch.no_grad():
        for v in (1.0, 2.0, 3.0):
            for _ in range(3):  # warmup, record, replay
                assert torch.equal(g(x, _SameHash(v)), x * v)
            graphtrees.mark_step_begin()
        before = info("cpu")
        assert before["num_evictions"] == 1 and len(g.signatures()) == 2
        assert torch.equal(g(x, _SameHash(2.0)), x * 2.0)
    after = info("cpu")
    assert after["num_replays"] == before["num_replays"] + 1
    assert after["num_warmups"] == before["num_warmups"]
    assert len(g.signatures()) == 2


def test_an_evicted_function_leaves_no_state_in_the_tree():
    # Per-tree function state (warmup counts, the generators a warmup drew from) goes with the
    # function's signature.
    from graphtrees._ext import get_ext

    g = cudagraphify(lambda x: x + 1, max_recorded_shapes=1)
    with torch.no_grad():
        for n in range(2, 12):
            for _ in range(3):
                g(torch.ones(n))
    # The signature on the current path when the next one comes is evicted one call later.
    assert info("cpu")["num_evictions"] == 8 and len(g.signatures()) == 2
    assert get_ext()._function_states("cpu") == 2


def test_an_identity_hashed_argument_is_its_own_signature_even_at_a_reused_address():
    class Scale:
        def __init__(self, v):
            self.v = v

    g = cudagraphify(lambda x, s: x * s.v)
    x = torch.ones(2)
    s = Scale(1.0)
    for _ in range(3):
        assert torch.equal(g(x, s), x)
    old = id(s)
    del s
    # An object at the dead one's address (the identity hash the signature was made for):
    # allocate until the allocator hands that address out again.
    keep = []
    for v in range(2, 2000):
        s = Scale(float(v))
        if id(s) == old:
            break
        keep.append(s)
    else:
        pytest.skip("the allocator never reused the dead argument's address")
    for _ in range(3):
        assert torch.equal(g(x, s), x * float(v))


def test_a_parameter_returned_as_it_is_comes_back_as_that_parameter(device):
    lin = torch.nn.Linear(3, 3).to(device)
    g = cudagraphify(lin, name="lin")
    g_out = cudagraphify(lambda m, x: (m(x), m.weight), static_argnums=(0,))
    for _ in range(4):
        x = torch.randn(2, 3, device=device)
        y, w = g_out(lin, x)
        assert w is lin.weight and isinstance(w, torch.nn.Parameter)
        assert_close(y, lin(x))
    assert info(device)["num_replays"] == 2
    del g


def test_a_changed_default_dtype_is_another_recording():
    g = cudagraphify(lambda x: x + torch.ones(2))
    x = torch.zeros(2, dtype=torch.float64)
    old = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            for _ in range(3):
                got = g(x)
                assert got.dtype == torch.float64 and torch.equal(got, x + torch.ones(2))
    finally:
        torch.set_default_dtype(old)
    assert len(g.signatures()) == 2 and info("cpu")["num_fallbacks"] == 0


def test_a_python_filled_value_that_survives_both_fixed_patterns_is_not_baked():
    # torch.tensor(...) is filled by Python, outside the dispatcher: the proof of the program
    # replay must see that the result depends on memory no recorded op wrote. (t == 0) | (t == -1)
    # is True over all-zero and all-one bytes alike; random bytes tell.
    k = {"v": 0}

    def f(x):
        t = torch.tensor([k["v"]])
        return x + ((t == 0) | (t == -1)).to(x.dtype)

    g = cudagraphify(f)
    x = torch.zeros(1)
    for _ in range(3):
        assert torch.equal(g(x), f(x))
    k["v"] = 5
    assert torch.equal(g(x), f(x))
    assert cpu_replays("cpu") == ["python"]


def test_threads_sharing_one_wrapped_module_keep_one_recording_each():
    # Serving code: one wrapped model, several threads. Each thread has its own tree; what a
    # call needs of its tree is looked up there, never in a per-record cache another thread
    # switches while this one replays with the GIL released.
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    g = cudagraphify(model)
    results, errors = {}, []

    def serve(k):
        try:
            torch.manual_seed(k)
            with torch.no_grad():
                for _ in range(400):
                    x = torch.randn(4, 16)
                    y = g(x)
                    if not torch.allclose(y, model(x), atol=1e-6):
                        raise AssertionError("a replay differs from eager")
            t = info("cpu")
            results[k] = (t["num_nodes"], t["num_recordings"], t["num_replays"])
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k, (nodes, recordings, replays) in results.items():
        assert nodes == 1 and recordings == 1 and replays == 398, (k, results)


def test_parameters_reached_through_a_closure_keep_autograd():
    lin = torch.nn.Linear(3, 2)
    g = cudagraphify(lambda x: lin(x), name="closure")
    with torch.enable_grad():
        for _ in range(3):
            lin.zero_grad()
            x = torch.randn(4, 3)
            y = g(x)
            assert y.requires_grad
            y.sum().backward()
            assert lin.weight.grad is not None
            assert torch.allclose(lin.weight.grad, x.sum(0).expand(2, 3))
    (sig,) = g.signatures()
    assert "parameters reached through a closure" in sig["eager_reason"]
    h = cudagraphify(lambda x: lin(x))
    with torch.no_grad():  # without autograd the same function records
        for _ in range(3):
            x = torch.randn(4, 3)
            assert torch.equal(h(x), lin(x))
    assert info("cpu")["num_replays"] == 1


def _count(x, i):
    return torch.bincount(i) + x.sum()


def _split(x, i):
    return [p.clone() for p in torch.tensor_split(x, i)]


@pytest.mark.parametrize(
    "fn, make",
    [
        (_split, lambda n: (torch.randn(8), torch.tensor([n % 7 + 1]))),
        (
            lambda x, i: torch.bincount(i) + x.sum(),
            lambda n: (torch.randn(2), torch.tensor([0, n])),
        ),
        (torch.repeat_interleave, lambda n: (torch.randn(2), torch.tensor([1, n]))),
    ],
    ids=["tensor_split", "bincount", "repeat_interleave"],
)
def test_kernels_that_read_values_on_the_host_run_eagerly(fn, make, tree_logs):
    g = cudagraphify(fn, name="reads")
    for n in range(1, 6):
        args = make(n)
        got, want = g(*args), fn(*args)
        assert str(got) == str(want)
    assert info("cpu")["num_replays"] == 0
    (sig,) = g.signatures()
    assert "read" in tree_logs.text and sig["eager_reason"], tree_logs.text


def test_the_same_tensor_passed_twice_is_one_input(device):
    def f(a, b):
        return a * 2 if a is b else a + b  # the branch a recording bakes

    g = cudagraphify(f)
    for _ in range(3):
        x, y = torch.randn(3, device=device), torch.randn(3, device=device)
        assert_close(g(x, x), x * 2)
        assert_close(g(x, y), x + y)
    assert len(g.signatures()) == 2 and info(device)["num_replays"] == 2


def test_self_attention_records_its_own_path_and_replays_the_program():
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    g = cudagraphify(lambda x: mha(x, x, x, need_weights=False)[0])
    for _ in range(4):
        x = torch.randn(2, 5, 16)
        assert_close(g(x), mha(x, x, x, need_weights=False)[0])
    assert cpu_replays("cpu") == ["program"]


@pytest.mark.parametrize("what", ["linear on a transposed input", "attention, training mode"])
def test_parameters_that_require_grad_keep_the_program_replay(what):
    # matmul folds a 3-d input into one mm when the other operand requires grad; a program
    # replayed the composite op below autograd, where a parameter's view does not, so it
    # allocated otherwise and fell back to the Python replay (Note [Composite ops are recorded
    # decomposed]).
    if what.startswith("linear"):
        lin = torch.nn.Linear(16, 48)
        fn = lambda x: lin(x.transpose(0, 1))  # noqa: E731
    else:
        mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).train()  # dropout 0
        fn = lambda x: mha(x, x, x, need_weights=False)[0]  # noqa: E731
    g = cudagraphify(fn)
    for _ in range(4):
        x = torch.randn(2, 5, 16)
        assert_close(g(x), fn(x))
    assert cpu_replays("cpu") == ["program"]


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("what", ["conv2d without a bias", "embedding_bag without weights"])
def test_a_composite_op_passing_on_an_absent_optional_tensor_keeps_the_program(what, verify):
    # conv2d hands aten::convolution its missing bias as an undefined tensor, not None; the
    # recorder took that for "tensors in a structure a program cannot rebuild" and every CPU
    # replay of a bias-free conv (ResNet) or an embedding bag ran the Python code again; and
    # verify=True, comparing that argument with the eager run's, raised on the first replay.
    if what.startswith("conv2d"):
        w = torch.randn(4, 3, 3, 3)
        fn = lambda x: torch.nn.functional.conv2d(x, w, padding=1)  # noqa: E731
        make = lambda: torch.randn(2, 3, 8, 8)  # noqa: E731
    else:
        bag = torch.nn.EmbeddingBag(10, 4, mode="sum")
        offsets = torch.tensor([0, 3])
        fn = lambda i: bag(i, offsets)  # noqa: E731
        make = lambda: torch.randint(0, 10, (6,))  # noqa: E731
    g = cudagraphify(fn, verify=verify)
    with torch.no_grad():
        for _ in range(4):
            x = make()
            assert_close(g(x), fn(x))
    assert cpu_replays("cpu") == ["program"]


def _set_inside(how, gen, start):
    if how == "Generator.manual_seed":
        gen.manual_seed(0)
    elif how == "Generator.set_state":
        gen.set_state(start)
    else:
        torch.manual_seed(0)
        return None  # the default generator
    return gen


@pytest.mark.parametrize(
    "how", ["Generator.manual_seed", "Generator.set_state", "torch.manual_seed"]
)
def test_a_generator_set_inside_the_function_is_not_replayed_past(device, how):
    # A replay would not repeat the setting and would go on drawing where the last one stopped;
    # eager starts over on every call. torch accepts the same seed during a CUDA capture.
    gen = torch.Generator(device).manual_seed(0)
    start = gen.get_state()

    def f(x):
        return x + torch.rand(x.shape, generator=_set_inside(how, gen, start), device=device)

    g = cudagraphify(f, name="reseeds")
    for _ in range(4):
        x = torch.randn(3, device=device)
        want = x + torch.rand(3, generator=torch.Generator(device).manual_seed(0), device=device)
        assert_close(g(x), want)
    assert info(device)["num_replays"] == 0
    (sig,) = g.signatures()
    assert f"torch.Generator.manual_seed() on the {device}" in sig["eager_reason"] or (
        "set_state()" in sig["eager_reason"]
    ), sig["eager_reason"]


def test_a_generator_the_caller_sets_between_calls_is_replayed(device):
    gen = torch.Generator(device)
    g = cudagraphify(lambda x: x + torch.rand(x.shape, generator=gen, device=device))
    for _ in range(4):
        gen.manual_seed(0)
        x = torch.randn(3, device=device)
        want = x + torch.rand(3, generator=torch.Generator(device).manual_seed(0), device=device)
        assert_close(g(x), want)
    assert info(device)["num_replays"] == 2


class _Noise(torch.nn.Module):
    """Draws from a generator of its own, reached as an attribute, not passed in."""

    def __init__(self, device):
        super().__init__()
        self.gen = torch.Generator(device).manual_seed(5)

    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.gen, device=x.device)


def test_a_generator_the_function_reaches_itself_advances_on_every_replay(device):
    # Torch 2.11 refused the first draw of such a generator during a CUDA capture (it was never
    # registered with the graph: the function ran eagerly); each replay must advance it as eager
    # calls do, so that call k draws what eager call k draws.
    graphed_module, eager_module = _Noise(device), _Noise(device)
    g = cudagraphify(graphed_module)
    got, want = [], []
    for _ in range(5):
        x = torch.randn(64, device=device)
        got.append(g(x).clone())
        want.append(eager_module(x))
    (sig,) = g.signatures()
    assert sig["eager_reason"] is None and info(device)["num_replays"] == 3
    # The generator's state (for CUDA, its seed and philox offset: kept on the host) is where
    # five eager calls leave it.
    assert torch.equal(graphed_module.gen.get_state(), eager_module.gen.get_state())
    for a, b in zip(got, want):
        assert_close(a, b)


def test_a_profiler_set_on_the_thread_still_sees_a_recording():
    import sys

    calls = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "doubled_sigmoid":
            calls.append(event)

    def doubled_sigmoid(x):
        return torch.sigmoid(x) * 2

    g = cudagraphify(doubled_sigmoid)
    sys.setprofile(profiler)
    try:
        for _ in range(4):
            x = torch.randn(3)
            assert torch.equal(g(x), torch.sigmoid(x) * 2)
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    # The warmup and the recording ran the function (the replays run its program, no Python).
    assert len(calls) == 2 and info("cpu")["num_replays"] == 2


def _rows(base):
    return base[1:, 0]  # a view at offset 2 of base's storage, with a gap after each element


@pytest.mark.parametrize(
    "fn, make, why",
    [
        (
            lambda x: x.as_strided((3,), (1,), 0) * 2,  # an absolute offset, before the view
            lambda d: torch.randn(4, 2, device=d)[1:, 0],
            "explicit storage offset, while the input starts at offset 2",
        ),
        (
            lambda x: x.as_strided((4,), (1,)) * 2,  # from the view's start, into its gaps
            lambda d: torch.randn(4, 2, device=d)[1:, 0],
            "outside the input's own elements",
        ),
        (
            lambda x: torch.empty(0, device=x.device).set_(x.untyped_storage()) + 1,
            lambda d: torch.randn(4, 2, device=d)[1:],
            "takes the whole storage",
        ),
        (
            lambda x: x.as_strided((2, 2), (1, 1)).sum(0),  # overlapping input: another layout
            lambda d: torch.randn(1, 3, device=d).expand(2, 3),
            "elements overlap",
        ),
    ],
    ids=["absolute-offset", "into-gaps", "whole-storage", "expanded-input"],
)
def test_views_beyond_a_copied_input_run_eagerly_with_the_reason(device, fn, make, why):
    g = cudagraphify(fn, name="views")
    for _ in range(4):
        x = make(device)
        assert_close(g(x), fn(x))
    assert info(device)["num_replays"] == 0
    (sig,) = g.signatures()
    assert why in sig["eager_reason"] and "Views beyond a copied input" in sig["eager_reason"]


@pytest.mark.parametrize(
    "fn, make",
    [
        (lambda x: x.as_strided((2,), (2,)) * 2, lambda d: torch.randn(4, 2, device=d)[1:, 0]),
        (
            lambda x: x.as_strided((2, 2), (1, 1), x.storage_offset() + 1) * 2,
            lambda d: torch.randn(6, device=d),
        ),
        (lambda x: torch.diagonal(x) + 1, lambda d: torch.randn(5, 5, device=d)[1:, 1:]),
        (lambda x: x.unfold(0, 2, 1).sum(-1), lambda d: torch.randn(9, device=d)[2:]),
    ],
    ids=["within-gapped", "offset-from-its-start", "diagonal-of-a-view", "unfold-of-a-view"],
)
def test_views_within_a_copied_input_are_recorded(device, fn, make):
    g = cudagraphify(fn)
    for _ in range(4):
        x = make(device)
        assert_close(g(x), fn(x))
    assert info(device)["num_replays"] == 2


def test_a_view_beyond_a_static_input_is_recorded():
    base = torch.randn(4, 2)
    g = cudagraphify(lambda x: x.as_strided((3,), (1,), 0) * 2, static_argnums=(0,))
    x = base[1:, 0]
    for _ in range(4):
        base.normal_()
        assert torch.equal(g(x), x.as_strided((3,), (1,), 0) * 2)
    assert info("cpu")["num_replays"] == 2


@torch.library.custom_op("graphtrees_tests::numpy_double", mutates_args=())
def _numpy_double(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy() * 2)


@_numpy_double.register_fake
def _(x):
    return torch.empty_like(x)


def _on_a_thread_pool(x):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.mul, x, 2).result() + 1


def _through_ctypes(x):
    import ctypes

    return x + ctypes.c_float.from_address(x.data_ptr()).value


def _through_dlpack(x):
    return x + torch.from_numpy(np.from_dlpack(x) * 2)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * 2 if x.numpy().sum() > 0 else torch.cat([x, x]),
        lambda x: x + torch.from_numpy(x.numpy() * 2),
        lambda x: x + torch.as_tensor(x.numpy() + 1),
        lambda x: x + torch.tensor(x.numpy() ** 2),
        lambda x: _numpy_double(x) + 1,
        _through_dlpack,
    ],
    ids=[
        "numpy-branch",
        "from_numpy",
        "as_tensor",
        "tensor-of-ndarray",
        "numpy-custom-op",
        "dlpack",
    ],
)
def test_values_read_through_numpy_run_eagerly_with_the_reason(fn):
    # numpy reads values on the host, as tolist() does: a branch on them, or a tensor made from
    # them, is what a program would bake.
    g = cudagraphify(fn)
    for sign in (1, 1, 1, -1, 1):
        x = torch.rand(4) * sign
        assert torch.equal(g(x), fn(x))
    assert info("cpu")["num_replays"] == 0
    (sig,) = g.signatures()
    assert "reads tensor values on the host" in sig["eager_reason"], sig["eager_reason"]
    assert "numpy reads the tensor's values" in sig["eager_reason"]


def test_a_custom_op_reading_values_through_numpy_is_named():
    g = cudagraphify(lambda x: _numpy_double(x) + 1)
    for _ in range(3):
        g(torch.randn(4))
    (sig,) = g.signatures()
    assert "inside the custom op graphtrees_tests::numpy_double" in sig["eager_reason"]


@pytest.mark.parametrize(
    "fn, why",
    [(_through_ctypes, "Tensor.data_ptr()"), (_on_a_thread_pool, "on another thread")],
    ids=["ctypes", "thread-pool"],
)
def test_values_made_outside_the_dispatcher_are_not_replayed_frozen(fn, why, tree_logs, request):
    name = request.node.callspec.id  # the reason is logged once per function name
    g = cudagraphify(fn, name=name)
    for _ in range(5):
        x = torch.randn(4)
        assert_close(g(x), fn(x))
    assert cpu_replays("cpu") == ["python"] and info("cpu")["num_replays"] == 3
    logged = [m for m in tree_logs.messages if m.startswith(f"CPU replays of '{name}'")]
    assert len(logged) == 1 and why in logged[0], logged


def test_a_torchscript_fork_inside_the_function_replays_equal_to_eager():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in torch 2.14

        @torch.jit.script
        def tripled(x: torch.Tensor) -> torch.Tensor:
            return x * 3

        def f(x):
            return torch.jit.wait(torch.jit.fork(tripled, x)) + 1

        g = cudagraphify(f)
        for _ in range(5):
            x = torch.randn(4)
            assert_close(g(x), x * 3 + 1)
    assert info("cpu")["num_replays"] == 3
