"""The ranks of tests/test_distributed.py.

Each rank is a process of its own, spawned by the tests, in a real gloo process group on
localhost. A case returns a JSON-able dict of what it saw, which the test asserts on; checks that
need the rank's own tensors (values against eager, agreement across ranks) are asserted here and
fail the test with this rank's traceback. Several cases may run one after the other in the same
processes, which saves starting torch twice per case. Everything is at module level so that a
spawned interpreter can import it.
"""

import copy
import datetime
import gc
import logging
import traceback
import warnings


class _Records(logging.Handler):
    """Keeps the messages of the `graphtrees` logger, so that a case can return them."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


def entry(rank, world_size, port, jobs, queue):
    """Runs each (case, options) of `jobs` in turn, CASES[case](rank, world_size, **options), in
    one gloo group, with the trees reset in between. Puts ("ok", rank, job index, result) on
    `queue` for each, then ("done", rank, None, None); or ("error", rank, job index, traceback)
    at the first exception, after which the remaining jobs do not run (the ranks may be out of
    step)."""
    index = None
    dist = None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # two ranks share the CI machine's cores
        # A timeout, so that a rank whose peer died fails instead of waiting for 30 minutes.
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        for index, (case, options) in enumerate(jobs):
            queue.put(("ok", rank, index, _run_case(rank, world_size, case, options)))
        queue.put(("done", rank, None, None))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        # Reported before the group is destroyed, which makes the peers fail too: this rank's
        # error is then the first the test sees.
        queue.put(("error", rank, index, traceback.format_exc()))
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


def _run_case(rank, world_size, case, options):
    import torch

    import graphtrees
    from graphtrees._ext import get_ext

    get_ext()._set_debug_checks(True)  # the per-call pool invariant check, as in conftest
    records = _Records()
    log = logging.getLogger("graphtrees")
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        result = CASES[case](rank, world_size, **options)
    finally:
        log.removeHandler(records)
    result["logs"] = records.messages
    # As tests/conftest.py checks after every test: after a reset no pool block is left.
    torch._dynamo.reset()
    graphtrees.reset()
    gc.collect()
    totals = tuple(get_ext()._cpu_pool_totals())
    assert totals == (0, 0, 0), f"after reset(): (pools, blocks, bytes) = {totals}"
    return result


def _summary(info):
    keys = (
        "device",
        "backend",
        "num_nodes",
        "num_warmups",
        "num_recordings",
        "num_replays",
        "num_program_replays",
        "num_fallbacks",
        "num_rerecords",
        "pending_backward",
    )
    out = {k: info[k] for k in keys}
    out["nodes"] = [
        {k: n[k] for k in ("id", "parent", "function", "input_kinds", "replays", "cpu_replay")}
        for n in info["nodes"]
    ]
    return out


def _assert_same_across_ranks(tensors, world_size):
    """Every rank holds the same values (compared through an all_gather)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    for other, theirs in enumerate(gathered):
        assert torch.equal(theirs, flat), f"the parameters of rank {other} differ"


# ---------------------------------------------------------------------------------------------
# DDP through torch.compile


def _mlp():
    import torch

    class MLP(torch.nn.Module):
        # A class of our own rather than an nn.Sequential: after DDP's forward graph-breaks,
        # dynamo does not compile a frame that is torch.nn's own code (the forward of
        # Sequential or Linear) on its own, so a bare Sequential would run entirely eagerly
        # (the same effect as pytorch/pytorch#111966).
        def __init__(self):
            super().__init__()
            # 2.2 MB of parameters: with bucket_cap_mb=1, DDP makes three buckets and dynamo's
            # DDP optimizer splits the graph into three pieces.
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 512),
                torch.nn.GELU(),
                torch.nn.Linear(512, 512),
                torch.nn.GELU(),
                torch.nn.Linear(512, 512),
                torch.nn.GELU(),
                torch.nn.Linear(512, 4),
            )

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    return MLP()


