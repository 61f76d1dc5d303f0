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
* a graph with ops that cannot be recorded (``.item()``, data-dependent shapes, ops tagged
  cudagraph_unsafe, mutation of an eager input, CPU ops and device copies in a CUDA graph, the
  user's ``splitting_ops``) is split around them: each recorded piece is a node of the tree and
  the ops between run eagerly (Note [Piecewise graphs] in _piecewise.py), with where and why
  logged once per graph;
* graphs that no split helps (parameters that FSDP2 unshards, nothing left to record) run
  eagerly with the reason and source line logged -- or raise under ``strict=True``.

The backend is registered through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="graphtrees")`` works after ``pip install`` without an import.
"""

import dataclasses
import functools
import itertools
import logging
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._ext import get_ext, has_ext
from ._graph_checks import CHOSEN as _CHOSEN
from ._graph_checks import (
    CHOSEN_FORM,
    TREE_BRANCH,
    fsdp2_reason,
    node_reasons,
)
from ._piecewise import SplittingOps, build, counted, describe, label, plan, summary

_INNER = ("inductor", "aot_eager")


def _modes():
    """The function modes of graphtrees._C (what a graph is in a training step)."""
    return get_ext().FunctionMode


_graph_counter = itertools.count()


class SkipError(RuntimeError):
    """A graph that graphtrees cannot record, under ``strict=True``."""


def _num_fixed_arguments(num_dynamo_inputs: int, num_aot_inputs: int) -> int:
    """Leading AOT forward inputs with fixed addresses (lifted parameters and buffers)."""
    try:
        from torch._inductor.utils import num_fw_fixed_arguments
    except ImportError:  # pragma: no cover - older torch
        return max(0, num_aot_inputs - num_dynamo_inputs)
    return max(0, num_fw_fixed_arguments(num_dynamo_inputs, num_aot_inputs))


def _forward_static_indices(num_dynamo_inputs: int, aot_inputs: Sequence[Any]) -> list[int]:
    static = set(range(_num_fixed_arguments(num_dynamo_inputs, len(aot_inputs))))
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is not None and ctx.fw_metadata is not None:
        static |= set(ctx.fw_metadata.static_input_indices or ())
    return sorted(i for i in static if isinstance(aot_inputs[i], torch.Tensor))


def _static_aliases(gm: torch.fx.GraphModule, static_idxs: Sequence[int]) -> list[str]:
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


def _backward_static_indices(
    gm: torch.fx.GraphModule, forward_static: Sequence[int], forward_static_aliases: Sequence[str]
) -> list[int]:
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


@dataclasses.dataclass(frozen=True)
class _Options:
    """The backend's options; the graph options among them are validated by the one C++ check."""

    inner: str = "inductor"
    max_recorded_shapes: int = 8
    strict: bool = False
    warmup_iters: int = 1
    rerecord_limit: int = 8
    inner_options: dict | None = None
    on_overwrite: str = "raise"
    chain_limit: int = 16
    verify: bool | str | None = None
    piecewise: bool = True
    min_piece_ops: int = 3
    splitting_ops: Any = ()
    cond_form: str = "auto"
    name: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"graphtrees: name must be a str, got {type(self.name).__name__}")
        if self.inner not in _INNER:
            raise ValueError(f"graphtrees: inner must be one of {_INNER}, got {self.inner!r}")
        if self.inner_options is not None and (
            not isinstance(self.inner_options, dict)
            or (self.inner_options and self.inner != "inductor")
        ):
            raise ValueError(
                "graphtrees: inner_options must be a dict of Inductor config options "
                "(torch._inductor.config), and needs inner='inductor'; got "
                f"{self.inner_options!r} with inner={self.inner!r}"
            )
        object.__setattr__(self, "strict", bool(self.strict))
        if not isinstance(self.piecewise, bool):
            raise TypeError(f"graphtrees: piecewise must be True or False, got {self.piecewise!r}")
        if (
            not isinstance(self.min_piece_ops, int)
            or isinstance(self.min_piece_ops, bool)
            or self.min_piece_ops < 1
        ):
            raise ValueError(
                f"graphtrees: min_piece_ops must be an int >= 1, got {self.min_piece_ops!r}"
            )
        if not isinstance(self.splitting_ops, SplittingOps):
            object.__setattr__(self, "splitting_ops", SplittingOps.parse(self.splitting_ops))
        if self.splitting_ops.names and not self.piecewise:
            raise ValueError("graphtrees: splitting_ops needs piecewise=True")
        object.__setattr__(self, "inner_options", dict(self.inner_options or {}))
        if has_ext():  # without it, the first compiled graph reports the missing build
            get_ext()._validate_options("graphtrees", self.graph_options, 1)

    @property
    def graph_options(self) -> dict:
        options = {k: getattr(self, k) for k in _GRAPH_OPTIONS}
        if self.verify is not None:
            options["verify"] = self.verify
        # Inductor's CPU kernels are called outside the dispatcher, so a recorded op program
        # would miss them: graphs it compiled re-run on CPU replays (Note [CPU graphs]).
        options["cpu_replay"] = "python" if self.inner == "inductor" else "program"
        options["cond_form"] = self.cond_form  # checked with the others, shown by each graph
        return options


