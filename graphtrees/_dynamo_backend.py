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

import dataclasses
import functools
import itertools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._ext import get_ext, has_ext
from ._graph_checks import fsdp2_reason, skip_reason

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

    def __post_init__(self):
        if self.inner not in _INNER:
            raise ValueError(f"graphtrees: inner must be one of {_INNER}, got {self.inner!r}")
        if self.inner_options is not None and (
            not isinstance(self.inner_options, dict) or self.inner != "inductor"
        ):
            raise ValueError(
                "graphtrees: inner_options must be a dict of Inductor config options "
                "(torch._inductor.config), and needs inner='inductor'; got "
                f"{self.inner_options!r} with inner={self.inner!r}"
            )
        object.__setattr__(self, "strict", bool(self.strict))
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
_BACKEND_OPTIONS = tuple(f.name for f in dataclasses.fields(_Options) if f.name != "inner")


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


def _wrap(
    opts: _Options,
    compiled: Callable[[list], Any],
    gm: torch.fx.GraphModule,
    static_idxs: Sequence[int],
    mode: Any,
    name: str,
    graph_reason: str = "",
) -> Callable[[list], Any]:
    # graph_reason: why the whole dynamo graph (forward and backward) cannot be recorded.
    reason = graph_reason or skip_reason(gm, static_idxs) or ""
    if reason and opts.strict:
        raise SkipError(f"graphtrees (strict=True): cannot record '{name}': {reason}")

    def run(*args):
        return compiled(list(args))

    graphed = get_ext().GraphedCallable(
        run, dict(opts.graph_options, static_argnums=list(static_idxs)), None, name, mode, reason
    )

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
    rerecord_limit, inner_options (Inductor config options), on_overwrite, chain_limit, verify."""
    opts = _Options(**options)

    def graphtrees_backend(
        gm: torch.fx.GraphModule, example_inputs: list[Any], mode=None, options=None
    ):
        # torch.compile(..., backend="graphtrees", mode=/options=) hands those on here (HF's
        # CompileConfig passes mode="reduce-overhead" by default).
        inner_options = {**_mode_options(mode, opts.inner), **opts.inner_options, **(options or {})}
        if inner_options and opts.inner != "inductor":
            raise TypeError(
                f"graphtrees: Inductor options {sorted(inner_options)} need inner='inductor'"
            )
        graph = f"graph{next(_graph_counter)}"
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

            def fw_compiler(aot_gm, aot_inputs, is_inference=False):
                static = _forward_static_indices(num_inputs, aot_inputs)
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)
                mode = _modes().INFERENCE if is_inference else _modes().FORWARD
                return _wrap(
                    opts,
                    lambda args: aot_gm(*args),
                    aot_gm,
                    static,
                    mode,
                    f"{graph}.{mode_name(mode)}",
                    graph_reason,
                )

            def bw_compiler(aot_gm, aot_inputs):
                static = _backward_static_indices(aot_gm, forward_static, forward_static_aliases)
                return _wrap(
                    opts,
                    lambda args: aot_gm(*args),
                    aot_gm,
                    static,
                    _modes().BACKWARD,
                    f"{graph}.backward",
                    graph_reason,
                )

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
                static = sorted(
                    set(kwargs.get("static_input_idxs") or ())
                    | set(_forward_static_indices(num_inputs, aot_inputs))
                )
                forward_static[:] = static
                forward_static_aliases[:] = _static_aliases(aot_gm, static)
            return _wrap(
                opts, compiled, aot_gm, static, mode, f"{graph}.{mode_name(mode)}", graph_reason
            )

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
    if has_ext():
        get_ext().reset()


# The backend registered as "graphtrees" (default options: inner="inductor").
graphtrees_backend = make_backend()

_COMPILE_OPTIONS = ("fullgraph", "dynamic", "disable", "mode")


def compile(model: Callable | None = None, *, inner: str = "inductor", **options):
    """``torch.compile(model)`` with graphtrees recording the compiled graphs.

    Args:
        inner: the compiler of each forward/backward graph: "inductor" or "aot_eager".
        max_recorded_shapes: recordings per compiled graph (one per distinct input shape);
            past it the least recently used one is evicted (logged, counted in tree_info).
        strict: raise instead of running a graph eagerly when it cannot be recorded.
        warmup_iters, rerecord_limit, on_overwrite, chain_limit, verify: as for
            :func:`graphtrees.cudagraphify`. On the CPU backend, graphs compiled by Inductor
            replay by running them again (``cpu_replay="python"``: Inductor's CPU kernels are
            called outside the dispatcher); aot_eager graphs replay their recorded ops.
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
