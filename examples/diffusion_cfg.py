"""A diffusion-style sampler with classifier-free guidance, written the natural way:

    cond = enc(ids); uncond = enc(null_ids)      # two calls of one graphed encoder
    for t in steps: x = step(x, cond, uncond)    # guidance on some steps, off on others

The second encoder call starts a new step that reuses the first call's memory; with
on_overwrite="copy" graphtrees copies `cond` out of the pool first, so it stays valid. The guided
and unguided steps are two branches under one shared node (g1 -> g2, g1 -> g3).

    python examples/diffusion_cfg.py            # CUDA if available, else the CPU emulation
"""

import argparse

import torch

import graphtrees


class Encoder(torch.nn.Module):
    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)

    def forward(self, ids):
        return torch.tanh(self.mix(self.emb(ids).mean(1)))


class Denoiser(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(2 * d, 64), torch.nn.SiLU(), torch.nn.Linear(64, d)
        )

    def forward(self, x, cond):
        return self.net(torch.cat([x, cond], -1))


def sample(enc, trunk, guided, plain, ids, null_ids, noise, steps=10, scale=3.0):
    cond = enc(ids)
    uncond = enc(null_ids)
    x = noise
    for t in range(steps):
        h = trunk(x)
        eps = guided(h, cond, uncond, scale) if t % 2 == 0 else plain(h, cond)
        x = x - 0.1 * eps
    return x


def eager_parts(device):
    """The encoder and the three step functions, eager: (encoder, trunk, guided, plain)."""
    torch.manual_seed(0)
    encoder = Encoder().to(device).eval()
    denoiser = Denoiser().to(device).eval()

    def trunk_fn(x):
        return x * 0.9

    def guided_fn(h, cond, uncond, scale):
        e_c, e_u = denoiser(h, cond), denoiser(h, uncond)
        return e_u + scale * (e_c - e_u)

    def plain_fn(h, cond):
        return denoiser(h, cond)

    return encoder, trunk_fn, guided_fn, plain_fn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    parts = eager_parts(args.device)
    enc, trunk, guided, plain = (graphtrees.cudagraphify(f, on_overwrite="copy") for f in parts)
    ids = torch.randint(1, 64, (4, 9), device=args.device)
    null_ids = torch.zeros_like(ids)
    with torch.no_grad():
        for _ in range(3):
            noise = torch.randn(4, 32, device=args.device)
            out = sample(enc, trunk, guided, plain, ids, null_ids, noise)
            ref = sample(*parts, ids, null_ids, noise)
            torch.testing.assert_close(out, ref)
    info = graphtrees.tree_info(args.device)
    print(
        f"samples equal to eager; backend {info['backend']}, {info['num_replays']} replays, "
        f"{info['num_migrations']} outputs copied out of the pool, {info['num_nodes']} nodes"
    )
    print(graphtrees.tree_to_dot(args.device))


if __name__ == "__main__":
    main()
