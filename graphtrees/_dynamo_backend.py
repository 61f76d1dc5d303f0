"""torch.compile integration: the "graphtrees" dynamo backend and graphtrees.compile().

Dynamo hands each captured graph to the backend. AOTAutograd splits it into a forward and (when
something requires grad) a backward graph; each one is compiled by the inner compiler (Inductor
or aot_eager) and wrapped as a graphtrees function:

* parameters and buffers that dynamo lifts, and ``torch._dynamo.mark_static_address`` tensors,
  are static inputs (used in place, address-checked);
* activations saved by the forward are outputs of the forward node that the backward reads:
  managed inputs, used in place, never copied; the backward node becomes a child of its forward;
* symbolic sizes arrive as Python ints, so each distinct shape is its own function, at most
  ``max_recorded_shapes`` of them per compiled graph (least recently used evicted);
* graphs that cannot be recorded (``.item()``, data-dependent shapes, mutation of an eager input,
  CPU ops in a CUDA graph, parameters that FSDP2 unshards) run eagerly with the reason and source
  line logged -- or raise under ``strict=True``.

The backend is registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="graphtrees")`` works after ``pip install`` without an import.
"""

import functools
import itertools
import re
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ._ext import get_ext, has_ext


_INNER = ("inductor", "aot_eager")


def _modes():
    """The function modes of graphtrees._C (what a graph is in a training step)."""
    return get_ext().FunctionMode
_graph_counter = itertools.count()

# Ops whose output shape or value depends on tensor data: a recorded graph cannot reproduce them.
_DATA_DEPENDENT_OPS = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.nonzero",
    "aten.nonzero_static",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.repeat_interleave",
    # PyTorch's own forbidden list has these too (used as well where importable, see
    # _pytorch_incompatible_node); kept here for torch versions without it.
    "aten._assert_scalar",
    "aten._linalg_eigh",
    "run_and_save_rng_state",
    "run_with_rng_state",
}


def _pytorch_incompatible_node(gm: torch.fx.GraphModule) -> Optional[torch.fx.Node]:
    """The first node PyTorch's own trees refuse to record (forbidden ops, the cudagraph_unsafe
    tag, input-dependent cases such as index_put with boolean indices, sparse outputs,
    data-dependent shapes), where this torch provides the check."""
    try:
        from torch._inductor.utils import get_first_incompatible_cudagraph_node
    except ImportError:  # pragma: no cover - older torch
        return None
    try:
        return get_first_incompatible_cudagraph_node(gm)
    except Exception:  # noqa: BLE001 - a check of ours must not break compilation
        return None


def _pytorch_mutated_inputs(gm: torch.fx.GraphModule) -> set:
    """Input indices PyTorch's cudagraphs backend finds mutated, where importable."""
    try:
        from torch._dynamo.backends.cudagraphs import find_input_mutations
    except ImportError:  # pragma: no cover - older torch
        return set()
    try:
        return set(find_input_mutations(gm.graph))
    except Exception:  # noqa: BLE001
        return set()


class SkipError(RuntimeError):
    """A graph that graphtrees cannot record, under ``strict=True``."""


# Note [FSDP2 parameters]
# FSDP2 (torch.distributed.fsdp.fully_shard) runs its hooks outside dynamo (they are wrapped in
# torch._dynamo.disable), so a compiled FSDP2 model is split into one dynamo graph per FSDP unit,
# with the all-gathers and reduce-scatters running eagerly between them. Inside such a graph the
# unit's parameters are the unsharded parameters, whose storage FSDP2 frees after use
# (storage.resize_(0)) and allocates again at the next all-gather: their address changes from step
# to step. A recording reads its static inputs in place, so it would be re-recorded at every step
# (PyTorch's own trees do that, pytorch/pytorch#183451) and, on the CPU backend, never replayed.
# Such a graph therefore runs eagerly from the start, forward and backward, with this reason
# logged; the graphs between FSDP units that read no FSDP2 parameter are still recorded.
def _fsdp2_unsharded_storages() -> set:
    """Storages of the unsharded parameters of every FSDP2 module alive in this process (empty
    when FSDP2 is not in use, or its private state is laid out differently)."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded without it
        return set()
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
        from torch.multiprocessing.reductions import StorageWeakRef

        storages = set()
        for module, state_ref in list(_module_state_mapping.items()):
            state = state_ref() if isinstance(module, FSDPModule) else None
            if state is None:
                continue
            groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13
            if groups is None:  # torch 2.11
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fsdp_param in getattr(group, "fsdp_params", ()):
                    p = fsdp_param.__dict__.get("_unsharded_param")  # set at the 1st all-gather
                    if isinstance(p, torch.Tensor):
                        storages.add(StorageWeakRef(p.untyped_storage()))
        return storages
    except Exception:  # noqa: BLE001 - a check of ours must not break compilation
        return set()


def _input_name(node: torch.fx.Node) -> str:
    """The user-level name of a dynamo graph input (L['self']._modules['lin']._parameters['weight'],
    say), if known."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if callable(name):  # a method in some torch versions, a property in others
        try:
            name = name()
        except Exception:  # noqa: BLE001
            name = None
    return name if isinstance(name, str) and name else node.name