# The backend's options that are graph options (graphtrees._C.graph_option_names).
_GRAPH_OPTIONS = (
    "warmup_iters",
    "rerecord_limit",
    "max_recorded_shapes",
    "on_overwrite",
    "chain_limit",
)
# Every option the backend takes, each listed once: the fields of _Options.
_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(_Options))
_BACKEND_OPTIONS = tuple(f for f in _OPTION_FIELDS if f != "inner")


# torch.compile's modes, as graphtrees reads them: it records the graphs itself, so the modes
# that would turn on Inductor's own cudagraphs mean what graphtrees does anyway, and the
# autotuning modes select Inductor's autotuning for the inner compiler.
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_logger = logging.getLogger("graphtrees")
_logged_modes: set = set()


def _mode_options(mode: str | None, inner: str) -> dict:
    """The Inductor options that torch.compile's ``mode`` stands for, without Inductor's own
    cudagraphs (graphtrees records the graphs). TypeError for a mode torch.compile does not know,
    or an autotuning mode without an Inductor inner compiler."""
    if mode is None or mode == "default":
        return {}
    if mode not in _MODES:
        raise TypeError(f"graphtrees: unknown torch.compile mode {mode!r}; the modes are {_MODES}")
    if mode not in _logged_modes:
        _logged_modes.add(mode)
        _logger.info(
            "torch.compile(mode=%r) with backend='graphtrees': graphtrees records the CUDA graphs "
            "itself (Inductor's own cudagraphs stay off)%s",
            mode,
            "" if mode == "reduce-overhead" else "; Inductor's autotuning is on",
        )
    if mode == "reduce-overhead":
        return {}
    if inner != "inductor":
        raise TypeError(
            f"graphtrees: mode={mode!r} selects Inductor's autotuning; use inner='inductor'"
        )
    from torch._inductor import list_mode_options

    return {k: v for k, v in list_mode_options(mode).items() if k != "triton.cudagraphs"}


def _traced_strides(gm: torch.fx.GraphModule) -> list[Any]:
    """The strides of `gm`'s outputs as traced (None where an output is not a tensor)."""
    outputs = gm.graph.output_node().args[0]
    vals = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in outputs]
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in vals]


def _graphed(opts, compiled, static_idxs, mode, name, reason="") -> Any:
    """A graphtrees function running `compiled`, a boxed callable (it takes the inputs as one
    list, as Inductor's and AOTAutograd's compiled graphs do)."""

    def run(*args):
        return compiled(list(args))

    options = dict(opts.graph_options, static_argnums=list(static_idxs))
    return get_ext().GraphedCallable(run, options, None, name, mode, reason)


def _boxed(run: Callable[..., Any]) -> Callable[[list], Any]:
    def boxed(args):
        flat = list(args)
        args.clear()  # AOTAutograd's boxed convention: the callee owns the inputs now
        return run(*flat)

    boxed._boxed_call = True
    return boxed


