"""A diffusion-style sampling loop written the natural way: a text encoder called for the
condition and the null condition, a denoiser with guidance on some steps and off on others --
a real g1 -> g2 / g1 -> g3 tree -- with on_overwrite="copy"."""

import importlib.util
import os

import pytest
import torch

import graphtrees

from helpers import ROOT, assert_close, assert_invariants, assert_replays_ran_programs, info

pytestmark = pytest.mark.usefixtures("no_grad")


def _example():
    """examples/diffusion_cfg.py, whose models and sampler this test checks more closely."""
    spec = importlib.util.spec_from_file_location(
        "diffusion_cfg", os.path.join(ROOT, "examples", "diffusion_cfg.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_guided_sampling_matches_eager(device):
    example = _example()
    parts = example.eager_parts(device)
    enc, first, guided, plain = (graphtrees.cudagraphify(f, on_overwrite="copy") for f in parts)
    ids = torch.randint(1, 64, (2, 7), device=device)
    null_ids = torch.zeros(2, 7, dtype=torch.long, device=device)
    for _ in range(3):
        noise = torch.randn(2, 32, device=device)
        out = example.sample(enc, first, guided, plain, ids, null_ids, noise, steps=8)
        ref = example.sample(*parts, ids, null_ids, noise, steps=8)
        assert_close(out, ref)
    t = info(device)
    assert t["num_replays"] > 20 and t["num_migrations"] > 0
    assert_replays_ran_programs(device)
    # Both branches hang off the same g1 node of the tree.
    parents = {}
    for n in t["nodes"]:
        parents.setdefault(n["parent"], set()).add(n["function"].split(".")[-1])
    assert any({"guided_fn", "plain_fn"} <= kids for kids in parents.values()), t["nodes"]
    assert_invariants(device)