def ddp_training(rank, world_size, how, steps=10):
    """Trains a DDP model for `steps` steps eagerly and through graphtrees (`how`: "make_backend"
    or "compile" with aot_eager, "split" with aot_eager and splitting_ops, "string" with
    backend="graphtrees", i.e. Inductor) on this
    rank's own data, and checks the compiled run against the eager one."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import graphtrees

    model = _mlp()
    reference = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model, bucket_cap_mb=1)
    ddp_ref = DDP(reference, bucket_cap_mb=1)

    # DDP's default all-reduce, through a comm hook that notes which graphtrees node ran last
    # when each bucket's all-reduce starts: the all-reduces run between the backward pieces.
    comm = []

    def hook(seen, bucket):
        if seen is not None:
            t = graphtrees.tree_info("cpu")
            names = {n["id"]: n["function"] for n in t["nodes"]}
            seen.append([bucket.index(), names.get(t["current_node"]), t["num_replays"]])
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(comm, hook)
    ddp_ref.register_comm_hook(None, hook)

    if how == "make_backend":
        compiled = torch.compile(ddp, backend=graphtrees.make_backend(inner="aot_eager"))
    elif how == "compile":
        compiled = graphtrees.compile(ddp, inner="aot_eager")
    elif how == "split":  # every graph of the DDP optimizer split again at its GELUs
        compiled = graphtrees.compile(
            ddp, inner="aot_eager", splitting_ops=["aten::gelu"], min_piece_ops=1
        )
    else:
        compiled = torch.compile(ddp, backend="graphtrees")  # the registered backend: Inductor

    gen = torch.Generator().manual_seed(1000 + rank)  # every rank trains on its own data
    data = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(steps)
    ]

    def train(m, f):
        if how == "string":
            # Inductor's kernels differ from eager's in the last bits; SGD keeps the two runs
            # within a tolerance that Adam's normalisation by tiny second moments would not.
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(f(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    eager_losses = train(reference, ddp_ref)
    graph_losses = train(model, compiled)
    exact = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    if how == "string":
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=1e-5)
    else:
        # aot_eager runs the same ATen kernels as eager, so the runs agree bit for bit.
        assert exact, "aot_eager through graphtrees must equal eager DDP exactly"
        assert graph_losses == eager_losses
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    _assert_same_across_ranks(list(model.parameters()), world_size)  # DDP kept them in sync
    return dict(
        tree=_summary(graphtrees.tree_info("cpu")),
        comm=comm,
        exact=exact,
        losses=graph_losses,
        steps=steps,
    )


# ---------------------------------------------------------------------------------------------
# Collectives inside cudagraphify


def _gather(out, y):
    import torch.distributed as dist

    with warnings.catch_warnings():  # deprecated in favour of all_gather_single in torch 2.14
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, y)


def collectives(rank, world_size, steps=6):
    """A wrapped function that all-reduces and all-gathers what it computed, warmed up, recorded
    and replayed; every value is checked against the result computed by hand."""
    import torch
    import torch.distributed as dist

    import graphtrees

    calls = [0]

    def step_fn(x):
        calls[0] += 1
        y = x * 2 + 1
        dist.all_reduce(y)  # in place, on a tensor the function computed
        z = y * (rank + 1)
        out = torch.empty(world_size * z.numel())
        _gather(out, z)
        # z is returned too (collectives_under_load covers temporaries that are not).
        return y, out, z

    f = graphtrees.cudagraphify(step_fn, name=f"collectives_rank{rank}")
    # Rank 1 also graphs a function of its own, without collectives: its tree has two nodes,
    # rank 0's one (each process has its own tree; nothing is shared across ranks).
    local = graphtrees.cudagraphify(lambda x: x.sin(), name=f"local_rank{rank}")
    with torch.no_grad():
        for step in range(steps):
            x = torch.arange(4.0) + 10 * step + rank  # every rank and step has its own input
            y, out, _ = f(x)
            expected = sum(2 * (torch.arange(4.0) + 10 * step + r) + 1 for r in range(world_size))
            assert torch.equal(y, expected), (step, y, expected)
            assert torch.equal(out, torch.cat([expected * (r + 1) for r in range(world_size)]))
            if rank == 1:
                torch.testing.assert_close(local(x), x.sin())
    ok, why = graphtrees.check_pool_invariants("cpu")
    assert ok, why
    return dict(tree=_summary(graphtrees.tree_info("cpu")), calls=calls[0], steps=steps)


def collectives_in_place_on_a_static_buffer(rank, world_size, steps=6):
    """all_reduce(buffer) in place on a buffer passed through static_argnums: every call, replays
    included, leaves the sum in the caller's buffer, as eager execution does. (On a copied input
    the in-place collective would reduce graphtrees' private copy: docs/distributed.md.)"""
    import torch
    import torch.distributed as dist

    import graphtrees

    def step_fn(buffer, x):
        buffer.copy_(x * 2)
        dist.all_reduce(buffer)
        return buffer.sum()

    f = graphtrees.cudagraphify(step_fn, static_argnums=(0,))
    buffer = torch.zeros(4)
    with torch.no_grad():
        for step in range(steps):
            total = f(buffer, torch.arange(4.0) + step + rank)
            expected = sum(2 * (torch.arange(4.0) + step + r) for r in range(world_size))
            assert torch.equal(buffer, expected), (step, buffer, expected)
            assert torch.equal(total, expected.sum())
    return dict(tree=_summary(graphtrees.tree_info("cpu")), steps=steps)