# compile(gm, example_inputs, static_idxs) -> a boxed callable running gm: the inner compiler.
Compile = Callable[[torch.fx.GraphModule, Sequence[Any], Sequence[int]], Callable[[list], Any]]


def _wrap(
    opts: _Options,
    compile_fn: Compile,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    static_idxs: Sequence[int],
    mode: Any,
    name: str,
    graph_reason: str = "",
) -> Callable[[list], Any]:
    """The AOT graph `gm` as graphtrees functions: one, or one per recorded piece of a split
    (Note [Piecewise graphs]). graph_reason: why the whole dynamo graph (forward and backward)
    cannot be recorded."""
    reasons, whole = (
        ({}, graph_reason)
        if graph_reason
        else node_reasons(gm, static_idxs, opts.splitting_ops, opts.cond_form)
    )
    if reasons and not whole and opts.piecewise:
        pieces = plan(gm, reasons, opts.min_piece_ops)
        _splits[name] = summary(name, pieces)
        if any(p.recorded or _tree_branches(p) for p in pieces):
            return _wrap_pieces(
                opts, compile_fn, gm, example_inputs, static_idxs, mode, name, pieces, reasons
            )
        whole = "; ".join(dict.fromkeys(w for p in pieces for w in p.why_eager))
        whole = f"no piece left to record after splitting it ({whole})"
    reason = whole or next(iter(reasons.values()), "")
    if reason and opts.strict:
        raise SkipError(f"graphtrees (strict=True): cannot record '{name}': {reason}")
    compiled = compile_fn(gm, example_inputs, static_idxs)
    graphed = _graphed(opts, compiled, static_idxs, mode, name, reason)
    return _boxed_graphed(graphed)


def _boxed_graphed(graphed: Any) -> Callable[[list], Any]:
    """`graphed` in the boxed convention, with no Python frame of ours on a replay (Note [The
    boxed call in C++], csrc/BoxedCall.h)."""
    boxed = get_ext().BoxedCall(graphed)
    # In its __dict__ as well as on the class: the wrappers AOTAutograd puts around a backward
    # (torch._dynamo.disable, functools.wraps) copy the __dict__ only.
    boxed._boxed_call = True
    boxed.graphed = [graphed]
    return boxed


def _named(fn: Any, name: str) -> Any:
    """`fn` under a name the top-level FX code can call it by: a recorded piece's
    GraphedCallable itself (no Python call in between), an eager piece's bound method wrapped in
    a function (FX finds no module for a bound method)."""
    if not hasattr(fn, "__self__"):
        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = __name__
        return fn

    def piece(*args):
        return fn(*args)

    piece.__name__ = piece.__qualname__ = name
    return piece


def _tree_branches(piece) -> list:
    """The torch.cond nodes of a piece that take the tree-branch form (Note [Tree branches])."""
    return [n for n in piece.nodes if n.op == "call_function" and n.meta.get(TREE_BRANCH)]


def _graph_branches(opts, compile_fn, module, mode, name, graphed, counting, static) -> None:
    """The branches of each torch.cond of an eager piece that takes the tree-branch form, made
    graphtrees functions of their own (Note [Tree branches] in _piecewise.py): the piece's
    attributes that name them are rebound to the recorded functions (the original graph keeps
    its own). `counting`: the number (from 1) of the cond whose branches count in Note [Pending
    backward] (one of the two runs per call), when no recorded piece does. `static`: the names of
    the graph's static inputs (parameters, buffers), used in place by the branches too."""
    count = 0
    for n in module.graph.nodes:
        if n.op != "call_function" or not n.meta.get(TREE_BRANCH):
            continue
        count += 1
        operands = n.args[3]
        inputs = [o.meta.get("val") if isinstance(o, torch.fx.Node) else o for o in operands]
        kept = [
            k
            for k, o in enumerate(operands)
            if isinstance(o, torch.fx.Node) and o.op == "placeholder" and o.name in static
        ]
        for arg, which in ((n.args[1], "true"), (n.args[2], "false")):
            branch = getattr(module, arg.target)
            compiled = compile_fn(branch, inputs, kept)
            g = _graphed(opts, compiled, kept, mode, f"{name}.cond{count}.{which}")
            g._counts_pending = count == counting
            graphed.append(g)

            def run(*args, _g=g):
                return _g(*args)

            module._modules.pop(arg.target, None)
            object.__setattr__(module, arg.target, run)


