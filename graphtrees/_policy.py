"""graphtrees as the engine behind ``torch.compile(mode="reduce-overhead")``.

torch 2.14 lets a library take over Inductor's CUDA graphs: ``torch._inductor.config.
cudagraph_policy`` is an object whose ``cudagraphify(model, example_inputs, static_input_idxs,
...)`` Inductor calls for each compiled graph it would record, instead of handing it to
PyTorch's own tree manager. :func:`install` sets a graphtrees policy there, so every
reduce-overhead graph becomes a function of graphtrees' C++ tree manager:

* forward, backward and inference graphs are nodes of the device's tree (the backward a child of
  its forward through the activations it reads, which are the forward's outputs), with pending
  backwards and generations as for graphtrees' own backend;
* Inductor's static inputs (parameters, buffers, ``mark_static_address`` tensors) are static:
  used in place, their addresses checked. An input Inductor says the graph mutates is used in
  place too (a copy would take the mutation): the graph writes the caller's tensor, as eagerly;
* with ``graph_partition=True`` (Inductor's default), Inductor has already split the graph
  around what cannot be recorded (CPU ops, data-dependent shapes, ops tagged cudagraph_unsafe):
  each partition is a node, and the code between them runs eagerly, as graphtrees' own pieces;
* a graph Inductor would not record (its own reasons: mutated eager inputs, CPU-only, ...) is
  never handed to the policy: it stays eager, with Inductor's reason logged by Inductor
  (``torch._inductor.cudagraph_utils`` logger and ``counters["inductor"]["cudagraph_skips"]``).

The policy applies when Inductor finishes a graph (its post-compile step, also on a cache hit):
graphs compiled before :func:`install` stay PyTorch's (``torch._dynamo.reset()`` recompiles).
While installed, ``torch._dynamo.reset()`` also frees the policy's own functions, as it frees
PyTorch's trees: their recordings leave every tree (those on a tree's current path once the path
moves off them), and trees left with nothing in them give their pools back. Nothing else of
graphtrees is touched (``graphtrees.cudagraphify`` functions, ``backend="graphtrees"`` graphs),
and after :func:`uninstall` nothing at all: ``graphtrees.reset()`` frees everything.
``torch._inductor.cudagraph_trees.reset_cudagraph_trees``, which ``torch._dynamo.reset()`` calls,
is wrapped for that (the one torch function install() changes besides the policy).
"""

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._dynamo_backend import _GRAPH_OPTIONS

_logger = logging.getLogger("graphtrees")
_NEEDED = "2.14"
# The graphtrees options the policy takes: the graph options of graphtrees.compile().
_POLICY_OPTIONS = (*_GRAPH_OPTIONS, "verify")
_graph_counter = itertools.count()
# Inductor calls should_wrap(graph) and then, for the same graph, cudagraphify(callable): the
# graph (its partitions) is kept between the two calls, per compiling thread.
_compiling = threading.local()
# The graphtrees functions the policy made: what torch._dynamo.reset() frees while installed.
_policy_functions: "weakref.WeakSet[Any]" = weakref.WeakSet()


def hook_available() -> bool:
    """Whether this torch has Inductor's ``cudagraph_policy`` hook (torch 2.14 and newer)."""
    import torch._inductor.config as config

    return hasattr(config, "cudagraph_policy")


def _require_hook() -> None:
    if not hook_available():
        raise RuntimeError(
            "graphtrees.install() needs torch._inductor.config.cudagraph_policy, which torch "
            f"{_NEEDED} and newer have; this is torch {torch.__version__}. On this torch use "
            "torch.compile(model, backend='graphtrees') (or graphtrees.compile(model)) instead "
            "of mode='reduce-overhead'."
        )


def _mode(is_backward: bool, is_inference: bool) -> Any:
    from ._dynamo_backend import _modes

    modes = _modes()
    return modes.BACKWARD if is_backward else modes.INFERENCE if is_inference else modes.FORWARD


def _partition_indices(partition_map: Any, idxs: set) -> list[int]:
    """The inputs of one partition that are the graph's inputs at `idxs`."""
    return [
        i for i, g in enumerate(partition_map.input_index_mapping) if g is not None and g in idxs
    ]