def fsdp2_reason(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Optional[str]:
    """Why the dynamo graph `gm` cannot be recorded because FSDP2 manages some of its inputs
    (Note [FSDP2 parameters]), or None."""
    storages = _fsdp2_unsharded_storages()
    if not storages:
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        try:
            managed = StorageWeakRef(t.untyped_storage()) in storages
        except (NotImplementedError, RuntimeError):  # tensors without storage
            managed = False
        if managed:
            found.append(_input_name(placeholders[i]) if i < len(placeholders) else f"#{i}")
    if not found:
        return None
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"it reads parameters that FSDP2 (fully_shard) unshards ({shown}); FSDP2 frees them "
            "after use and allocates them again at the next all-gather, so their addresses change "
            "every step and a recording could never be replayed")


def _where(node: torch.fx.Node) -> str:
    """' at file:line (code)' for the user source line that produced `node`, if known."""
    trace = node.meta.get("stack_trace") or ""
    matches = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not matches:
        return ""
    path, line, code = matches[-1]
    return f" at {path}:{line} ({code.strip()})"


def _tensor_vals(val: Any) -> List[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _has_unbacked(val: Any) -> bool:
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    except ImportError:  # pragma: no cover - very old torch
        return False
    return any(free_unbacked_symbols(t) for t in _tensor_vals(val))


def _mutated_inputs(gm: torch.fx.GraphModule) -> Dict[int, torch.fx.Node]:
    """Flat input index -> the node that writes to that input's storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages: Dict[Any, int] = {}
    mutated: Dict[int, torch.fx.Node] = {}
    index = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                storages.setdefault(StorageWeakRef(val.untyped_storage()), index)
            index += 1
            continue
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if not (arg.alias_info and arg.alias_info.is_write):
                continue
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                ref = StorageWeakRef(value.meta["val"].untyped_storage())
                if ref in storages:
                    mutated.setdefault(storages[ref], n)
    return mutated


def skip_reason(gm: torch.fx.GraphModule, static_idxs: Sequence[int]) -> Optional[str]:
    """Why `gm` cannot be recorded as a graph, or None."""
    devices = {
        t.device.type
        for n in gm.graph.nodes
        if n.op == "placeholder"
        for t in _tensor_vals(n.meta.get("val"))
    }
    unsafe_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(getattr(n.target, "_overloadpacket", n.target))
        tags = getattr(n.target, "tags", ())
        if (name in _DATA_DEPENDENT_OPS or str(n.target) in _DATA_DEPENDENT_OPS
                or (unsafe_tag is not None and unsafe_tag in tags)):
            return f"incompatible op {name}{_where(n)}"
        if _has_unbacked(n.meta.get("val")):
            return f"data-dependent shape from {name}{_where(n)}"
        if "cuda" in devices and any(t.device.type == "cpu" and t.dim() > 0
                                     for t in _tensor_vals(n.meta.get("val"))):
            return f"CPU op {name} inside a CUDA graph{_where(n)}"
    unsafe = _pytorch_incompatible_node(gm)
    if unsafe is not None:
        name = str(getattr(unsafe.target, "_overloadpacket", unsafe.target))
        if _has_unbacked(unsafe.meta.get("val")):
            return f"data-dependent shape from {name}{_where(unsafe)}"
        return f"incompatible op {name}{_where(unsafe)}"
    static = set(static_idxs)
    ours = _mutated_inputs(gm)
    for idx in sorted(set(ours) | _pytorch_mutated_inputs(gm)):
        if idx not in static:
            node = ours.get(idx)
            by = f" by {node.target}{_where(node)}" if node is not None else ""
            return f"mutation of eager input #{idx}{by}"
    return None


def _num_fixed_arguments(num_dynamo_inputs: int, num_aot_inputs: int) -> int:
    """Leading AOT forward inputs with fixed addresses (lifted parameters and buffers)."""
    try:
        from torch._inductor.utils import num_fw_fixed_arguments
    except ImportError:  # pragma: no cover - older torch
        return max(0, num_aot_inputs - num_dynamo_inputs)
    return max(0, num_fw_fixed_arguments(num_dynamo_inputs, num_aot_inputs))


def _forward_static_indices(num_dynamo_inputs: int, aot_inputs: Sequence[Any]) -> List[int]:
    static = set(range(_num_fixed_arguments(num_dynamo_inputs, len(aot_inputs))))
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is not None and ctx.fw_metadata is not None:
        static |= set(ctx.fw_metadata.static_input_indices or ())
    return sorted(i for i in static if isinstance(aot_inputs[i], torch.Tensor))


def _static_aliases(gm: torch.fx.GraphModule, static_idxs: Sequence[int]) -> List[str]:
    """Names of the forward's nodes that are views of its static inputs (e.g. a transposed
    weight saved for the backward). AOTAutograd gives the backward's inputs the same names."""
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    static = set()
    for i in static_idxs:
        val = placeholders[i].meta.get("val")
        if isinstance(val, torch.Tensor):
            static.add(StorageWeakRef(val.untyped_storage()))
    names = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "call_function" and isinstance(val, torch.Tensor):
            try:
                if StorageWeakRef(val.untyped_storage()) in static:
                    names.append(n.name)
            except (NotImplementedError, RuntimeError):  # tensors without storage
                pass
    return names