def collectives_in_place_on_a_copied_input(rank, world_size, steps=4):
    """all_reduce(x) in place on a copied input: a graph would reduce graphtrees' private copy of
    x, so the warmup's watch for in-place collectives makes the function run eagerly, and every
    call reduces the caller's own x, as eager execution does."""
    import torch
    import torch.distributed as dist

    import graphtrees

    def step_fn(x):
        dist.all_reduce(x)
        return x * 2

    f = graphtrees.cudagraphify(step_fn)
    with torch.no_grad():
        for step in range(steps):
            x = torch.full((3,), float(step + rank))
            y = f(x)
            expected = sum(float(step + r) for r in range(world_size))
            assert torch.equal(x, torch.full((3,), expected)), (step, x)
            assert torch.equal(y, torch.full((3,), 2 * expected)), (step, y)
    return dict(tree=_summary(graphtrees.tree_info("cpu")), steps=steps)


def collectives_with_eager_rank(rank, world_size, steps=6):
    """Rank 1 runs the wrapped function eagerly (grad mode on and an input that requires grad)
    while rank 0 graphs it: each call still runs the collective once on each rank, so the ranks
    stay in step and every value is right."""
    import torch
    import torch.distributed as dist

    import graphtrees

    calls = [0]

    def step_fn(x):
        calls[0] += 1
        y = x * 3
        dist.all_reduce(y)
        return y

    f = graphtrees.cudagraphify(step_fn)
    for step in range(steps):
        x = torch.full((3,), float(step + rank))
        if rank == 1:
            y = f(x.requires_grad_())  # eager: it needs autograd
        else:
            with torch.no_grad():
                y = f(x)
        expected = sum(3 * float(step + r) for r in range(world_size))
        assert torch.equal(y.detach(), torch.full((3,), expected)), (step, y)
    return dict(tree=_summary(graphtrees.tree_info("cpu")), calls=calls[0], steps=steps)


def collectives_rejected_capture(rank, world_size, steps=4):
    """Rank 1's function reads a value on the host after its all-reduce, so its recording is
    rejected there only, while rank 0 records and replays. The rejected recording has already
    run the function for real (the CPU emulation executes what it records): its results are
    returned rather than running it again, so every call all-reduces once on every rank and the
    ranks stay in step."""
    import torch
    import torch.distributed as dist

    import graphtrees

    calls = [0]

    def step_fn(x):
        calls[0] += 1
        y = x + 1
        dist.all_reduce(y)
        if rank == 1:
            y.sum().item()  # a host read: a CUDA graph capture would fail here
        return y

    f = graphtrees.cudagraphify(step_fn)
    with torch.no_grad():
        for step in range(steps):
            y = f(torch.full((2,), float(step)))
            assert torch.equal(y, torch.full((2,), float(world_size * (step + 1)))), (step, y)
    return dict(tree=_summary(graphtrees.tree_info("cpu")), calls=calls[0], steps=steps)


# ---------------------------------------------------------------------------------------------
# FSDP2 through torch.compile