def _make_policy_class() -> type:
    from torch._inductor.cudagraph_utils import CUDAGraphPolicy

    from ._dynamo_backend import _boxed_graphed, _graphed, _Options
    from ._piecewise import label

    class GraphtreesPolicy(CUDAGraphPolicy):
        """Records Inductor's CUDA graphs with graphtrees (see graphtrees._policy)."""

        def __init__(self, options: dict):
            self.options = dict(options)
            self._opts = _Options(inner="inductor", **options)

        def __repr__(self) -> str:
            return f"graphtrees.GraphtreesPolicy({self.options})"

        def should_wrap(self, compiled_graph: Any) -> bool:
            _compiling.graph = compiled_graph
            return True

        def _wrap(self, run: Callable, static: list[int], mode: Any, name: str, counts: bool):
            graphed = _graphed(self._opts, run, static, mode, name)
            graphed._counts_pending = counts
            # torch._dynamo.reset() frees the compiled graphs (and this) before it calls the
            # hook: the recordings then leave the trees as it dies.
            graphed._evict_when_freed = True
            _policy_functions.add(graphed)
            return _boxed_graphed(graphed)  # as the backend's boxed graphs

        def cudagraphify(
            self,
            model: Callable[..., Any],
            example_inputs: Any,
            static_input_idxs: Any,
            *,
            device_index: int,
            is_backward: bool,
            is_inference: bool,
            **kwargs: Any,
        ) -> Callable[..., Any]:
            graph = getattr(_compiling, "graph", None)
            _compiling.graph = None
            mode = _mode(is_backward, is_inference)
            name = f"inductor{next(_graph_counter)}.{mode.name.lower()}"
            # A mutated input is used in place: the recording writes the caller's tensor.
            in_place = set(static_input_idxs) | set(kwargs.get("mutated_input_idxs", ()))
            maps = getattr(graph, "partition_maps", None)
            if graph is None or graph.current_callable is not model or maps is None:
                _logger.debug("%s (device %d): recorded whole by graphtrees", name, device_index)
                return self._wrap(model, sorted(in_place), mode, name, True)
            if not maps:  # nothing Inductor could record: all of it runs eagerly
                _logger.debug("%s: no partition to record; it runs eagerly", name)
                return model
            # Note [Pending backward] (csrc): the first forward and the last backward partition
            # count a pending backward.
            counting = len(maps) - 1 if is_backward else 0

            def wrapper(i: int, partition_map: Any) -> Callable[[Callable], Callable]:
                part = name + (label(i, len(maps)) if len(maps) > 1 else "")
                static = _partition_indices(partition_map, in_place)
                return lambda run: self._wrap(run, static, mode, part, i == counting)

            graph.recursively_apply_fns([wrapper(i, m) for i, m in enumerate(maps)])
            _logger.debug("%s: %d Inductor partitions recorded by graphtrees", name, len(maps))
            return model

    return GraphtreesPolicy


_policy_class: type | None = None


def _free_policy_functions() -> None:
    """Removes the recordings of every function the policy made from every tree (those on a
    tree's current path once the path moves off them), then frees the trees left empty."""
    from ._ext import get_ext

    functions = list(_policy_functions)
    _policy_functions.clear()
    for graphed in functions:
        graphed._evict_recordings(
            "was compiled under graphtrees.install(), and torch._dynamo.reset() was called"
        )
    get_ext()._release_empty_trees()