def _backward_static_indices(gm: torch.fx.GraphModule, forward_static: Sequence[int],
                             forward_static_aliases: Sequence[str]) -> List[int]:
    """Backward inputs that are the forward's static inputs (named primals_N, N-1 static) or
    views of them are static too."""
    fwd = set(forward_static)
    aliases = set(forward_static_aliases)
    static = []
    for idx, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        m = re.fullmatch(r"primals_(\d+)", n.name)
        if (m and int(m.group(1)) - 1 in fwd) or n.name in aliases:
            static.append(idx)
    return static


class _Options:
    def __init__(self, inner="inductor", max_recorded_shapes=8, strict=False, warmup_iters=1,
                 rerecord_limit=8, inner_options=None, on_overwrite="raise", chain_limit=16):
        if inner not in _INNER:
            raise ValueError(f"graphtrees: inner must be one of {_INNER}, got {inner!r}")
        if inner_options is not None and (not isinstance(inner_options, dict) or inner != "inductor"):
            raise ValueError("graphtrees: inner_options must be a dict of Inductor config options "
                             "(torch._inductor.config), and needs inner='inductor'; got "
                             f"{inner_options!r} with inner={inner!r}")
        self.graph_options = dict(warmup_iters=warmup_iters, rerecord_limit=rerecord_limit,
                                  max_recorded_shapes=max_recorded_shapes,
                                  on_overwrite=on_overwrite, chain_limit=chain_limit)
        if has_ext():  # without it, the first compiled graph reports the missing build
            get_ext()._validate_options("graphtrees", self.graph_options, 1)
        self.inner = inner
        self.strict = bool(strict)
        self.inner_options = dict(inner_options or {})


_MODE_HELP = (
    "graphtrees records the CUDA graphs itself, so torch.compile's mode= (which selects Inductor's "
    "own cudagraphs and autotuning) does not apply to backend='graphtrees'. Pass Inductor options "
    "through graphtrees.compile(model, inner='inductor', inner_options={...}), e.g. "
    "inner_options={'max_autotune': True}, or through torch.compile(model, "
    "backend='graphtrees', options={...})."
)


def _wrap(opts: _Options, compiled: Callable[[list], Any], gm: torch.fx.GraphModule,
          static_idxs: Sequence[int], mode: Any, name: str,
          graph_reason: str = "") -> Callable[[list], Any]:
    # graph_reason: why the whole dynamo graph (forward and backward) cannot be recorded.
    reason = graph_reason or skip_reason(gm, static_idxs) or ""
    if reason and opts.strict:
        raise SkipError(f"graphtrees (strict=True): cannot record '{name}': {reason}")

    def run(*args):
        return compiled(list(args))

    graphed = get_ext().GraphedCallable(
        run, dict(opts.graph_options, static_argnums=list(static_idxs)), None, name, mode, reason)

    def boxed(args):
        flat = list(args)
        args.clear()  # AOTAutograd's boxed convention: the callee owns the inputs now
        return graphed(*flat)

    boxed._boxed_call = True
    boxed.graphed = graphed
    return boxed