def _wrap_pieces(opts, compile_fn, gm, example_inputs, static_idxs, mode, name, pieces, reasons):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = {n: example_inputs[i] for i, n in enumerate(placeholders) if i < len(example_inputs)}
    static = {placeholders[i].name for i in static_idxs} | set(_static_aliases(gm, static_idxs))
    recorded = [i for i, p in enumerate(pieces) if p.recorded]
    # Note [Pending backward]: the first forward piece and the last backward piece count; with
    # none recorded, the branches of the first (last) cond taking the tree-branch form.
    backward = mode == _modes().BACKWARD
    with_branches = [i for i, p in enumerate(pieces) if _tree_branches(p)]
    counting = (recorded or with_branches)[-1 if backward else 0]
    counting_cond = None
    if not recorded:
        counting_cond = len(_tree_branches(pieces[counting])) if backward else 1
    graphed = []

    def make_piece(i, piece, module):
        if not piece.recorded:
            # Note [Tree branches] in _piecewise.py: a cond's branches recorded on their own.
            _graph_branches(
                opts,
                compile_fn,
                module,
                mode,
                name + label(i, len(pieces)),
                graphed,
                counting_cond if i == counting else None,
                static,
            )
            # Note [Eager piece runs] in _piecewise.py: graphtrees.report() counts its runs.
            run = counted(module.forward, name + label(i, len(pieces)), piece.why_eager)
            return _named(run, f"eager_piece_{i + 1}")
        piece_static = [k for k, a in enumerate(piece.inputs) if a.name in static]
        inputs = [example.get(a, a.meta.get("val")) for a in piece.inputs]
        compiled = compile_fn(module, inputs, piece_static)
        g = _graphed(opts, compiled, piece_static, mode, name + label(i, len(pieces)))
        g._counts_pending = i == counting
        graphed.append(g)
        return _named(g, f"recorded_piece_{i + 1}")

    top = build(gm, pieces, make_piece)
    # A split the user asked for (splitting_ops only) is news; one forced by an op is a warning.
    chosen = all(_CHOSEN in r or CHOSEN_FORM in r for r in reasons.values())
    _logger.log(logging.INFO if chosen else logging.WARNING, "%s", describe(name, pieces))
    boxed_forward = _boxed(top.forward)
    run_sparing = get_ext()._run_sparing_inputs

    def run_split(args):
        # Note [Inputs of a split graph] (csrc/ThreadState.h): the whole graph's inputs are
        # spared while its pieces run.
        return run_sparing(boxed_forward, args)

    run_split._boxed_call = True
    boxed = run_split
    boxed.top = top
    boxed.graphed = graphed
    return boxed


