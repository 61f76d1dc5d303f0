"""Public Python API. The work happens in graphtrees._C; this module validates arguments."""

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._capture import capture
from ._dynamo_backend import TreeBranchForm
from ._ext import get_ext
from ._graph_checks import CHOSEN_FORM

DeviceLike = str | torch.device


def _name_of(fn: Any) -> str:
    # A wrapper of a wrapper is named after what it wraps, not "GraphedCallable".
    name = getattr(fn, "_graphtrees_name", None)
    if isinstance(name, str):
        return name
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        name = type(fn).__name__
    return name


def cudagraphify(
    fn: Callable | None = None,
    *,
    static_argnums: Iterable[int] = (),
    warmup_iters: int = 1,
    rerecord_limit: int = 8,
    name: str | None = None,
    on_overwrite: str = "raise",
    chain_limit: int = 16,
    buckets: Iterable[int] | None = None,
    bucket_dim: int = 0,
    max_recorded_shapes: int | None = None,
    cpu_replay: str = "program",
    verify: bool | str | None = None,
    cond_form: str = "auto",
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
            A recording whose static inputs were freed can never replay again: the next one
            replaces it and is not counted (a new ``StaticCache`` per ``generate()`` call).
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
        cpu_replay: how replays run on the CPU backend. ``"program"`` (default): the ops the
            function dispatched while it was recorded run again from C++, and no Python runs,
            exactly as a CUDA graph replay (Python attributes it read are baked, side effects
            happen only in warmup and recording). ``"python"``: the function is run again. A
            function whose recorded ops do not reproduce its recording falls back to
            ``"python"`` by itself (logged once). ``tree_info()`` says which each node uses.
        verify: check every replay against an eager run of the function on copies of its
            inputs (from the same RNG state): ``True`` raises :class:`ReplayMismatchError` on a
            mismatch (naming the output, the largest difference and, on CPU, the first recorded
            op whose Python value changed); ``"warn"`` logs it once and returns the eager
            result. Default: the ``GRAPHTREES_VERIFY`` environment variable (``1``, ``warn``),
            else off. For finding baked values before production; it runs the function twice.

        cond_form: how a ``torch.cond`` in ``fn`` is recorded. ``"auto"`` (default): as a
            control step of the CPU backend's program, or as CUDA conditional nodes; where none
            can serve it on CUDA (a branch that draws random numbers, a driver without
            conditional nodes), the call that finds it runs eagerly and the later calls take
            the tree-branch form (logged). ``"tree-branch"``: always. In the tree-branch form
            ``fn`` is traced by ``torch.compile`` (graphtrees' backend, ``inner="aot_eager"``)
            and split at the cond: the part before it, each branch and the part after are tree
            nodes of their own, the predicate is read on the host between them, and the pool
            holds the larger branch's memory, not both (docs/semantics.md). That form cannot
            take ``buckets`` or ``cpu_replay="python"``.

    Returns a callable with the same call signature and result structure as ``fn``.
    Calls that cannot be graphed (autograd needed, several devices, unsupported arguments) run
    eagerly; the reason is logged once and counted in :func:`tree_info`.
    """
    # Each option is listed once, in the signature above; graphtrees._C.graph_option_names says
    # which of these arguments are graph options, validated once, in C++, for every caller.
    given = dict(locals())
    options = {k: given[k] for k in get_ext().graph_option_names if k in given}
    if options["buckets"] is not None:
        options["buckets"] = list(options["buckets"])
    for unset in ("max_recorded_shapes", "verify"):
        if options[unset] is None:
            del options[unset]
    if fn is None:
        return functools.partial(cudagraphify, name=name, **options)
    module = fn if isinstance(fn, torch.nn.Module) else None
    name = _name_of(fn) if name is None else name
    wrapped = get_ext().GraphedCallable(fn, options, module, name)
    # Note [A wrapper's cond split into tree branches] in csrc/ThreadState.h.
    split = TreeBranchForm(fn, name, options, wrapped)
    if cond_form == "tree-branch":
        wrapped._delegate = split(CHOSEN_FORM)
    else:
        wrapped._set_tree_branch_factory(split)
    wrapped.capture = functools.partial(capture, wrapped)
    functools.update_wrapper(wrapped, fn, updated=())
    wrapped._graphtrees_name = name
    if module is not None:
        wrapped.module = module
    return wrapped


# Note [A wrapped module behaves like the module]
# As torch.compile's module wrapper does, a GraphedCallable made from an nn.Module passes what it
# does not have itself on to the module: attributes (config, training, device), the module's
# methods (parameters(), state_dict(), generate -- which runs the module itself, unrecorded) and
# item access, length and iteration (a wrapped nn.Sequential). Module methods that return the
# module (eval(), train(), to(), requires_grad_()) return the wrapper, so that
# `model = graphtrees.cudagraphify(model).eval()` keeps the wrapper. Calling goes through the
# graph. Only lookups that fail on the wrapper reach this, never the call path.
def _wrapped_module(self: Any, what: str) -> torch.nn.Module:
    module = self.__dict__.get("module")
    if module is None:
        raise TypeError(f"{self!r} wraps a function, not an nn.Module: it has no {what}")
    return module


def _module_getattr(self: Any, attr: str) -> Any:
    module = self.__dict__.get("module")
    if module is None or (attr.startswith("__") and attr.endswith("__")):
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
    value = getattr(module, attr)
    if callable(value) and getattr(value, "__self__", None) is module:

        @functools.wraps(value)
        def method(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            return self if result is module else result

        return method
    return value


def _install_module_passthrough() -> None:
    from ._ext import has_ext

    if not has_ext():
        return
    cls = get_ext().GraphedCallable
    cls.__getattr__ = _module_getattr
    cls.__getitem__ = lambda self, key: _wrapped_module(self, "items")[key]
    cls.__len__ = lambda self: len(_wrapped_module(self, "length"))
    cls.__iter__ = lambda self: iter(_wrapped_module(self, "items to iterate"))
    cls.__bool__ = lambda self: True  # __len__ must not make a wrapper falsy


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


def set_memory_budget(device: DeviceLike, max_pool_bytes: int | None) -> None:
    """Caps the memory graphtrees' pool on ``device`` may hold at ``max_pool_bytes`` (``None``
    removes the cap). It applies to the device's trees now and after :func:`reset`.

    When a warmup or a recording would take the pool over the budget, graphtrees evicts the least
    recently used recordings that are not on the current path and returns the memory that no
    remaining recording needs; if that is not enough the call runs eagerly (logged). Counted in
    ``tree_info()`` (``num_evictions``, ``num_out_of_memory``, ``bytes_released``,
    ``memory_budget``). Memory the pool holds already is not taken away: the cap bounds growth.
    With several threads, each thread's pool gets the cap (docs/semantics.md, "Threads").
    """
    get_ext().set_memory_budget(_device(device), max_pool_bytes)


def memory_budget(device: DeviceLike) -> int | None:
    """The budget :func:`set_memory_budget` set for ``device``, or ``None``."""
    return get_ext().memory_budget(_device(device))


def _device(device: DeviceLike) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def tree_info(device: DeviceLike = "cpu") -> dict[str, Any]:
    """A JSON-serialisable description of the calling thread's tree on ``device`` (each thread
    has its own; docs/semantics.md "Threads").

    Keys: device, backend, thread, state, generation, num_roots, memory_budget, retired_trees,
    leaked_bytes, pending_backward, live_outputs, current_node, pool (reserved_bytes,
    allocated_bytes, segments, blocks, allocated_blocks), nodes (id, parent, function,
    function_id, children, pool_bytes, num_outputs, input_kinds -- one letter per flat input: S
    static, M managed, C copied --, live_outputs, replays, on_current_path, cpu_replay, kind --
    "graph", or "piece" for a piece of a split graph), and the counters
    below. A device without a tree gives the same keys with zeros and no nodes.

    Counters:
    """
    return get_ext().tree_info(_device(device))


def tree_to_dot(device: DeviceLike = "cpu") -> str:
    """Graphviz DOT of the tree on ``device``: nodes labelled with their id, function, replays,
    the pool bytes their recording wrote and their live outputs; nodes with live outputs are
    filled green, the current path is bold red, pieces of a split graph are dashed.
    :func:`tree_to_svg` renders it."""
    return get_ext().tree_to_dot(_device(device))


GRAPHVIZ_MISSING = (
    "graphtrees.tree_to_svg needs Graphviz's `dot` program, which is not on PATH. Install "
    "Graphviz: `apt-get install graphviz` (Debian, Ubuntu), `conda install graphviz`, `brew "
    "install graphviz` (macOS) or https://graphviz.org/download/ -- or render "
    "graphtrees.tree_to_dot() elsewhere."
)


# How long tree_to_svg waits for Graphviz's dot.
SVG_TIMEOUT_S = 60.0


class GraphvizNotFoundError(RuntimeError):
    """Graphviz's ``dot`` is not installed (the message says how to install it)."""


