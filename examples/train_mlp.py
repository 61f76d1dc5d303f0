"""Training a small MLP with torch.compile(backend="graphtrees").

    python examples/train_mlp.py                 # CUDA if available, else the CPU emulation
    python examples/train_mlp.py --inner inductor

AOTAutograd splits each compiled graph into a forward and a backward; graphtrees records them as
two nodes, the backward a child of the forward. The forward's saved activations are read by the
backward in place. After two warm-up steps (warmup, then recording) every step replays both.
The run is checked against the same training done eagerly.
"""

import argparse
import copy

import torch

import graphtrees


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 10),
    ).to(device)
    reference = copy.deepcopy(model)
    compiled = graphtrees.compile(model, inner=args.inner)

    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 10, generator=gen)  # labels a linear teacher assigns: learnable
    xs = [torch.randn(64, 32, generator=gen) for _ in range(args.steps)]
    data = [(x.to(device), (x @ teacher).argmax(1).to(device)) for x in xs]

    def train(m, f):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(f(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    eager_losses = train(reference, reference)
    graph_losses = train(model, compiled)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    print(f"device {device}, inner compiler {args.inner}, {args.steps} steps")
    print(
        f"loss: first {graph_losses[0]:.4f}, last {graph_losses[-1]:.4f} "
        f"(eager: {eager_losses[0]:.4f} -> {eager_losses[-1]:.4f}); parameters match eager"
    )
    info = graphtrees.tree_info(device)
    for n in info["nodes"]:
        parent = "root" if n["parent"] is None else f"child of #{n['parent']}"
        print(
            f"  #{n['id']} {n['function']:<18} {parent:<12} inputs {n['input_kinds']:<12} "
            f"replayed {n['replays']}x"
        )
    print(
        "  (inputs: S static = parameters, M managed = saved activations read in place, C copied)"
    )
    print(
        f"warmups {info['num_warmups']}, recordings {info['num_recordings']}, "
        f"replays {info['num_replays']}, eager fallbacks {info['num_fallbacks']}"
    )


if __name__ == "__main__":
    main()