def _holds_control_flow(gm: torch.fx.GraphModule, cond_form: str = "auto") -> bool:
    """Whether the graph calls torch.cond or torch.while_loop that a recording would hold: with
    cond_form="tree-branch" its own conds run between pieces (Note [Tree branches] in
    _piecewise.py), but a while_loop counts, and so does a cond or loop inside a branch."""
    ops = (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in ops:
            continue
        if cond_form != "tree-branch" or n.target is torch.ops.higher_order.while_loop:
            return True
        for branch in n.args[1:3]:
            sub = getattr(gm, branch.target, None) if isinstance(branch, torch.fx.Node) else None
            if isinstance(sub, torch.fx.GraphModule) and _holds_control_flow(sub):
                return True
    return False


def _records_control_flow(inputs: Sequence[Any]) -> bool:
    """Whether graphtrees records the torch.cond of a graph on these inputs itself: on the CPU
    backend (program steps) and on CUDA where conditional nodes serve (Note [Conditional nodes on
    CUDA] in csrc/cuda/ConditionalNodes.cpp). Elsewhere the cond refuses the recording anyway,
    and Inductor's fusion stays (review of issue 48, M2)."""
    devices = {t.device.type for t in inputs if isinstance(t, torch.Tensor)}
    if devices <= {"cpu"}:
        return True
    if devices <= {"cpu", "cuda"}:
        from ._ext import get_ext

        return not get_ext()._cuda_conditional_unavailable()
    return False


def _log_control_flow_graph(name: str) -> None:
    if name not in _logged_modes:
        _logged_modes.add(name)
        _logger.info(
            "graphtrees: '%s' holds torch.cond or torch.while_loop: it runs as traced "
            "(aot_eager) rather than through Inductor, whose code reads the predicate on the "
            "host, so that graphtrees records the control flow itself",
            name,
        )


def _run_traced(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], static: Sequence[int]):
    return lambda args: gm(*args)