def tree_to_svg(device: DeviceLike = "cpu", path: str | None = None) -> str:
    """The tree on ``device`` as an SVG picture (:func:`tree_to_dot` rendered by Graphviz's
    ``dot``): each node shows its id, function, replays, the pool bytes its recording wrote and
    its live outputs; the current path is red, nodes with live outputs are green, pieces of a
    split graph are dashed (``tree_info()``'s node ``kind``). Returns the SVG text and writes it
    to ``path`` when given. Raises :class:`GraphvizNotFoundError`, saying how to install it,
    when ``dot`` is not on PATH, and RuntimeError when ``dot`` fails or takes more than
    ``SVG_TIMEOUT_S`` (60) seconds."""
    import shutil
    import subprocess

    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizNotFoundError(GRAPHVIZ_MISSING)
    # UTF-8 both ways, whatever the locale (DOT is UTF-8 by default; a function name need not be
    # ASCII), and a bounded wait: a dot that hangs must not hang the caller.
    try:
        r = subprocess.run(
            [dot, "-Tsvg"],
            input=tree_to_dot(device).encode("utf-8"),
            capture_output=True,
            check=False,
            timeout=SVG_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"graphtrees.tree_to_svg: `{dot} -Tsvg` did not finish in {SVG_TIMEOUT_S:g} s and was "
            "killed; render graphtrees.tree_to_dot() yourself (a very large tree, or a broken "
            "Graphviz install)"
        ) from None
    stderr = r.stderr.decode("utf-8", "replace").strip()
    if r.returncode != 0:
        raise RuntimeError(f"graphtrees.tree_to_svg: `{dot} -Tsvg` failed: {stderr}")
    svg = r.stdout.decode("utf-8", "replace")
    if path is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg)
    return svg


def check_pool_invariants(device: DeviceLike = "cpu") -> tuple[bool, str]:
    """``(ok, why)``: whether the pool's allocated blocks are exactly the live outputs that own
    pool memory (and, when no replay happened since, that every live output owns its block)."""
    return tuple(get_ext().check_pool_invariants(_device(device)))


def _document_counters() -> None:
    # The counters are documented from the one table that defines them (Note [Tree counters]).
    from ._ext import has_ext

    if has_ext() and tree_info.__doc__ is not None:
        rows = "".join(f"\n    * ``{k}``: {v}" for k, v in get_ext().tree_counters.items())
        tree_info.__doc__ = tree_info.__doc__.rstrip() + rows + "\n"


_document_counters()
_install_module_passthrough()