def make_backend(**options) -> Callable:
    """A dynamo backend (for ``torch.compile(backend=...)``) with graphtrees options:
    inner ("inductor" or "aot_eager"), max_recorded_shapes, strict, warmup_iters,
    rerecord_limit, inner_options (Inductor config options), on_overwrite, chain_limit."""
    opts = _Options(**options)

    def graphtrees_backend(gm: torch.fx.GraphModule, example_inputs: List[Any], mode=None,
                           options=None):
        # torch.compile(..., backend="graphtrees", mode=/options=) hands those on here.
        if mode not in (None, "default"):
            raise TypeError(f"graphtrees: torch.compile(..., mode={mode!r}) is not supported. "
                            + _MODE_HELP)
        inner_options = {**opts.inner_options, **(options or {})}
        if inner_options and opts.inner != "inductor":
            raise TypeError(f"graphtrees: Inductor options {sorted(inner_options)} need "
                            "inner='inductor'")
        graph = f"graph{next(_graph_counter)}"
        graph_reason = fsdp2_reason(gm, example_inputs) or ""
        forward_static: List[int] = []
        forward_static_aliases: List[str] = []

        def mode_name(mode):
            return mode.name.lower()

        if opts.inner == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd

            def fw_compiler(aot_gm, aot_inputs, is_inference=False):
                static = _forward_static_indices(len(example_inputs), aot_inputs)
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)
                mode = _modes().INFERENCE if is_inference else _modes().FORWARD
                return _wrap(opts, lambda args: aot_gm(*args), aot_gm, static, mode,
                             f"{graph}.{mode_name(mode)}", graph_reason)

            def bw_compiler(aot_gm, aot_inputs):
                static = _backward_static_indices(aot_gm, forward_static, forward_static_aliases)
                return _wrap(opts, lambda args: aot_gm(*args), aot_gm, static, _modes().BACKWARD,
                             f"{graph}.backward", graph_reason)

            return aot_autograd(
                fw_compiler=fw_compiler,
                bw_compiler=bw_compiler,
                inference_compiler=functools.partial(fw_compiler, is_inference=True),
            )(gm, example_inputs)

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        from torch._inductor.utils import BoxedBool

        def inner_compile(aot_gm, aot_inputs, **kwargs):
            kwargs["cudagraphs"] = BoxedBool(False)  # graphtrees records the graphs
            compiled = compile_fx_inner(aot_gm, aot_inputs, **kwargs)
            if kwargs.get("is_backward", False):
                mode = _modes().BACKWARD
                static = _backward_static_indices(aot_gm, forward_static, forward_static_aliases)
            else:
                mode = _modes().INFERENCE if kwargs.get("is_inference", False) else _modes().FORWARD
                static = sorted(set(kwargs.get("static_input_idxs") or ())
                                | set(_forward_static_indices(len(example_inputs), aot_inputs)))
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)
            return _wrap(opts, compiled, aot_gm, static, mode, f"{graph}.{mode_name(mode)}",
                         graph_reason)

        # AOTAutograd's cache could hand back a plain Inductor compilation of the same graph
        # without calling inner_compile, and nothing would be recorded: bypass it.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                              config_patches=inner_options or None)

    # torch._dynamo.reset() calls reset() on every backend it compiled with: free the trees.
    graphtrees_backend.reset = _reset_trees
    return graphtrees_backend


def _reset_trees() -> None:
    if has_ext():
        get_ext().reset()


# The backend registered as "graphtrees" (default options: inner="inductor").
graphtrees_backend = make_backend()

_BACKEND_OPTIONS = ("max_recorded_shapes", "strict", "warmup_iters", "rerecord_limit",
                    "inner_options", "on_overwrite", "chain_limit")
_COMPILE_OPTIONS = ("fullgraph", "dynamic", "disable")


def compile(model: Optional[Callable] = None, *, inner: str = "inductor", **options):
    """``torch.compile(model)`` with graphtrees recording the compiled graphs.

    Args:
        inner: the compiler of each forward/backward graph: "inductor" or "aot_eager".
        max_recorded_shapes: recordings per compiled graph (one per distinct input shape);
            past it the least recently used one is evicted (logged, counted in tree_info).
        strict: raise instead of running a graph eagerly when it cannot be recorded.
        warmup_iters, rerecord_limit, on_overwrite, chain_limit: as for
            :func:`graphtrees.cudagraphify`.
        inner_options: Inductor config options for the inner compiler (``torch._inductor.config``
            names, e.g. ``{"max_autotune": True}``); inner="inductor" only.
        fullgraph, dynamic, disable: passed to ``torch.compile``. ``mode=`` is refused: graphtrees
            records the graphs itself (use inner_options for Inductor's tuning).
    """
    if "mode" in options:
        raise TypeError(f"graphtrees.compile: mode={options['mode']!r} is not supported. " + _MODE_HELP)
    backend_opts = {k: options.pop(k) for k in list(options) if k in _BACKEND_OPTIONS}
    compile_opts = {k: options.pop(k) for k in list(options) if k in _COMPILE_OPTIONS}
    if options:
        raise TypeError(f"graphtrees.compile: unexpected options {sorted(options)}; "
                        f"graphtrees options are {_BACKEND_OPTIONS}, torch.compile options are "
                        f"{_COMPILE_OPTIONS}")
    backend = make_backend(inner=inner, **backend_opts)
    if model is None:
        return functools.partial(torch.compile, backend=backend, **compile_opts)
    return torch.compile(model, backend=backend, **compile_opts)