def make_backend(**options) -> Callable:
    """A dynamo backend (for ``torch.compile(backend=...)``) with graphtrees options:
    inner ("inductor" or "aot_eager"), max_recorded_shapes, strict, warmup_iters,
    rerecord_limit, inner_options (Inductor config options), on_overwrite, chain_limit, verify,
    piecewise, min_piece_ops, splitting_ops (see :func:`compile`). The same names passed in
    ``torch.compile(..., options={...})`` set them for that compile; other names there are
    Inductor config options."""
    backend_opts = _Options(**options)

    def graphtrees_backend(
        gm: torch.fx.GraphModule, example_inputs: list[Any], mode=None, options=None
    ):
        # torch.compile(..., backend="graphtrees", mode=/options=) hands those on here (HF's
        # CompileConfig passes mode="reduce-overhead" by default). Options named as graphtrees'
        # (inner, splitting_ops, ...) are graphtrees'; the rest are Inductor config options.
        options = dict(options or {})
        ours = {k: options.pop(k) for k in list(options) if k in _OPTION_FIELDS}
        opts = dataclasses.replace(backend_opts, **ours) if ours else backend_opts
        inner_options = {**_mode_options(mode, opts.inner), **opts.inner_options, **options}
        if inner_options and opts.inner != "inductor":
            raise TypeError(
                f"graphtrees: Inductor options {sorted(inner_options)} need inner='inductor'"
            )
        graph = f"graph{next(_graph_counter)}"
        if opts.name:
            graph = f"{opts.name}.{graph}"
        graph_reason = fsdp2_reason(gm, example_inputs) or ""
        # The compilers below outlive this call: they must not hold the example inputs (real
        # tensors: a StaticCache's, say), which would keep them alive with the compiled code.
        num_inputs = len(example_inputs)
        forward_static: list[int] = []
        forward_static_aliases: list[str] = []

        def mode_name(mode):
            return mode.name.lower()

        if opts.inner == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd

            def run_fx(aot_gm, aot_inputs, static):
                return lambda args: aot_gm(*args)

            def fw_compiler(aot_gm, aot_inputs, is_inference=False):
                static = _forward_static_indices(num_inputs, aot_inputs)
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)
                mode = _modes().INFERENCE if is_inference else _modes().FORWARD
                name = f"{graph}.{mode_name(mode)}"
                return _wrap(opts, run_fx, aot_gm, aot_inputs, static, mode, name, graph_reason)

            def bw_compiler(aot_gm, aot_inputs):
                static = _backward_static_indices(aot_gm, forward_static, forward_static_aliases)
                mode, name = _modes().BACKWARD, f"{graph}.backward"
                return _wrap(opts, run_fx, aot_gm, aot_inputs, static, mode, name, graph_reason)

            return aot_autograd(
                fw_compiler=fw_compiler,
                bw_compiler=bw_compiler,
                inference_compiler=functools.partial(fw_compiler, is_inference=True),
            )(gm, example_inputs)

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        from torch._inductor.utils import BoxedBool

        def inner_compile(aot_gm, aot_inputs, **kwargs):
            kwargs["cudagraphs"] = BoxedBool(False)  # graphtrees records the graphs
            if kwargs.get("is_backward", False):
                mode = _modes().BACKWARD
                static = _backward_static_indices(aot_gm, forward_static, forward_static_aliases)
            else:
                mode = _modes().INFERENCE if kwargs.get("is_inference", False) else _modes().FORWARD
                static = sorted(
                    set(kwargs.get("static_input_idxs") or ())
                    | set(_forward_static_indices(num_inputs, aot_inputs))
                )
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)

            from torch._guards import TracingContext

            context = TracingContext.try_get()
            # AOTAutograd reads the strides of the graph's outputs from the tracing context,
            # where Inductor puts them. A piece of a split must not (Note [Piecewise graphs]).
            reported = context.output_strides if context is not None else None

            def run_inductor(piece_gm, piece_inputs, piece_static):
                piece_kwargs = dict(kwargs, static_input_idxs=list(piece_static))
                if piece_gm is aot_gm:
                    return compile_fx_inner(piece_gm, list(piece_inputs), **piece_kwargs)
                # Every output of a piece keeps its traced strides: the pieces after it were
                # traced with them, and AOTAutograd is told them (below).
                out = piece_gm.graph.output_node()
                out.meta["user_visible_output_idxs"] = list(range(len(out.args[0])))
                # AOTAutograd's donated buffers (backward inputs Inductor may overwrite) are
                # indices into the whole backward's inputs, and a later piece may still read one.
                meta = getattr(context, "fw_metadata", None)
                donated = getattr(meta, "bw_donated_idxs", None)
                if donated:
                    meta.bw_donated_idxs = []
                if reported is not None:
                    context.output_strides = []
                try:
                    return compile_fx_inner(piece_gm, list(piece_inputs), **piece_kwargs)
                finally:
                    if reported is not None:
                        context.output_strides = reported
                    if donated:
                        meta.bw_donated_idxs = donated

            name = f"{graph}.{mode_name(mode)}"
            if _holds_control_flow(aot_gm, opts.cond_form) and _records_control_flow(aot_inputs):
                # Inductor reads a cond's predicate on the host (.item() in its wrapper code):
                # the graph runs as traced, so that the cond reaches graphtrees' kernel (Note
                # [Control flow in a recording] in _control_flow.py): a program step on the CPU,
                # conditional nodes on CUDA.
                _log_control_flow_graph(name)
                traced = dataclasses.replace(opts, inner="aot_eager", inner_options={})
                wrapped = _wrap(
                    traced, _run_traced, aot_gm, aot_inputs, static, mode, name, graph_reason
                )
                if reported is not None and not reported:
                    reported.extend(_traced_strides(aot_gm))
                return wrapped
            wrapped = _wrap(
                opts, run_inductor, aot_gm, aot_inputs, static, mode, name, graph_reason
            )
            if reported is not None and not reported and hasattr(wrapped, "top"):
                # Each piece keeps its outputs' strides as traced (Inductor's
                # keep_output_stride), so the graph's outputs have the traced strides.
                reported.extend(_traced_strides(aot_gm))
            return wrapped

        # AOTAutograd's cache could hand back a plain Inductor compilation of the same graph
        # without calling inner_compile, and nothing would be recorded: bypass it.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                gm,
                example_inputs,
                inner_compile=inner_compile,
                config_patches=inner_options or None,
            )

    # torch._dynamo.reset() calls reset() on every backend it compiled with: free the trees.
    graphtrees_backend.reset = _reset_trees
    return graphtrees_backend


def _reset_trees() -> None:
    _splits.clear()
    if has_ext():
        get_ext().reset()


# Graph name -> its pieces, for every graph split since torch._dynamo.reset().
_splits: dict[str, list[dict]] = {}