def _free_trees_on_dynamo_reset() -> None:
    """``torch._dynamo.reset()`` calls ``torch._inductor.cudagraph_trees.reset_cudagraph_trees()``
    (looked up at that moment) whatever compiled what: while graphtrees is installed, that frees
    the policy's own functions too, as it frees PyTorch's trees, so code that resets between
    models gets their pool memory back. Other graphtrees functions are not the policy's to free,
    and once uninstalled it frees nothing (any library may call ``torch._dynamo.reset()``)."""
    import torch._inductor.cudagraph_trees as trees

    original = trees.reset_cudagraph_trees
    if getattr(original, "_graphtrees", False):
        return

    def reset_cudagraph_trees(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if installed():
            _free_policy_functions()
        return result

    reset_cudagraph_trees._graphtrees = True
    reset_cudagraph_trees.__wrapped__ = original
    trees.reset_cudagraph_trees = reset_cudagraph_trees


def _is_ours(policy: Any) -> bool:
    return _policy_class is not None and isinstance(policy, _policy_class)


class Installation:
    """What :func:`install` returns: a context manager that, on exit, puts back the policy it
    replaced (an outer ``with graphtrees.install(...)``'s, or none)."""

    def __init__(self, policy: Any, replaced: Any = None):
        self.policy = policy
        self.replaced = replaced

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch._inductor.config as config

        if config.cudagraph_policy is self.policy:
            config.cudagraph_policy = self.replaced

    def __repr__(self) -> str:
        return f"<graphtrees installation of {self.policy!r}>"


def install(**options: Any) -> Installation:
    """Makes graphtrees record the CUDA graphs of ``torch.compile(mode="reduce-overhead")``.

    It sets ``torch._inductor.config.cudagraph_policy`` (torch 2.14 and newer; older torch
    raises RuntimeError). Graphs compiled from then on are graphtrees functions: nodes of the
    device's tree, shown by :func:`graphtrees.tree_info`. Usable as a context manager
    (``with graphtrees.install(): ...`` uninstalls on exit); ``GRAPHTREES_INSTALL=1`` in the
    environment installs it when graphtrees is imported. Calling it again replaces the options.

    Options (as for :func:`graphtrees.compile`): warmup_iters, rerecord_limit,
    max_recorded_shapes, on_overwrite, chain_limit, verify.
    """
    global _policy_class
    unknown = sorted(set(options) - set(_POLICY_OPTIONS))
    if unknown:
        raise TypeError(
            f"graphtrees.install: unexpected options {unknown}; the options are {_POLICY_OPTIONS}"
        )
    _require_hook()
    import torch._inductor.config as config

    from ._ext import get_ext

    get_ext()  # a missing build is reported now, not at the first compiled graph
    if _policy_class is None:
        _policy_class = _make_policy_class()
        _free_trees_on_dynamo_reset()
    policy = _policy_class(options)
    current = config.cudagraph_policy
    # What uninstalling restores: the policy from before graphtrees, when replacing ours.
    policy.previous = current.previous if _is_ours(current) else current
    config.cudagraph_policy = policy
    _logger.info(
        "graphtrees.install(): torch.compile(mode='reduce-overhead') graphs compiled from now on "
        "are recorded by graphtrees%s",
        f" ({options})" if options else "",
    )
    return Installation(policy, current)


def uninstall() -> bool:
    """Gives Inductor's CUDA graphs back to PyTorch's own trees (graphs compiled while graphtrees
    was installed stay graphtrees'). Returns whether a graphtrees policy was installed."""
    if not hook_available():
        return False
    import torch._inductor.config as config

    current = config.cudagraph_policy
    if not _is_ours(current):
        return False
    config.cudagraph_policy = current.previous
    _logger.info("graphtrees.uninstall(): reduce-overhead graphs are PyTorch's again")
    return True


def installed() -> bool:
    """Whether a graphtrees policy is Inductor's ``cudagraph_policy`` now."""
    if not hook_available():
        return False
    import torch._inductor.config as config

    return _is_ours(config.cudagraph_policy)


def install_from_environment() -> None:
    """``GRAPHTREES_INSTALL=1`` (true/yes/on) installs at import; 0/false/no/off or unset do
    nothing; anything else is an error, as is a torch without the hook."""
    import os

    value = os.environ.get("GRAPHTREES_INSTALL", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return
    if value not in ("1", "true", "yes", "on"):
        raise ValueError(
            f"GRAPHTREES_INSTALL must be 1/true/yes/on or 0/false/no/off, got "
            f"{os.environ['GRAPHTREES_INSTALL']!r}"
        )
    install()
