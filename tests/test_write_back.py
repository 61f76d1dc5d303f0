"""Issue 39: silent wrong results of the in-place write-back of copied inputs (Note [Copied inputs
written back] in csrc/WriteBack.h) and of argument identity (Note [Argument aliases] in
csrc/ArgumentAliases.h). Each test compares with an eager twin and failed before its fix.

The write-back tests mutate by copies only (`copy_`, slice assignment, `clone`): copies move bytes
on the CUDA stand-in too, so they run there, and their values are read through `.cpu()` (a copy)
rather than assert_close (which compares structure only on the stand-in). The values a function
copies from are static inputs updated in place between calls (`refill`): a replay copies its
copied inputs into their placeholders with one `_foreach_copy_` kernel, which the stand-in does
not execute."""

import ctypes

import numpy as np
import pytest
import torch

import graphtrees
from graphtrees import cudagraphify

from helpers import info

pytestmark = pytest.mark.usefixtures("no_grad")


def values(t):
    """The tensor's values on the host: a copy, which the stand-in executes."""
    return t.detach().cpu().clone()


def full(n, v, device):
    """A tensor of n copies of v made on the host and copied to the device (no fill kernel)."""
    return torch.full((n,), float(v)).to(device)


def refill(t, v):
    """Sets every element of t to v by a host-to-device copy."""
    t.copy_(torch.full(t.shape, float(v)))
    return t


# Ops whose kernels write their argument's memory without moving its version counter, as a C++ or
# Triton kernel registered with torch.library does (vLLM's cache writers, fused in-place norms).
_lib = torch.library.Library("graphtrees_test39", "DEF")
_lib.define("fill_from_(Tensor(a!) x, Tensor y) -> ()")
_lib.impl("fill_from_", lambda x, y: (x.data.copy_(y), None)[1], "CompositeExplicitAutograd")
_lib.define("add_one_(Tensor(a!) x) -> ()")
_lib.impl("add_one_", lambda x: (x.data.add_(1), None)[1], "CompositeExplicitAutograd")
_lib.define("peek_base(Tensor x) -> Tensor")
_lib.impl("peek_base", lambda x: x.as_strided((2,), (1,), 0).clone(), "CompositeExplicitAutograd")


# --- 1. the same tensor at a static and a copied position -----------------------------------


@pytest.mark.needs_values("add_ and mul compute the values")
def test_issue_repro_the_same_tensor_static_and_copied(device):
    g = cudagraphify(lambda a, b: (b.add_(1), a * 2)[1], static_argnums=(0,))
    x = torch.zeros(4, device=device)
    got = [values(g(x, x))[0].item() for _ in range(4)]
    assert got == [2.0, 4.0, 6.0, 8.0]
    assert values(x).tolist() == [4.0] * 4


@pytest.mark.parametrize("mutated", ["copied", "static"])
def test_the_same_tensor_at_a_static_and_a_copied_position_is_one_tensor(device, mutated):
    # Eagerly a and b are one tensor: the write through one is read through the other.
    def f(a, b, y):
        (b if mutated == "copied" else a).copy_(y)
        return (a if mutated == "copied" else b).clone()

    g = cudagraphify(f, static_argnums=(0, 2))
    x = full(4, 0, device)
    y = full(4, 0, device)
    for i in range(5):
        out = g(x, x, refill(y, i + 1))
        assert values(out).tolist() == [i + 1.0] * 4
        assert values(x).tolist() == [i + 1.0] * 4
    assert info(device)["num_replays"] == 3


def test_a_module_buffer_passed_as_an_argument_is_the_buffer(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(4))
            self.register_buffer("src", torch.zeros(4))

        def forward(self, y, other):
            other.copy_(y)
            return self.buf.clone()

    m = M().to(device)
    g = cudagraphify(m)
    for i in range(5):
        out = g(refill(m.src, i + 1), m.buf)
        assert values(out).tolist() == [i + 1.0] * 4
        assert values(m.buf).tolist() == [i + 1.0] * 4
    assert info(device)["num_replays"] == 3


# --- 2. mutations that do not move the version counter ---------------------------------------


@pytest.mark.parametrize("how", ["library-op", "data", "dlpack"])
def test_a_mutation_without_a_version_bump_is_written_back(device, how):
    def f(cache, y):
        if how == "library-op":
            torch.ops.graphtrees_test39.fill_from_(cache, y)
        elif how == "data":
            cache.data.copy_(y)
        else:
            torch.from_dlpack(cache).copy_(y)
        return cache.clone()

    g = cudagraphify(f, static_argnums=(1,))
    cache = full(4, 0, device)
    y = full(4, 0, device)
    for i in range(5):
        out = g(cache, refill(y, i + 1))
        assert values(cache).tolist() == [i + 1.0] * 4
        assert values(out).tolist() == [i + 1.0] * 4


@pytest.mark.needs_values("add_ computes the values")
def test_issue_repro_a_library_op_mutating_a_cache_five_times(device):
    g = cudagraphify(lambda c: (torch.ops.graphtrees_test39.add_one_(c), c * 1)[1])
    cache = torch.zeros(4, device=device)
    for _ in range(5):
        g(cache)
    assert values(cache).tolist() == [5.0] * 4