def split_info() -> dict[str, list[dict]]:
    """The graphs graphtrees split into pieces (Note [Piecewise graphs]) since the last
    ``torch._dynamo.reset()``, including those left with no piece to record (which run eagerly
    whole): graph name (``"graph0.forward"``) -> one dict per piece, in order:
    ``piece`` (``"graph0.forward[1/3]"``, the name its tree nodes have), ``recorded``, ``ops``
    (ops in it, host scalars not counted) and ``why_eager`` (empty for a recorded piece)."""
    return {
        name: [dict(p, why_eager=list(p["why_eager"])) for p in pieces]
        for name, pieces in _splits.items()
    }


# The backend registered as "graphtrees" (default options: inner="inductor").
graphtrees_backend = make_backend()

_COMPILE_OPTIONS = ("fullgraph", "dynamic", "disable", "mode")


_NO_BOUND = 1 << 30  # max_recorded_shapes for "no bound" (the backend's minimum is 1)


class TreeBranchForm:
    """Note [A wrapper's cond split into tree branches] (csrc/ThreadState.h): called with why,
    it makes what runs the calls of ``wrapper = cudagraphify(fn, **options)`` when its
    torch.cond takes the tree-branch form -- `fn` traced by torch.compile with graphtrees
    recording the pieces around the cond and each branch (inner="aot_eager": the function's own
    ops, as cudagraphify records them) -- or None where the wrapper's options have no equivalent
    there, or where that tracing failed before (the wrapper keeps running the calls, eagerly)."""

    def __init__(self, fn: Callable, name: str, options: dict, wrapper: Any):
        self._fn, self._name, self._options = fn, name, dict(options)
        self._wrapper = weakref.ref(wrapper)  # the wrapper holds this: no cycle
        self._failed = False

    def __call__(self, why: str) -> Callable | None:
        chosen = why == CHOSEN_FORM
        options = self._options
        if options.get("buckets") or options.get("cpu_replay", "program") != "program":
            if chosen:
                raise ValueError(
                    "graphtrees.cudagraphify: cond_form='tree-branch' traces the function with "
                    "torch.compile and records its pieces, which cannot take buckets or "
                    "cpu_replay='python'"
                )
            _logger.warning(
                "graphtrees: '%s' keeps running eagerly (%s): the tree-branch form that would "
                "record its torch.cond cannot take buckets or cpu_replay='python'",
                self._name,
                why,
            )
            return None
        if self._failed:
            return None
        passed = {k: options[k] for k in (*_GRAPH_OPTIONS, "verify") if options.get(k) is not None}
        if not passed.get("max_recorded_shapes"):  # cudagraphify's default: no bound
            passed["max_recorded_shapes"] = _NO_BOUND
        form = "tree-branch" if chosen else "auto"
        # Unasked (auto), the whole function must be one graph: dynamo then fails, if it does,
        # before any of the call has run, and the wrapper can run the call eagerly instead. With
        # graph breaks, the part before a break would have run already (its side effects twice).
        compiled = compile(
            self._fn,
            inner="aot_eager",
            cond_form=form,
            name=self._name,
            fullgraph=not chosen,
            **passed,
        )
        _logger.log(
            logging.INFO if chosen else logging.WARNING,
            "graphtrees: '%s' is traced by torch.compile and split at its torch.cond (the "
            "tree-branch form: each branch a tree node of its own)%s: %s",
            self._name,
            "" if chosen else " from its next call",
            why,
        )
        static = sorted(options.get("static_argnums") or ())

        def run(*args, **kwargs):
            # cudagraphify's static arguments are used in place: static addresses for dynamo.
            for i in static:
                if i < len(args):
                    for t in torch.utils._pytree.tree_leaves(args[i]):
                        if isinstance(t, torch.Tensor):
                            torch._dynamo.mark_static_address(t)
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:
                return self._untraceable(e, chosen, args, kwargs)

        return run

    def _untraceable(self, error: Exception, chosen: bool, args: tuple, kwargs: dict) -> Any:
        """torch.compile could not trace or compile the function (a branch that aliases its
        input, a host read dynamo refuses, a graph break): asked for, that is an error (as from
        torch.compile: with a graph break, the part before it has run); otherwise (fullgraph:
        nothing of the call has run) the wrapper takes its calls back and runs them as before,
        eagerly with the reason."""
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = " ".join(lines[:4] or [type(error).__name__])[:400]
        if chosen:
            raise RuntimeError(
                f"graphtrees: cond_form='tree-branch' traces '{self._name}' with torch.compile, "
                f"which failed: {first}; use cond_form='auto' to record it whole"
            ) from error
        self._failed = True
        _logger.warning(
            "graphtrees: '%s' runs as before, without the tree-branch form: torch.compile could "
            "not trace it (%s)",
            self._name,
            first,
        )
        wrapper = self._wrapper()
        if wrapper is None:
            return self._fn(*args, **kwargs)
        wrapper._delegate = None
        return wrapper(*args, **kwargs)


