"""Data-parallel training (DDP) with torch.compile and graphtrees, one process per device.

    torchrun --nproc-per-node 2 examples/ddp_train.py              # CPU: gloo, CPU emulation
    GRAPHTREES_CUDA=1 torchrun --nproc-per-node 2 examples/ddp_train.py   # GPUs: NCCL, CUDA graphs

Dynamo's DDP optimizer splits the compiled graph at DDP's bucket boundaries; graphtrees records
each piece's forward and backward as nodes of this process's tree, and DDP's all-reduces run
between the backward nodes, overlapping with them. Every rank trains on its own data; at the
end the parameters must be the same on every rank. On GPUs, each rank uses the GPU of its
LOCAL_RANK and the CUDA backend (off unless GRAPHTREES_CUDA=1, see README.md).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import graphtrees


class MLP(torch.nn.Module):
    # A module class of our own: after DDP's forward graph-breaks, dynamo does not compile a
    # bare torch.nn.Sequential on its own (its forward is torch.nn's code), only user code.
    def __init__(self, width):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, width),
            torch.nn.GELU(),
            torch.nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.net(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--inner", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=1.0,
        help="DDP's bucket size (>= 1, DDP's first bucket): smaller buckets, more graph pieces",
    )
    args = parser.parse_args()

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # device_id= creates the NCCL communicators now, before any graph is recorded (a
        # collective cannot set them up inside a capture; graphtrees' warmup run is the other
        # safeguard).
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial parameters everywhere (DDP broadcasts rank 0's too)
    model = MLP(args.width).to(device)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    compiled = graphtrees.compile(ddp, inner=args.inner)

    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 10, generator=gen)  # labels a linear teacher assigns: learnable
    gen.manual_seed(1 + rank)  # each rank its own batches
    xs = [torch.randn(64, 32, generator=gen) for _ in range(args.steps)]
    data = [(x.to(device), (x @ teacher).argmax(1).to(device)) for x in xs]

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        if step in (0, 1, 2) or step == len(data) - 1 or step % 5 == 4:
            print(f"[rank {rank}] step {step:2d}  loss {loss.item():.4f}", flush=True)

    # Every rank's tree is its own: print them one rank at a time.
    info = graphtrees.tree_info(device)
    for r in range(world):
        if r == rank:
            print(
                f"[rank {rank}] tree on {info['device']} ({info['backend']}): "
                f"{info['num_nodes']} nodes, {info['num_warmups']} warmups, "
                f"{info['num_recordings']} recordings, {info['num_replays']} replays, "
                f"{info['num_fallbacks']} eager fallbacks",
                flush=True,
            )
            for n in info["nodes"]:
                parent = "root" if n["parent"] is None else f"child of #{n['parent']}"
                print(
                    f"[rank {rank}]   #{n['id']} {n['function']:<16} {parent:<12} "
                    f"inputs {n['input_kinds']:<8} replayed {n['replays']}x",
                    flush=True,
                )
        dist.barrier()

    # DDP all-reduced the gradients of different data: the parameters must agree on every rank.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    differ = [r for r, t in enumerate(gathered) if not torch.equal(t, flat)]
    if differ:
        raise SystemExit(f"[rank {rank}] parameters differ from ranks {differ}")
    if rank == 0:
        print(f"parameters agree across {world} ranks ({flat.numel()} values)", flush=True)
    # Tear down in order while the process group lives: the compiled model and its graphs, the
    # trees (their memory, and what the process group's threads may still hold of it), then
    # the group.
    del compiled, ddp, opt, data
    graphtrees.reset()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