def test_a_write_no_op_shows_is_written_back_or_refused():
    # ctypes writes the input's memory: no op, no version counter, no schema tells.
    def f(x, y):
        ctypes.memmove(x.data_ptr(), y.data_ptr(), x.nbytes)
        return x.clone()

    g = cudagraphify(f)
    x = torch.zeros(4)
    for i in range(5):
        out = g(x, torch.full((4,), float(i + 1)))
        assert x.tolist() == [i + 1.0] * 4
        assert out.tolist() == [i + 1.0] * 4


# --- 3. on_overwrite="copy" with an input that is a live pool output ------------------------


@pytest.mark.needs_values("add_ and mul compute the values")
def test_issue_repro_copy_on_overwrite_keeps_the_mutation_of_a_live_output(device):
    g = cudagraphify(lambda h, inc: (h.add_(inc), h * 2)[1], on_overwrite="copy")
    h = torch.zeros(4, device=device)
    inc = torch.ones(4, device=device)
    kept = []
    for _ in range(8):
        graphtrees.mark_step_begin()
        out = g(h, inc)
        kept.append(h)
        h = out
    assert [values(k)[0].item() for k in kept] == [2.0 ** (i + 1) - 1 for i in range(8)]


@pytest.mark.parametrize("chained", [True, False])
def test_copy_on_overwrite_writes_back_into_the_callers_migrated_tensor(device, chained):
    # Each call's input is the previous call's output, kept; the function overwrites it, so every
    # kept tensor must end holding its own step's value, whether its memory was reused since (it
    # was copied out of the pool first) or not.
    def f(h, y):
        h.copy_(y)
        return y.clone()

    g = cudagraphify(f, on_overwrite="copy", static_argnums=(1,))
    h = full(4, 0, device)
    y = full(4, 0, device)
    kept = []
    for i in range(8):
        if not chained:
            graphtrees.mark_step_begin()
        out = g(h, refill(y, i + 1))
        kept.append(h)
        h = out
    assert [values(k)[0].item() for k in kept] == [float(i + 1) for i in range(8)]


# --- 4. arguments equal by == but not by value ----------------------------------------------


@pytest.mark.parametrize(
    "a, b",
    [
        (np.float64(0.0), np.float64(-0.0)),
        (np.float32(0.0), np.float32(-0.0)),
        (np.complex128(0.0), np.complex128(complex(-0.0, 0.0))),
    ],
    ids=["float64", "float32", "complex128"],
)
def test_numpy_scalars_are_compared_bit_for_bit(a, b):
    g = cudagraphify(lambda x, s: x / s.real)  # the real part's sign: inf or -inf
    x = torch.ones(2)
    for s in [a, b, a, b, a, b]:
        torch.testing.assert_close(g(x, s), x / s.real)


def test_a_float_subclass_is_compared_bit_for_bit():
    class F(float):
        pass

    g = cudagraphify(lambda x, s: x / s)
    x = torch.ones(2)
    for s in [F(0.0), F(-0.0)] * 3:
        torch.testing.assert_close(g(x, s), x / s)


def test_numpy_arrays_and_other_numpy_scalars_are_not_keyed_by_their_bytes_alone():
    # Equal bytes, other shape or dtype (an array) or another unit (a timedelta64): only float
    # and complex scalars are compared bit for bit; an array is unhashable (eager, as before),
    # a timedelta64 keeps its hash and ==.
    f = lambda x, a: x[: a.shape[0]] * 1  # noqa: E731
    g = cudagraphify(f)
    x = torch.ones(8)
    for a in [np.zeros(4, np.float32)] * 3 + [np.zeros(2, np.float64)] * 3:
        assert g(x, a).shape == f(x, a).shape
    f = lambda x, t: x * float(t / np.timedelta64(1, "s"))  # noqa: E731
    g = cudagraphify(f)
    for t in [np.timedelta64(1, "m")] * 3 + [np.timedelta64(1, "s")] * 3:
        torch.testing.assert_close(g(x, t), f(x, t))


def test_a_nan_numpy_scalar_matches_its_signature():
    g = cudagraphify(lambda x, s: x + s)
    x = torch.ones(2)
    for _ in range(5):
        g(x, np.float64("nan"))
    assert len(g.signatures()) == 1
    assert info("cpu")["num_replays"] == 3


# --- 5. a view beyond a copied input made inside a library op -------------------------------


def test_a_view_beyond_a_copied_input_inside_a_library_op_is_refused(tree_logs):
    g = cudagraphify(lambda x: torch.ops.graphtrees_test39.peek_base(x))
    for i in range(5):
        base = torch.arange(8.0) + 10 * i
        x = base[4:6]
        assert g(x).tolist() == base[:2].tolist()
    assert "aten::as_strided on the memory of its input tensor #0" in tree_logs.text
    assert "Note [Views beyond a copied input]" in tree_logs.text
    assert info("cpu")["num_nodes"] == 0


# --- 6. a Parameter made inside the function ----------------------------------------------


def test_a_parameter_made_inside_the_function_comes_back_a_parameter():
    def f(x):
        return torch.nn.Parameter(x * 2, requires_grad=False)

    g = cudagraphify(f)
    for i in range(5):
        x = torch.full((4,), float(i))
        out = g(x)
        assert type(out) is torch.nn.Parameter and not out.requires_grad
        assert out.tolist() == [2.0 * i] * 4
