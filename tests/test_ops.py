"""Ordinary model ops through warmup, recording and replays, against eager. On CPU these run
with oneDNN enabled (PyTorch's default), whose kernels allocate scratch memory through
raw_allocate/raw_deallocate: replayed allocations must look exactly like ordinary ones."""

import pytest
import torch
import torch.nn.functional as F

from graphtrees import cudagraphify

from helpers import assert_close, assert_invariants, assert_replays_ran_programs, info


class Vision(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.pool = torch.nn.MaxPool2d(2)
        self.up = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.avg = torch.nn.AdaptiveAvgPool2d(4)

    def forward(self, x):
        h = self.pool(F.relu(self.bn(self.conv(x))))
        return self.avg(self.up(h))


class Attention(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        )


class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(100, 16, mode="mean")

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


def _inputs(name, device, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "vision":
        return (torch.randn(2, 3, 32, 32, generator=g).to(device),)
    if name == "attention":
        return (torch.randn(2, 8, 32, generator=g).to(device),)
    ids = torch.randint(0, 100, (12,), generator=g).to(device)
    return ids, torch.tensor([0, 3, 7], device=device)


@pytest.mark.parametrize("name", ["vision", "attention", "bag"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_model_ops_replay_like_eager(device, name, mode):
    if torch.device(device).type == "cpu":
        assert torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    torch.manual_seed(0)
    model = {"vision": Vision, "attention": Attention, "bag": Bag}[name]().to(device).eval()
    f = cudagraphify(model)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        for step in range(5):
            args = _inputs(name, device, step)
            assert_close(f(*args), model(*args))
    assert info(device)["num_replays"] == 3
    assert_replays_ran_programs(device)
    assert [s["eager_reason"] for s in f.signatures()] == [None]
    assert_invariants(device)