def compile(model: Callable | None = None, *, inner: str = "inductor", **options):
    """``torch.compile(model)`` with graphtrees recording the compiled graphs.

    Args:
        inner: the compiler of each forward/backward graph: "inductor" or "aot_eager".
        max_recorded_shapes: recordings per compiled graph (one per distinct input shape);
            past it the least recently used one is evicted (logged, counted in tree_info).
        strict: raise instead of running a graph eagerly when it cannot be recorded, even
            split (a graph that is split into recorded pieces does not raise).
        piecewise: split a graph around the ops that cannot be recorded (default True); False
            runs such a graph eagerly whole, as graphtrees did before.
        min_piece_ops: a piece of a split graph with fewer ops than this (default 3) runs
            eagerly: its replay would cost about what running its ops costs.
        splitting_ops: op names to keep out of recordings, run eagerly between recorded pieces
            (as vLLM's ``splitting_ops``), e.g. ``["aten::scaled_dot_product_attention"]`` for
            an attention whose kernel picks its work from the sequence length, or
            ``["mylib::paged_attention"]``. An aten entry also matches the ops a Python function
            of that name lowered to.
        warmup_iters, rerecord_limit, on_overwrite, chain_limit, verify: as for
            :func:`graphtrees.cudagraphify`. On the CPU backend, graphs compiled by Inductor
            replay by running them again (``cpu_replay="python"``: Inductor's CPU kernels are
            called outside the dispatcher); aot_eager graphs replay their recorded ops.
        cond_form: "auto" (default): a torch.cond is a control step of the CPU backend's program
            or CUDA conditional nodes, and takes the tree-branch form only where those cannot
            serve it (on CUDA, a branch that draws random numbers or a driver without conditional
            nodes); "tree-branch": always -- the graph is split at the cond and each branch is
            recorded as a tree node of its own, so the pool holds the larger branch's memory
            rather than both (Note [Tree branches] in _piecewise.py).
        name: the prefix of its graphs' names in logs, :func:`tree_info` and
            :func:`split_info` (``"decoder.graph0.forward"``; default none: ``"graph0.forward"``).
        inner_options: Inductor config options for the inner compiler (``torch._inductor.config``
            names, e.g. ``{"max_autotune": True}``); inner="inductor" only.
        fullgraph, dynamic, disable, mode: passed to ``torch.compile``. ``mode`` None,
            "default" and "reduce-overhead" mean what graphtrees does (it records the graphs
            itself); "max-autotune" and "max-autotune-no-cudagraphs" turn on Inductor's
            autotuning for the inner compiler.
    """
    backend_opts = {k: options.pop(k) for k in list(options) if k in _BACKEND_OPTIONS}
    compile_opts = {k: options.pop(k) for k in list(options) if k in _COMPILE_OPTIONS}
    if options:
        raise TypeError(
            f"graphtrees.compile: unexpected options {sorted(options)}; "
            f"graphtrees options are {_BACKEND_OPTIONS}, torch.compile options are "
            f"{_COMPILE_OPTIONS}"
        )
    backend = make_backend(inner=inner, **backend_opts)
    _mode_options(compile_opts.get("mode"), inner)  # an unknown mode is refused here already
    if model is None:
        return functools.partial(torch.compile, backend=backend, **compile_opts)
    return torch.compile(model, backend=backend, **compile_opts)
