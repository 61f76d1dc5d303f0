"""Public Python API. The work happens in graphtrees._C; this module validates arguments."""

import functools
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from ._ext import get_ext

DeviceLike = Union[str, torch.device]


def _name_of(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        name = type(fn).__name__
    return name


def cudagraphify(
    fn: Optional[Callable] = None,
    *,
    static_argnums: Iterable[int] = (),
    warmup_iters: int = 1,
    rerecord_limit: int = 8,
    name: Optional[str] = None,
    on_overwrite: str = "raise",
    chain_limit: int = 16,
    buckets: Optional[Iterable[int]] = None,
    bucket_dim: int = 0,
    max_recorded_shapes: Optional[int] = None,
):
    """Wraps ``fn`` so that its calls are warmed up, recorded as graphs and replayed.

    ``fn`` may be any callable, including an ``nn.Module`` (its parameters and buffers are
    static inputs: used in place, their addresses checked on every call). Usable as a decorator,
    with or without arguments.

    Args:
        static_argnums: positions of arguments whose tensors are used in place (their addresses
            are part of the recording; a changed address re-records). Every other tensor
            argument is copied into the graph's memory on each replay, unless it is an output of
            an earlier graphed call in the same step, which is used in place.
        warmup_iters: eager runs (inside the pool) before a call signature is recorded.
        rerecord_limit: re-recordings of one signature under one parent before that signature
            falls back to eager execution (the reason is logged on the ``graphtrees`` logger).
        name: the function's name in logs, errors, :func:`tree_info` and :func:`tree_to_dot`
            (default: the callable's qualified name, or its class name for a module).
        on_overwrite: what happens to an output you still hold when a later run is about to
            write its memory: ``"raise"`` (default) invalidates it, so that accessing it raises;
            ``"copy"`` first copies it out of the pool (one device copy; its storage is rebound
            in place, so every view follows) and it stays valid. Outputs that are dead by then
            cost nothing. Counted in ``tree_info()["num_migrations"]``.
        chain_limit: how often the function may run on outputs of its own step (``h = f(h)``)
            before a new step starts anyway (logged once).
        buckets: batch sizes to record. The batch size of a call is the size along
            ``bucket_dim`` of its first non-static tensor argument; every non-static tensor of
            that size is padded with zeros to the smallest bucket that fits, and every result of
            the bucket's size along ``bucket_dim`` is narrowed back. A batch above the largest
            bucket runs eagerly (logged once). ``wrapped.capture(*example_args)`` records every
            bucket ahead of time.
        bucket_dim: the batch dimension for ``buckets``.
        max_recorded_shapes: at most this many call signatures (shapes, dtypes, non-tensor
            argument values) keep recordings; a new one evicts the least recently used. When
            evictions keep throwing away recordings that never replayed (more shapes cycling than
            fit), the recorded ones are kept and new shapes run eagerly until a kept one goes
            unused for a while (logged once, with the advice to use ``buckets``). Default: no
            bound.

    Returns a callable with the same call signature and result structure as ``fn``.
    Calls that cannot be graphed (autograd needed, several devices, unsupported arguments) run
    eagerly; the reason is logged once and counted in :func:`tree_info`.
    """
    if fn is None:
        return functools.partial(
            cudagraphify,
            static_argnums=static_argnums,
            warmup_iters=warmup_iters,
            rerecord_limit=rerecord_limit,
            name=name,
            on_overwrite=on_overwrite,
            chain_limit=chain_limit,
            buckets=buckets,
            bucket_dim=bucket_dim,
            max_recorded_shapes=max_recorded_shapes,
        )
    # Options are validated once, in C++ (graphtrees._C.GraphedCallable), for every caller.
    module = fn if isinstance(fn, torch.nn.Module) else None
    options = dict(static_argnums=static_argnums, warmup_iters=warmup_iters,
                   rerecord_limit=rerecord_limit, on_overwrite=on_overwrite,
                   chain_limit=chain_limit, buckets=None if buckets is None else list(buckets),
                   bucket_dim=bucket_dim)
    if max_recorded_shapes is not None:
        options["max_recorded_shapes"] = max_recorded_shapes
    wrapped = get_ext().GraphedCallable(fn, options, module, _name_of(fn) if name is None else name)
    wrapped.capture = functools.partial(_capture, wrapped, tuple(static_argnums)
                                        if not isinstance(static_argnums, int) else (static_argnums,))
    functools.update_wrapper(wrapped, fn, updated=())
    if module is not None:
        wrapped.module = module
    return wrapped


def mark_step_begin() -> None:
    """Marks the start of a new step (e.g. a new iteration of an inference or training loop) for
    the calling thread's trees.

    The next graphed call starts a new generation: a new path from the root of the tree. Pool
    outputs of the previous step that own memory are released for reuse, so accessing them
    raises; replayed outputs stay readable until a later run overwrites them.
    """
    get_ext().mark_step_begin()


def reset() -> None:
    """Frees every tree: nodes, graphs and pools (pool bytes return to zero).

    Outputs of graphed calls that are still alive become invalid (accessing them raises).
    Wrapped callables stay usable: they warm up and record again on their next calls.
    """
    get_ext().reset()


def set_memory_budget(device: DeviceLike, max_pool_bytes: Optional[int]) -> None:
    """Caps the memory graphtrees' pool on ``device`` may hold at ``max_pool_bytes`` (``None``
    removes the cap). It applies to the device's trees now and after :func:`reset`.

    When a warmup or a recording would take the pool over the budget, graphtrees evicts the least
    recently used recordings that are not on the current path and returns the memory that no
    remaining recording needs; if that is not enough the call runs eagerly (logged). Counted in
    ``tree_info()`` (``num_evictions``, ``num_out_of_memory``, ``bytes_released``,
    ``memory_budget``). Memory the pool holds already is not taken away: the cap bounds growth.
    With several threads, each thread's pool gets the cap (README "Threads").
    """
    get_ext().set_memory_budget(_device(device), max_pool_bytes)


def memory_budget(device: DeviceLike) -> Optional[int]:
    """The budget :func:`set_memory_budget` set for ``device``, or ``None``."""
    return get_ext().memory_budget(_device(device))


def _device(device: DeviceLike) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def tree_info(device: DeviceLike = "cpu") -> Dict[str, Any]:
    """A JSON-serialisable description of the calling thread's tree on ``device`` (each thread
    has its own; README "Threads").

    Keys: device, backend, thread, state, generation, num_nodes, num_roots, num_checkpoints (pool
    restores), num_rerecords, num_fallbacks, num_warmups, num_recordings, num_replays,
    num_invalidations, num_evictions, num_out_of_memory (warmups and recordings an allocation
    failure turned eager), bytes_released (pool memory returned to the device after evictions
    and allocation failures), memory_budget, num_migrations, retired_trees, pending_backward,
    live_outputs, current_node, pool (reserved_bytes, allocated_bytes,
    segments, blocks, allocated_blocks) and nodes (id, parent, function, function_id, children,
    pool_bytes, num_outputs, input_kinds -- one letter per flat input: S static, M managed,
    C copied --, live_outputs, replays, on_current_path). A device without a tree
    gives the same keys with zeros and no nodes.
    """
    return get_ext().tree_info(_device(device))


def tree_to_dot(device: DeviceLike = "cpu") -> str:
    """Graphviz DOT of the tree on ``device``: nodes labelled with their function and the pool
    bytes their recording wrote; nodes with live outputs are filled, the current path is bold."""
    return get_ext().tree_to_dot(_device(device))


def check_pool_invariants(device: DeviceLike = "cpu") -> Tuple[bool, str]:
    """``(ok, why)``: whether the pool's allocated blocks are exactly the live outputs that own
    pool memory (and, when no replay happened since, that every live output owns its block)."""
    return tuple(get_ext().check_pool_invariants(_device(device)))


def _resize_batch(args, kwargs, static_argnums, dim, size):
    """The example arguments with every non-static tensor's batch (its size along ``dim``, as in
    the first such tensor) cut or zero-padded to ``size``."""
    leaves = [(i, a) for i, a in enumerate(args) if i not in static_argnums]
    batch = None
    for leaf in torch.utils._pytree.tree_leaves(([a for _, a in leaves], kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            batch = leaf.shape[dim]
            break
    if batch is None:
        raise ValueError("capture(): the example arguments have no tensor with a batch dimension "
                         f"(dimension {dim})")

    def resize(t):
        if not isinstance(t, torch.Tensor) or t.dim() <= dim or t.shape[dim] != batch:
            return t
        if size <= batch:
            return t.narrow(dim, 0, size).clone()
        shape = list(t.shape)
        shape[dim] = size
        out = t.new_zeros(shape)
        out.narrow(dim, 0, batch).copy_(t)
        return out

    new_args = tuple(a if i in static_argnums else torch.utils._pytree.tree_map(resize, a)
                     for i, a in enumerate(args))
    return new_args, torch.utils._pytree.tree_map(resize, kwargs)


class _Progress:
    """tqdm when installed, else one updating line on a terminal, else log lines."""

    def __init__(self, total, enabled):
        import logging
        import sys

        self._bar = None
        self._tty = False
        self._log = logging.getLogger("graphtrees")
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="graphtrees capture", unit="bucket")
        except ImportError:
            self._tty = sys.stderr.isatty()

    def update(self, text):
        import sys

        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text)
            self._bar.update(1)
        elif self._tty:
            sys.stderr.write("\rgraphtrees capture: " + text + " " * 8)
            sys.stderr.flush()
        else:
            self._log.info("capture: %s", text)

    def close(self):
        import sys

        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            sys.stderr.write("\n")


def _capture(wrapped, static_argnums, *args, progress=True, **kwargs):
    """Records every bucket of ``wrapped`` ahead of time, largest first (so that the smaller ones
    reuse its memory), from example arguments of any batch size. Python's garbage collector is
    frozen meanwhile. Returns one dict per bucket: size, seconds, pool_bytes_after and status
    ("recorded", or "eager" with a reason)."""
    import gc
    import time

    buckets = sorted(wrapped._buckets(), reverse=True)
    if not buckets:
        raise ValueError("capture() needs graphtrees.cudagraphify(..., buckets=[...])")
    dim = wrapped._bucket_dim()
    device = None
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            device = leaf.device
            break
    if device is None:
        raise ValueError("capture(): the example arguments contain no tensor")
    reports = []
    bar = _Progress(len(buckets), progress)
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    try:
        for size in buckets:
            t0 = time.perf_counter()
            ex_args, ex_kwargs = _resize_batch(args, kwargs, static_argnums, dim, size)
            before = tree_info(device)
            for _ in range(wrapped._warmup_iters() + 1):
                mark_step_begin()
                wrapped(*ex_args, **ex_kwargs)
            after = tree_info(device)
            report = dict(size=size, seconds=round(time.perf_counter() - t0, 4),
                          pool_bytes_after=after["pool"]["reserved_bytes"])
            if (after["num_recordings"] > before["num_recordings"]
                    or after["num_replays"] > before["num_replays"]):
                report["status"] = "recorded"
            else:
                reasons = [s["eager_reason"] for s in wrapped.signatures() if s["eager_reason"]]
                report["status"] = "eager"
                report["reason"] = reasons[-1] if reasons else "it ran eagerly"
            reports.append(report)
            bar.update(f"bucket {size}: {report['status']}, "
                       f"{time.perf_counter() - started:.1f} s, "
                       f"pool {report['pool_bytes_after'] / 2**20:.1f} MiB")
    finally:
        gc.unfreeze()
        bar.close()
    return reports