def _fsdp2_model():
    import torch
    from torch.distributed.fsdp import fully_shard

    class Block(torch.nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.lin = torch.nn.Linear(d_in, d_out)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b0, self.b1, self.b2 = Block(16, 64), Block(64, 64), Block(64, 4)

        def forward(self, x):
            # No loop over the blocks: dynamo cannot resume a frame inside a loop after the
            # graph break at an FSDP hook, and would run this whole forward eagerly.
            x = self.b2(self.b1(self.b0(x)))
            return torch.tanh(x) * 2  # after the FSDP units and without parameters: recorded

    torch.manual_seed(0)
    net = Net()
    for block in (net.b0, net.b1, net.b2):  # one FSDP unit per block (a class of our own: see
        fully_shard(block)  # _mlp), and the root
    fully_shard(net)
    return net


def fsdp2_training(rank, world_size, steps=8):
    """Trains an FSDP2 model eagerly and through torch.compile(backend=graphtrees) on this rank's
    own data; the graphs that read FSDP2 parameters run eagerly (Note [FSDP2 parameters] in
    graphtrees/_graph_checks.py), the graph between FSDP units is recorded and replayed."""
    import torch

    import graphtrees

    gen = torch.Generator().manual_seed(2000 + rank)
    data = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(steps)
    ]

    def train(m, f):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(f(x), y).backward()
            opt.step()

    reference = _fsdp2_model()
    train(reference, reference)
    model = _fsdp2_model()
    train(model, torch.compile(model, backend=graphtrees.make_backend(inner="aot_eager")))
    full = [p.full_tensor() for p in model.parameters()]  # DTensors: gathered across ranks
    full_ref = [p.full_tensor() for p in reference.parameters()]
    for p, q in zip(full, full_ref):
        torch.testing.assert_close(p, q)
    _assert_same_across_ranks(full, world_size)
    return dict(
        tree=_summary(graphtrees.tree_info("cpu")),
        steps=steps,
        exact=all(torch.equal(p, q) for p, q in zip(full, full_ref)),
    )


def collectives_under_load(rank, world_size, calls=1000):
    """Temporaries passed to collectives and not returned (gloo's worker thread drops its
    references to them when it likes): every Python replay (the one that re-runs the function and
    checks what it kept) must pass the kept-tensor check whatever the timing (Note [Collective
    buffers] in csrc/CollectiveBuffers.h)."""
    import torch
    import torch.distributed as dist

    import graphtrees

    def reduce_fn(t):
        s = t * 2
        dist.all_reduce(s)  # s is a temporary the function does not return
        return s + 1

    def gather_fn(t):
        out = torch.empty(world_size * t.numel())
        _gather(out, t * 3)  # t * 3 is a temporary the function does not return
        return out

    def both_fn(t):
        # A temporary input (t * 2) and a temporary output (out): the replay's later
        # allocations reuse their memory only once gloo's worker has dropped them.
        out = torch.empty(world_size * t.numel())
        _gather(out, t * 2)
        return out + 1

    f = graphtrees.cudagraphify(reduce_fn, name=f"reduce_rank{rank}", cpu_replay="python")
    g = graphtrees.cudagraphify(gather_fn, name=f"gather_rank{rank}", cpu_replay="python")
    h = graphtrees.cudagraphify(both_fn, name=f"both_rank{rank}")
    with torch.no_grad():
        for i in range(calls):
            t = torch.full((4,), float(i + rank))
            want = sum(2.0 * (i + r) for r in range(world_size)) + 1
            assert torch.equal(f(t), torch.full((4,), want)), i
            graphtrees.mark_step_begin()
            got = g(t)
            assert torch.equal(got, torch.cat([torch.full((4,), 3.0 * (i + r)) for r in range(2)]))
            graphtrees.mark_step_begin()
            got = h(t)
            want = torch.cat([torch.full((4,), 2.0 * (i + r) + 1) for r in range(world_size)])
            assert torch.equal(got, want), i
            graphtrees.mark_step_begin()
    ok, why = graphtrees.check_pool_invariants("cpu")
    assert ok, why
    return dict(tree=_summary(graphtrees.tree_info("cpu")), calls=calls)


CASES = {
    "collectives_under_load": collectives_under_load,
    "ddp_training": ddp_training,
    "collectives": collectives,
    "collectives_in_place_on_a_static_buffer": collectives_in_place_on_a_static_buffer,
    "collectives_in_place_on_a_copied_input": collectives_in_place_on_a_copied_input,
    "collectives_with_eager_rank": collectives_with_eager_rank,
    "collectives_rejected_capture": collectives_rejected_capture,
    "fsdp2_training": fsdp2_training,
}
