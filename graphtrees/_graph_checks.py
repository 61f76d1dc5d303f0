"""The checks of a dynamo graph before graphtrees records it: why each op cannot be inside a
recording (``node_reasons``: data-dependent ops, host reads, CPU ops and device copies in a CUDA
graph, mutation of eager inputs, the user's ``splitting_ops``; graphtrees/_piecewise.py splits
the graph around them) and FSDP2's unsharded parameters (``fsdp2_reason``,
Note [FSDP2 parameters]). Where PyTorch has a twin, graphtrees uses it when it is importable
and adds what graphtrees checks beyond it:

* ``_is_unsafe_for_pytorch``: ``torch._inductor.utils.is_cudagraph_unsafe_fx_node`` (what
  PyTorch's own trees refuse to record);
* ``_pytorch_mutated_inputs``: ``torch._dynamo.backends.cudagraphs.find_input_mutations``;
* ``fsdp2_reason`` has no twin: PyTorch's trees re-record such graphs at every step.
"""

import re
from collections.abc import Sequence
from typing import Any

import torch

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


def fsdp2_reason(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str | None:
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
    return (
        f"it reads parameters that FSDP2 (fully_shard) unshards ({shown}); FSDP2 frees them "
        "after use and allocates them again at the next all-gather, so their addresses change "
        "every step and a recording could never be replayed"
    )


def _where(node: torch.fx.Node) -> str:
    """' at file:line (code)' for the user source line that produced `node`, if known."""
    trace = node.meta.get("stack_trace") or ""
    matches = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not matches:
        return ""
    path, line, code = matches[-1]
    return f" at {path}:{line} ({code.strip()})"


def _tensor_vals(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def _input_writes(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Each node that writes to the storage of a graph input -> that input's flat index."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages: dict[Any, int] = {}
    writes: dict[torch.fx.Node, int] = {}
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
                    writes.setdefault(n, storages[ref])
    return writes


def underlying_op(node: torch.fx.Node) -> Any:
    """The op `node` runs: its target, or for a custom op that mutates its arguments (which
    functionalization wraps in auto_functionalized, as vLLM's attention writing into an output
    it is given) the op it wraps."""
    target = node.target
    if getattr(target, "__name__", "").startswith("auto_functionalized") and node.args:
        if isinstance(node.args[0], torch._ops.OpOverload):
            return node.args[0]
    return target


def op_name(node: torch.fx.Node) -> str:
    target = underlying_op(node)
    return str(getattr(target, "_overloadpacket", target))


def _is_unsafe_for_pytorch(node: torch.fx.Node) -> bool:
    """Whether PyTorch's own trees refuse to record `node` (forbidden ops, the cudagraph_unsafe
    tag, input-dependent cases such as index_put with boolean indices, sparse outputs), where
    this torch provides the check (torch._inductor.utils.is_cudagraph_unsafe_fx_node)."""
    try:
        from torch._inductor.utils import is_cudagraph_unsafe_fx_node
    except ImportError:  # pragma: no cover - older torch
        return False
    try:
        return bool(is_cudagraph_unsafe_fx_node(node))
    except Exception:  # noqa: BLE001 - a check of ours must not break compilation
        return False


def is_host_scalar(node: torch.fx.Node) -> bool:
    """A node that computes a host value from sizes and other host values (sym_size, SymInt
    arithmetic, _assert_scalar on them): no kernel, and fixed for a recording, whose signature
    holds every int it is called with."""
    if node.op != "call_function" or _tensor_vals(node.meta.get("val")):
        return False
    if op_name(node) in ("aten.sym_size", "aten.sym_stride", "aten.sym_numel"):
        return True  # reads a tensor's metadata, not its data
    return not any(_tensor_vals(a.meta.get("val")) for a in node.all_input_nodes)


# How a reason says that the user's splitting_ops chose the op.
CHOSEN = "splitting_ops entry"
# Note [Tree branches] in _piecewise.py: a cond split out of the recordings, its branches recorded
# as tree nodes of their own; the node is marked in its meta.
TREE_BRANCH = "graphtrees_tree_branch"
CHOSEN_FORM = "chosen by cond_form='tree-branch'"


def _draws_random_numbers(gm: torch.nn.Module) -> str | None:
    """The first op of `gm` (or of a graph nested in it) that draws random numbers, or None."""
    seeded = torch.Tag.nondeterministic_seeded
    for sub in gm.modules():
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        for n in sub.graph.nodes:
            if n.op == "call_function" and seeded in getattr(underlying_op(n), "tags", ()):
                return op_name(n)
    return None


def tree_branch_reason(gm: torch.fx.GraphModule, n: torch.fx.Node, cuda: bool, form: str):
    """Why the torch.cond `n` of `gm` takes the tree-branch form (Note [Tree branches]), or None
    when it stays in its recording (a CPU program step, CUDA conditional nodes)."""
    if n.target is not torch.ops.higher_order.cond:
        return None
    if form == "tree-branch":
        return f"torch.cond as a tree branch ({CHOSEN_FORM})"
    if not cuda:
        return None
    from ._ext import get_ext

    why = get_ext()._cuda_conditional_unavailable()
    if why:
        return f"torch.cond as a tree branch: no conditional node can hold it ({why})"
    for branch in n.args[1:3]:
        sub = getattr(gm, branch.target, None) if isinstance(branch, torch.fx.Node) else None
        drawn = _draws_random_numbers(sub) if sub is not None else None
        if drawn is not None:
            return (
                f"torch.cond as a tree branch: a branch draws random numbers ({drawn}), which a "
                "conditional node cannot hold"
            )
    return None


def _copies_to_the_host(n):
    """A CPU result computed from CUDA inputs (loss.cpu(), a 0-dim .to("cpu"))."""
    out_cpu = any(t.device.type == "cpu" for t in _tensor_vals(n.meta.get("val")))
    in_cuda = any(
        t.device.type == "cuda" for a in n.all_input_nodes for t in _tensor_vals(a.meta.get("val"))
    )
    return out_cpu and in_cuda


def node_reasons(
    gm: torch.fx.GraphModule,
    static_idxs: Sequence[int],
    splitting_ops: Any = None,
    cond_form: str = "auto",
) -> tuple[dict[torch.fx.Node, str], str | None]:
    """Why each op of `gm` cannot be inside a recording ({node: reason}), and why the graph as a
    whole cannot be recorded even split (or None). `splitting_ops` (a SplittingOps) names ops
    the user keeps out of recordings; `cond_form` is the compile option (Note [Tree branches]):
    a torch.cond taking the tree-branch form is marked in its meta (TREE_BRANCH)."""
    devices = {
        t.device.type
        for n in gm.graph.nodes
        if n.op == "placeholder"
        for t in _tensor_vals(n.meta.get("val"))
    }
    cuda = "cuda" in devices
    unsafe_tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    static = set(static_idxs)
    writes = {n: i for n, i in _input_writes(gm).items() if i not in static}
    reasons: dict[torch.fx.Node, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_host_scalar(n):
            continue
        name = op_name(n)
        tags = getattr(underlying_op(n), "tags", ())
        where = _where(n)
        if (branch := tree_branch_reason(gm, n, cuda, cond_form)) is not None:
            reasons[n] = f"{branch}{where}"
            n.meta[TREE_BRANCH] = True
        elif splitting_ops is not None and (entry := splitting_ops.match(n)) is not None:
            reasons[n] = f"{name} ({CHOSEN} {entry!r}){where}"
        elif (
            name in _DATA_DEPENDENT_OPS
            or str(n.target) in _DATA_DEPENDENT_OPS
            or (unsafe_tag is not None and unsafe_tag in tags)
        ):
            reasons[n] = f"incompatible op {name}{where}"
        elif n.meta.get("unbacked_bindings"):
            reasons[n] = f"data-dependent shape from {name}{where}"
        elif _is_unsafe_for_pytorch(n):
            reasons[n] = f"incompatible op {name}{where}"
        elif cuda and any(
            t.device.type == "cpu" and t.dim() > 0 for t in _tensor_vals(n.meta.get("val"))
        ):
            reasons[n] = f"CPU op {name} inside a CUDA graph{where}"
        elif cuda and _copies_to_the_host(n):
            # A 0-dim result too: a capture refuses the copy whatever its rank (review 4, #16).
            reasons[n] = f"device copy {name} to CPU inside a CUDA graph{where}"
        elif cuda and any(
            t.device.type == "cpu" and t.dim() > 0
            for a in n.all_input_nodes
            for t in _tensor_vals(a.meta.get("val"))
        ):
            reasons[n] = f"device copy {name} from CPU inside a CUDA graph{where}"
        elif n in writes:
            reasons[n] = f"mutation of eager input #{writes[n]} by {n.target}{where}"
    # An input PyTorch's check finds mutated where no op of ours writes it cannot be split out.
    unlocated = sorted(_pytorch_mutated_inputs(gm) - static - set(writes.values()))
    return reasons, (f"mutation of eager input #{unlocated[0]}" if unlocated else None)
