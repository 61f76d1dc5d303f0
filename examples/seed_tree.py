"""The seed story of graphtrees: g1 -> g2, then g1 -> g3, in one tree and one memory pool.

    python examples/seed_tree.py            # CUDA if available, else the CPU emulation
    python examples/seed_tree.py --device cpu

g1 (a trunk) feeds two heads, g2 and g3, that are never used in the same step. graphtrees records
g1 once and g2 and g3 as two children of g1. When execution switches from the g2 branch to the
g3 branch, the pool is restored to the checkpoint taken after g1 was recorded: g1's output stays
intact, and g3 reuses the memory g2 used, so the pool holds the maximum over the two paths
rather than their sum.
"""

import argparse

import torch

import graphtrees


class MLP(torch.nn.Module):
    def __init__(self, d_in, d_hidden, d_out):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def mib(n):
    return f"{n / 2**20:.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    d = args.width
    trunk = MLP(d, d, d).to(device)
    head_a = MLP(d, 2 * d, d).to(device)  # g2
    head_b = MLP(d, 2 * d, d).to(device)  # g3: same memory needs as g2
    g1 = graphtrees.cudagraphify(trunk, name="g1")
    g2 = graphtrees.cudagraphify(head_a, name="g2")
    g3 = graphtrees.cudagraphify(head_b, name="g3")
    x = torch.randn(args.batch, d, device=device)

    with torch.no_grad():
        h_ref = trunk(x)
        ya_ref, yb_ref = head_a(h_ref), head_b(h_ref)
        print(
            f"graphtrees {graphtrees.__version__} on {device} "
            f"(backend: {'CUDA graphs' if device.type == 'cuda' else 'CPU emulation'})\n"
        )

        for _step in range(3):  # warmup, record, replay
            graphtrees.mark_step_begin()
            h = g1(x)
            ya = g2(h)
            torch.testing.assert_close(ya, ya_ref)
        after_a = graphtrees.tree_info(device)["pool"]["reserved_bytes"]
        print(f"after g1 -> g2:  pool reserved {mib(after_a)}")

        for _step in range(3):  # the other branch: warmup, record, replay
            graphtrees.mark_step_begin()
            h = g1(x)
            yb = g3(h)
            torch.testing.assert_close(yb, yb_ref)
            torch.testing.assert_close(h, h_ref)  # g1's output survived g3's run
        info = graphtrees.tree_info(device)
        after_b = info["pool"]["reserved_bytes"]
        print(
            f"after g1 -> g3:  pool reserved {mib(after_b)} "
            f"(+{mib(after_b - after_a)} for the second branch)\n"
        )

        for _ in range(3):  # both branches keep replaying correctly
            graphtrees.mark_step_begin()
            torch.testing.assert_close(g2(g1(x)), ya_ref)
            graphtrees.mark_step_begin()
            torch.testing.assert_close(g3(g1(x)), yb_ref)

    info = graphtrees.tree_info(device)
    print("tree:")
    by_id = {n["id"]: n for n in info["nodes"]}

    def show(node, depth):
        print(
            f"  {'  ' * depth}#{node['id']} {node['function']:<6} "
            f"writes {mib(node['pool_bytes'])}, replayed {node['replays']}x"
        )
        for c in node["children"]:
            show(by_id[c], depth + 1)

    for n in info["nodes"]:
        if n["parent"] is None:
            show(n, 0)
    separate = sum(n["pool_bytes"] for n in info["nodes"])
    print(
        f"\nnodes {info['num_nodes']}, roots {info['num_roots']}, "
        f"checkpoint restores {info['num_checkpoints']}, replays {info['num_replays']}"
    )
    print(f"shared pool reserved:          {mib(info['pool']['reserved_bytes'])}")
    print(
        f"one pool per graph would need: {mib(separate)} or more "
        f"(the sum of what each graph writes; each pool also rounds up to whole segments)"
    )
    print(f"saved:                         {mib(separate - info['pool']['reserved_bytes'])}\n")
    print(graphtrees.tree_to_dot(device))


if __name__ == "__main__":
    main()
