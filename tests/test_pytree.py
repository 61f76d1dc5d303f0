"""Containers beyond tuples, lists, dicts and namedtuples: dataclasses and types registered with
torch.utils._pytree, in arguments and results, with the result type preserved."""

import collections
import dataclasses

import pytest
import torch

from graphtrees import cudagraphify

from helpers import assert_close, info

pytestmark = pytest.mark.usefixtures("no_grad")


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    aux: torch.Tensor
    note: str = "ok"


class Pair:
    """A class of its own, registered with torch.utils._pytree."""

    def __init__(self, a, b):
        self.a, self.b = a, b


torch.utils._pytree.register_pytree_node(
    Pair, lambda p: ([p.a, p.b], None), lambda children, _: Pair(*children)
)


def test_dataclass_argument_and_result(device):
    g = cudagraphify(lambda batch: Result(batch.x * batch.scale, batch.x.sum()))
    for _ in range(4):
        b = Batch(torch.randn(8, device=device), 2.0)
        r = g(b)
        assert type(r) is Result and r.note == "ok"
        assert_close(r.y, b.x * 2.0)
        assert_close(r.aux, b.x.sum())
    assert info(device)["num_replays"] == 2
    r = g(Batch(torch.randn(8, device=device), 3.0))  # another scale: another signature
    assert len(g.signatures()) == 2


def test_registered_type_and_ordered_dict(device):
    g = cudagraphify(lambda p: collections.OrderedDict(s=p.a + p.b, d=Pair(p.a - p.b, p.a)))
    for _ in range(4):
        a, b = torch.randn(4, device=device), torch.randn(4, device=device)
        out = g(Pair(a, b))
        assert type(out) is collections.OrderedDict and list(out) == ["s", "d"]
        assert type(out["d"]) is Pair
        assert_close(out["s"], a + b)
        assert_close(out["d"].a, a - b)
        assert_close(out["d"].b, a)
    assert info(device)["num_replays"] == 2


def test_unregistered_result_type_runs_eagerly_and_says_how_to_graph_it(device):
    class Opaque:
        pass

    g = cudagraphify(lambda x: Opaque())
    for _ in range(3):
        assert isinstance(g(torch.ones(2, device=device)), Opaque)
    (sig,) = g.signatures()
    assert "registered with torch.utils._pytree" in sig["eager_reason"]


@pytest.mark.parametrize(
    "make", [lambda: float("nan"), lambda: complex(float("nan"), 1.0), lambda: -0.0]
)
def test_a_python_result_equal_to_itself_bit_for_bit_is_the_same_result(device, make):
    # Non-tensor results are compared bit for bit between calls: a complex NaN (an .item() of a
    # complex tensor, found by the OpInfo sweep on CUDA) was "a value that changed" and raised.
    g = cudagraphify(lambda x: (x * 2, make()))  # a new Python object on every call
    for _ in range(4):
        x = torch.randn(3, device=device)
        out, got = g(x)
        assert_close(out, x * 2)
        assert repr(got) == repr(make())
    assert info(device)["num_replays"] == 2
