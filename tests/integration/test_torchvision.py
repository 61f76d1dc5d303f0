"""A torchvision ResNet-18 (random weights) under inference_mode, three batch sizes."""

import pytest
import torch

import graphtrees

from helpers import assert_close, assert_invariants, assert_replays_ran_programs, info

torchvision = pytest.importorskip("torchvision")


def test_resnet18_three_batch_sizes_under_inference_mode(device):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device).eval()
    g = graphtrees.cudagraphify(model)
    with torch.inference_mode():
        for batch in (1, 4, 2, 1, 4, 2, 1, 4, 2):
            x = torch.randn(batch, 3, 64, 64, device=device)
            assert_close(g(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(g.signatures()) == 3
    assert all(s["eager_reason"] is None for s in g.signatures())
    assert info(device)["num_replays"] == 3
    assert_replays_ran_programs(device)
    assert_invariants(device)
