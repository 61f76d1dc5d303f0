"""diffusers built from configs (a tiny UNet2DConditionModel and a DDIM scheduler, random weights,
nothing downloaded): classifier-free-guidance sampling through cudagraphify and through
torch.compile(backend="graphtrees"), equal to eager. Guided steps and unguided ones are two
branches of one tree."""

import pytest
import torch

import graphtrees

from helpers import assert_close, assert_invariants, assert_replays_ran_programs, info

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("no_grad")


def tiny_unet(device):
    torch.manual_seed(0)
    return (
        diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        )
        .to(device)
        .eval()
    )


def sample(unet, cond, uncond, steps=6, guidance=4.0, batched=False):
    """DDIM with classifier-free guidance on all steps but the last two, written the natural way:
    two calls per guided step (`batched`: one call on the doubled batch, as diffusers' pipelines
    do)."""
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=100)
    scheduler.set_timesteps(steps)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 8, 8, generator=gen).to(cond.device)
    for i, t in enumerate(scheduler.timesteps):
        # The UNet takes the timestep on its own device, the scheduler indexes its tables with it
        # on the host (a CPU timestep would make the UNet's inputs span two devices).
        t_unet = t.to(cond.device)
        if i >= steps - 2:
            eps = unet(x, t_unet, encoder_hidden_states=cond).sample
        elif batched:
            both = unet(torch.cat([x, x]), t_unet, encoder_hidden_states=torch.cat([uncond, cond]))
            eps_u, eps_c = both.sample.chunk(2)
            eps = eps_u + guidance * (eps_c - eps_u)
        else:
            eps_c = unet(x, t_unet, encoder_hidden_states=cond).sample
            eps_u = unet(x, t_unet, encoder_hidden_states=uncond).sample
            eps = eps_u + guidance * (eps_c - eps_u)
        x = scheduler.step(eps, t, x).prev_sample
    return x


def _conditions(device):
    torch.manual_seed(2)
    return torch.randn(1, 5, 32, device=device), torch.zeros(1, 5, 32, device=device)


def test_guided_sampling_through_cudagraphify(device):
    unet = tiny_unet(device)
    cond, uncond = _conditions(device)
    ref = sample(unet, cond, uncond)
    # eps_c is held while the unet runs again on the null condition: on_overwrite="copy".
    graphed = graphtrees.cudagraphify(unet, on_overwrite="copy")
    for _ in range(3):
        assert_close(sample(graphed, cond, uncond), ref)
    t = info(device)
    assert t["num_replays"] >= 20 and t["num_fallbacks"] == 0
    assert_replays_ran_programs(device)
    assert graphed.signatures()[0]["eager_reason"] is None
    assert_invariants(device)


def test_guided_sampling_through_torch_compile(device):
    unet = tiny_unet(device)
    cond, uncond = _conditions(device)
    # The pipelines' batched guidance needs nothing held across calls: the plain backend.
    ref = sample(unet, cond, uncond, batched=True)
    compiled = torch.compile(unet, backend="graphtrees")
    for _ in range(3):
        assert_close(sample(compiled, cond, uncond, batched=True), ref)
    assert info(device)["num_replays"] >= 10
    # Two calls per guided step: graphtrees.compile with on_overwrite="copy".
    graphtrees.reset()
    ref = sample(unet, cond, uncond)
    compiled = graphtrees.compile(unet, on_overwrite="copy")
    for _ in range(3):
        assert_close(sample(compiled, cond, uncond), ref)
    t = info(device)
    assert t["num_replays"] >= 20 and t["num_fallbacks"] == 0
    assert_invariants(device)
