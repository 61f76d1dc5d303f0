"""A diffusion-style sampling loop written the natural way: a text encoder called for the
condition and the null condition, a denoiser with guidance on some steps and off on others --
a real g1 -> g2 / g1 -> g3 tree -- with on_overwrite="copy"."""

import pytest
import torch
from helpers import assert_invariants, info

import graphtrees

pytestmark = pytest.mark.usefixtures("no_grad")


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.mix = torch.nn.Linear(32, 32)

    def forward(self, ids):
        return torch.tanh(self.mix(self.emb(ids).mean(1)))


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))

    def forward(self, x, cond):
        return self.net(torch.cat([x, cond], -1))


def sample(enc, first, guided, plain, ids, null_ids, noise, steps=8, scale=3.0):
    cond = enc(ids)
    uncond = enc(null_ids)  # starts a new step: cond stays valid because of on_overwrite="copy"
    x = noise
    for t in range(steps):
        h = first(x)  # g1
        if t % 2 == 0:  # guidance on: g1 -> g2
            eps = guided(h, cond, uncond, scale)
        else:  # guidance off: g1 -> g3
            eps = plain(h, cond)
        x = x - 0.1 * eps
    return x


def test_guided_sampling_matches_eager(device):
    torch.manual_seed(0)
    encoder, denoiser = Encoder().to(device).eval(), Denoiser().to(device).eval()

    def first_fn(x):
        return x * 0.9

    def guided_fn(h, cond, uncond, scale):
        e_c, e_u = denoiser(h, cond), denoiser(h, uncond)
        return e_u + scale * (e_c - e_u)

    def plain_fn(h, cond):
        return denoiser(h, cond)

    copy = dict(on_overwrite="copy")
    enc = graphtrees.cudagraphify(encoder, **copy)
    first = graphtrees.cudagraphify(first_fn, **copy)
    guided = graphtrees.cudagraphify(guided_fn, **copy)
    plain = graphtrees.cudagraphify(plain_fn, **copy)
    ids = torch.randint(1, 64, (2, 7), device=device)
    null_ids = torch.zeros(2, 7, dtype=torch.long, device=device)
    for _ in range(3):
        noise = torch.randn(2, 32, device=device)
        out = sample(enc, first, guided, plain, ids, null_ids, noise)
        ref = sample(encoder, first_fn, guided_fn, plain_fn, ids, null_ids, noise)
        torch.testing.assert_close(out, ref)
    t = info(device)
    assert t["num_replays"] > 20 and t["num_migrations"] > 0
    # Both branches hang off the same g1 node of the tree.
    parents = {}
    for n in t["nodes"]:
        parents.setdefault(n["parent"], set()).add(n["function"].split(".")[-1])
    assert any({"guided_fn", "plain_fn"} <= kids for kids in parents.values()), t["nodes"]
    assert_invariants(device)
