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
        )
    # Options are validated once, in C++ (graphtrees._C.GraphedCallable), for every caller.
    module = fn if isinstance(fn, torch.nn.Module) else None
    options = dict(static_argnums=static_argnums, warmup_iters=warmup_iters,
                   rerecord_limit=rerecord_limit, on_overwrite=on_overwrite,
                   chain_limit=chain_limit)
    wrapped = get_ext().GraphedCallable(fn, options, module, _name_of(fn) if name is None else name)
    functools.update_wrapper(wrapped, fn, updated=())
    if module is not None:
        wrapped.module = module
    return wrapped


def mark_step_begin() -> None:
    """Marks the start of a new step (e.g. a new iteration of an inference or training loop).

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


def _device(device: DeviceLike) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def tree_info(device: DeviceLike = "cpu") -> Dict[str, Any]:
    """A JSON-serialisable description of the tree on ``device``.

    Keys: device, backend, state, generation, num_nodes, num_roots, num_checkpoints (pool
    restores), num_rerecords, num_fallbacks, num_warmups, num_recordings, num_replays,
    num_invalidations, num_evictions, num_migrations, retired_trees, pending_backward,
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
