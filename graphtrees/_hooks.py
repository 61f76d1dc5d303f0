"""Everything ``import graphtrees`` does to the process, in one place (installed by ``_ext`` once
the compiled core has loaded; ``install`` takes that module):

* graphtrees' C++ core logs through the ``graphtrees`` logger (``logging.getLogger("graphtrees")``).
* ``torch.cuda.is_current_stream_capturing()`` also answers True while graphtrees records a graph
  on the calling thread, on every backend, so library code takes its capture-safe path on the
  CPU emulation too. It is the one torch function graphtrees replaces, for good.
* ``torch.compiler.cudagraph_mark_step_begin()`` (and ``torch._inductor.cudagraph_trees.
  mark_step_begin`` where that module is loaded) also marks a graphtrees step.
* While a graph is being recorded on some thread, ``torch.Tensor.tolist`` is wrapped (a host read
  that ATen does not dispatch is watched), Python's garbage collector's automatic collections are
  paused for the whole process (the collector is process-wide: its first threshold is 0 until the
  last recording of all threads ends; ``gc.isenabled()`` and the user's ``gc.enable()`` and
  ``gc.disable()`` are left alone) and a profile function (``sys.setprofile``) watches the
  recording thread for calls that set a generator's state; all are undone when the recording
  ends.
* Three ``torch.nn.Module`` registration hooks (parameters, buffers, submodules) count the
  registrations, so that wrapped modules re-read their tensors only when some module changed.
  They are plain Python: code that ``torch.compile`` traces (an HF model that slices a
  ``ModuleList`` in ``forward``) gets no graph break and no warning from them.
* At exit, every tree is freed (``graphtrees.reset()``) and the hooks are removed.

Nothing else changes: no other torch function is patched and no global state of torch is set
(``graphtrees.install()``, an explicit opt-in, sets Inductor's ``cudagraph_policy`` and, while
installed, makes ``torch._dynamo.reset()`` free the policy's own functions too:
graphtrees/_policy.py).
"""

import logging
import sys
import threading

import torch

_C = None  # the compiled core, set by install()

_logger = logging.getLogger("graphtrees")
# Guards the state that captures on all threads share: the tolist watch and the GC pause.
_scope_lock = threading.Lock()


def _emit(level: int, message: str) -> None:
    if _logger.isEnabledFor(level):
        _logger.log(level, message)


def _push_log_threshold() -> None:
    """Tells the C++ core the lowest level the logger emits, so that it builds no message below
    it. logging calls its manager's _clear_cache() whenever a level changes (setLevel, disable):
    the threshold is pushed again then."""
    if _C is None:
        return
    disabled = logging.root.manager.disable
    _C._set_log_threshold(max(_logger.getEffectiveLevel(), disabled + 1 if disabled else 0))


def _follow_logging_levels() -> None:
    manager = logging.Logger.manager
    clear = manager._clear_cache

    def _clear_cache():
        clear()
        _push_log_threshold()

    manager._clear_cache = _clear_cache
    _push_log_threshold()


def _collect_garbage() -> bool:
    """Called by a restore that found pool blocks no live output owns (dead cycles may hold
    them), on the restoring thread, which holds its tree's lock. While any thread captures it does
    nothing: a collection would run finalizers that may free the tensors of that capture
    (Note [Freeing during a capture] in csrc/ThreadState.h), past the collector pause the capture
    relies on (Note [One pause of the collector for all threads])."""
    import gc

    with _scope_lock:
        if _active_scopes > 0:
            return False
    gc.collect()
    return True


_capture_tls = threading.local()
_original_tolist = None
_active_scopes = 0
_gc_paused_threshold = None  # gc.get_threshold()[0] when the first of the _active_scopes began


def _enclosing_custom_op() -> str | None:
    """The torch.library.custom_op whose Python implementation is running on this thread's
    stack, if any ("transformers::grouped_mm_fallback", say)."""
    import sys

    from torch._library.custom_ops import CustomOpDef

    frame = sys._getframe(3)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CustomOpDef):
            return owner._qualname
        frame = frame.f_back
    return None


def _note_host_read(what):
    op = _enclosing_custom_op()
    if op is not None:
        # Such an op can be kept out of compiled recordings (Note [Piecewise graphs]).
        what += (
            f" inside the custom op {op}; under torch.compile, splitting_ops=['{op}'] runs "
            "it eagerly between recorded pieces"
        )
    _C._note_host_sync(what)


def _watched_tolist(self, *args, **kwargs):
    if getattr(_capture_tls, "depth", 0) > 0:
        _note_host_read("Tensor.tolist() (reads the tensor's values on the host)")
    return _original_tolist(self, *args, **kwargs)


# Note [Generators set inside a function]
# A replay draws from the generators the recording drew from, as they are when it runs: a CUDA
# graph through its registered generators, a CPU program through the generators its ops took.
# What neither can replay is a function that sets a generator itself (`g.manual_seed(0)`,
# `g.set_state(s)`, `torch.manual_seed(0)` in forward): those are methods of torch.Generator, not
# ops, so nothing recorded repeats them, and each replay would go on drawing where the last one
# stopped where eager starts over. torch does not refuse it: during a CUDA capture, a seed equal
# to the generator's own is accepted and does nothing. No generator state at the start of the
# call tells it apart from a caller that reseeds between calls (which replays right), and a
# generator reached through a closure is first seen at its first draw, after the function set it.
# So the call itself is watched: while a graph is recorded, a profile function on the recording
# thread sees every call of a builtin, and one of these methods on a torch.Generator raises
# before it runs. The capture fails there, as a CUDA capture fails at a forbidden call, and the
# function runs eagerly from then on with that reason (Note [Errors during a capture] in
# csrc/TreeManager.h). A profiler already set on the thread is kept and called; a profiler that
# is not a Python callable (cProfile's on Python 3.11) is left alone, and the watch is off then.
_GENERATOR_SETTERS = frozenset(
    {"manual_seed", "seed", "set_state", "graphsafe_set_state", "set_offset"}
)


# Note [Memory reached outside the dispatcher]
# A CPU recording replays the ops the function dispatched (Note [CPU graphs] in
# csrc/cpu/CpuGraph.h). Tensor.numpy() and DLPack (Tensor.__dlpack__, np.from_dlpack) hand the
# tensor's memory to numpy, and Tensor.data_ptr() to ctypes or a C extension: code no op shows.
# A program would bake what it computed from the recording's values (numpy arithmetic made a
# tensor again by torch.from_numpy, as_tensor or torch.tensor; a torch.library.custom_op
# implemented with numpy), and its completeness proof cannot see it: the baked tensor lies
# outside the pool. The same profile function sees these calls while a graph is recorded.
# numpy and DLPack are there to read values on the host, as tolist() is, often to branch on them:
# the capture is rejected as a host read (on CUDA the values need a host copy, which a capture
# refuses) and the function runs eagerly. data_ptr() is also how code passes tensors to compiled
# kernels: the CPU recording keeps the Python replay, which runs that code again.
_HOST_VIEWS = frozenset({"numpy"})  # methods of Tensor
_DLPACK_EXPORTS = frozenset({"_to_dlpack", "_to_dlpack_versioned"})  # functions of torch._C
_ADDRESSES = frozenset({"data_ptr"})  # methods of Tensor and UntypedStorage


class GeneratorSetDuringRecording(RuntimeError):
    pass


def _called_by_dynamo(frame) -> bool:
    """Whether dynamo's compile is on the stack: it puts back the generators' states it saved
    around a compile (torch.cond's wrapper compiled in a recording; convert_frame.py's
    preserve_global_state), which is not the user's doing (review of issue 48, M1). Only the
    compile counts: dynamo's other frames (a torch._dynamo.disable wrapper around a graphed
    function, eval_frame.py) sit on the stack of the user's own calls."""
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("/torch/_dynamo/convert_frame.py"):
            return True
        frame = frame.f_back
    return False


def _recording_profile(previous):
    generator_type = torch._C.Generator
    memory_types = (torch._C.TensorBase, torch.UntypedStorage)

    def profile(frame, event, arg):
        if not _profile_skipped:
            _skip_profile_in_dynamo()  # dynamo may arrive during the capture (torch.cond's wrapper)
        if event != "c_call":
            return previous(frame, event, arg) if previous is not None else None
        name = getattr(arg, "__name__", None)
        owner = getattr(arg, "__self__", None)
        if name in _HOST_VIEWS and isinstance(owner, torch._C.TensorBase):
            _note_host_read("Tensor.numpy() (numpy reads the tensor's values on the host)")
        elif name in _DLPACK_EXPORTS and owner is torch._C:
            _note_host_read(
                "a DLPack export (Tensor.__dlpack__, np.from_dlpack: numpy reads "
                "the tensor's values on the host)"
            )
        elif name in _ADDRESSES and isinstance(owner, memory_types):
            _C._note_undispatched_access(f"{type(owner).__name__}.{name}()")
        elif name in _GENERATOR_SETTERS and isinstance(owner, generator_type):
            if _called_by_dynamo(frame):
                # Dynamo compiled during the capture (torch.cond's wrapper, first reached here):
                # its work is in the recording, and it puts the generators back (M1).
                _C._refuse_recording(
                    "dynamo compiled code while it was recorded (torch.cond and torch.while_loop "
                    "compile a wrapper the first time they run, here first inside the recording, "
                    "not in its warmup), and a replay would not repeat that work; not the "
                    "function's doing"
                )
                return previous(frame, event, arg) if previous is not None else None
            raise GeneratorSetDuringRecording(
                f"it calls torch.Generator.{arg.__name__}() on the {arg.__self__.device} "
                "generator while it is recorded: a replay would not repeat it and would go on "
                "drawing where the last replay stopped. Set the generator outside the graphed "
                "function (Note [Generators set inside a function])"
            )
        if previous is not None:
            return previous(frame, event, arg)
        return None

    return profile


_profile_skipped = False


def _skip_profile_in_dynamo() -> None:
    # torch.cond run eagerly compiles a wrapper with dynamo; a profile function called from the
    # frames dynamo runs would be compiled too, and the recording would see dynamo's ops and
    # generator calls as the function's (issue 48 review, C1): dynamo skips it. Only once dynamo
    # is imported (a program that never compiles does not import it for this): the profile
    # function does it itself when dynamo arrives during a capture, before dynamo runs a frame.
    # Never an import from here: dynamo may be half-way through its own (a profile event inside
    # it), so its skip_code is used once its module has defined it.
    global _profile_skipped
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip_code = getattr(eval_frame, "skip_code", None)
    if _profile_skipped or skip_code is None:
        return
    skip_code(_recording_profile(None).__code__)
    skip_code(_note_host_read.__code__)
    skip_code(_called_by_dynamo.__code__)
    _profile_skipped = True


def _capture_scope():
    """Entered around every capture (see Note [Rejected captures] in csrc/cpu/HostSyncWatch.cpp):
    the garbage collector's automatic collections are paused for the process, so that no
    finalizer frees pool memory mid-capture, Tensor.tolist() -- a host read that ATen does not
    dispatch -- is watched on this thread, and so are calls that set a generator (Note
    [Generators set inside a function]). Returns the function that leaves the scope."""
    import gc
    import sys

    import torch

    global _original_tolist, _active_scopes, _gc_paused_threshold
    # Note [One pause of the collector for all threads]
    # The collector is process-wide, and a capture's own "was it enabled?" is wrong while another
    # thread captures: a scope that began during another's saw it paused, and once that other
    # scope re-enabled it, paused it again for good; a scope that ended first re-enabled it under
    # the other's capture. So the first scope to begin pauses it and the last to end ends the
    # pause, under one lock. The pause sets the first generation's threshold to 0 (no automatic
    # collection then runs, as with gc.disable()) rather than disabling the collector, so that
    # the user's own gc.disable() or gc.enable() during a capture is neither overwritten nor
    # mistaken for the pause: it stays the user's. The threshold is put back only if it is still
    # the pause's 0: a threshold the user set meanwhile is the newer word and stays (as for the
    # sync debug mode, Note [Syncs of graphtrees' own] in csrc/OwnSyncScope.cpp). gc.collect()
    # still runs when called; graphtrees' own (_collect_garbage) waits for no capture.
    with _scope_lock:
        if _active_scopes == 0:
            thresholds = gc.get_threshold()
            _gc_paused_threshold = thresholds[0]
            gc.set_threshold(0, *thresholds[1:])
            # torch.Tensor.tolist is replaced only while some thread captures.
            if "tolist" not in torch.Tensor.__dict__:
                _original_tolist = torch.Tensor.tolist
                torch.Tensor.tolist = _watched_tolist
        _active_scopes += 1
    _capture_tls.depth = getattr(_capture_tls, "depth", 0) + 1
    previous_profile = sys.getprofile()
    watching = previous_profile is None or callable(previous_profile)
    if watching:
        _skip_profile_in_dynamo()
        sys.setprofile(_recording_profile(previous_profile))

    def leave():
        global _active_scopes
        try:
            if watching:
                sys.setprofile(previous_profile)
            _capture_tls.depth -= 1
        finally:
            with _scope_lock:
                _active_scopes -= 1
                if _active_scopes == 0:
                    if torch.Tensor.__dict__.get("tolist") is _watched_tolist:
                        del torch.Tensor.tolist
                    thresholds = gc.get_threshold()
                    if thresholds[0] == 0:  # still the pause's: otherwise the user's, newer
                        gc.set_threshold(_gc_paused_threshold, *thresholds[1:])

    return leave


def _follow_pytorch_mark_step() -> None:
    """Makes torch.compiler.cudagraph_mark_step_begin() mark a step for graphtrees too."""
    import functools
    import sys

    import torch.compiler

    def chained(original):
        @functools.wraps(original)
        def mark_step_begin(*args, **kwargs):
            result = original(*args, **kwargs)
            _C.mark_step_begin()
            return result

        mark_step_begin._graphtrees = True
        return mark_step_begin

    # torch.compiler's function calls torch._inductor.cudagraph_trees.mark_step_begin(): where
    # that module is loaded already, chaining it also covers references taken before this import.
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is not None and not getattr(trees.mark_step_begin, "_graphtrees", False):
        trees.mark_step_begin = chained(trees.mark_step_begin)
    elif not getattr(torch.compiler.cudagraph_mark_step_begin, "_graphtrees", False):
        torch.compiler.cudagraph_mark_step_begin = chained(torch.compiler.cudagraph_mark_step_begin)


def _pytree_flatten_node(obj):
    """One level of a container that is not a plain tuple, list, dict or namedtuple: a type
    registered with torch.utils._pytree (transformers' ModelOutput, OrderedDict, ...) or a
    dataclass. Returns (children, context), or None for anything else."""
    import dataclasses

    from torch.utils import _pytree

    node = _pytree.SUPPORTED_NODES.get(type(obj))
    if node is not None:
        children, context = node.flatten_fn(obj)
        return list(children), context
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj) if f.init)
        return [getattr(obj, n) for n in names], names
    return None


def _pytree_unflatten_node(typ, context, children):
    from torch.utils import _pytree

    node = _pytree.SUPPORTED_NODES.get(typ)
    if node is not None:
        return node.unflatten_fn(children, context)
    return typ(**dict(zip(context, children)))


def _answer_stream_capturing() -> None:
    """torch.cuda.is_current_stream_capturing() is True while graphtrees records a graph on this
    thread, on every backend (and while the CPU emulation replays one, which re-runs the recorded
    Python): code that avoids host syncs during a CUDA capture then takes the same path on CPU."""
    import functools

    import torch.cuda

    original = torch.cuda.is_current_stream_capturing
    if getattr(original, "_graphtrees", False):
        return

    @functools.wraps(original)
    def is_current_stream_capturing(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo traces torch's own function
            return original(*args, **kwargs)
        if _C._recording_graph():
            return True
        # No capture can be under way before CUDA is initialised; asking would initialise it (and
        # raise where a CUDA build of torch runs without a usable driver).
        return torch.cuda.is_initialized() and original(*args, **kwargs)

    is_current_stream_capturing._graphtrees = True
    torch.cuda.is_current_stream_capturing = is_current_stream_capturing


def _find_tensors_in_blocks(addresses):
    """One live tensor per storage that starts at one of `addresses` (pool blocks that a warmup
    left allocated; see Note [Kept state] in csrc/PoolBookkeeping.cpp). Only plain tensors and
    parameters can hold such state: tensor subclasses (FakeTensor, functional tensors, DTensor)
    are skipped, without asking them for a data pointer (which warns for a FakeTensor)."""
    import gc

    import torch

    wanted = set(addresses)
    found = {}
    plain = (torch.Tensor, torch.nn.Parameter)
    for obj in gc.get_objects():
        cls = type(obj)
        if cls not in plain and not issubclass(cls, torch.nn.Parameter):
            continue
        if obj.is_meta:
            continue
        for t in (obj,) if obj.layout == torch.strided else _sparse_components(obj):
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage, or an invalidated one
                continue
            if ptr in wanted and ptr not in found:
                found[ptr] = t
    return list(found.values())


def _sparse_components(t):
    """The strided tensors a sparse tensor keeps its data in (they share its storages): a
    sparse result of a warmup lives in the pool through them."""
    import torch

    try:
        if t.layout == torch.sparse_coo:
            return (t._indices(), t._values())
        if t.layout in (torch.sparse_csr, torch.sparse_bsr):
            return (t.crow_indices(), t.col_indices(), t.values())
        if t.layout in (torch.sparse_csc, torch.sparse_bsc):
            return (t.ccol_indices(), t.row_indices(), t.values())
    except (RuntimeError, NotImplementedError):
        pass
    return ()


# Counts the parameters, buffers and submodules any module registers; wrapped modules re-read
# their tensors when it changed. Plain Python: dynamo traces it inside compiled code (an HF model
# that slices a ModuleList in forward registers submodules there) with no graph break and no
# guard.
_module_epoch = [0]


def _on_module_change(*args):
    # Under dynamo the registration happens in traced code (a ModuleList sliced in forward makes a
    # temporary one): counting it there would make the count a guard of the compiled code, which
    # would then recompile whenever any module changed. Nothing graphtrees wraps is changed there.
    if torch.compiler.is_compiling():
        return
    _module_epoch[0] += 1


def install(C) -> None:
    import atexit

    import torch.nn.modules.module as module

    global _C
    _C = C
    _C._set_log_sink(_emit)
    _follow_logging_levels()
    _C._set_collect_garbage_hook(_collect_garbage)
    _C._set_capture_scope_hook(_capture_scope)
    _C._set_pytree_hooks(_pytree_flatten_node, _pytree_unflatten_node)
    _C._set_find_storages_hook(_find_tensors_in_blocks)
    _C._set_module_epoch_source(_module_epoch)
    _follow_pytorch_mark_step()
    _answer_stream_capturing()
    from . import _control_flow

    _control_flow.install()  # Note [Control flow in a recording]
    module.register_module_parameter_registration_hook(_on_module_change)
    module.register_module_buffer_registration_hook(_on_module_change)
    module.register_module_module_registration_hook(_on_module_change)

    def _shutdown():
        try:
            _C.reset()
        except Exception as e:  # noqa: BLE001 - an exit must not fail on a device error
            _logger.warning("graphtrees: freeing the trees at exit: %s", e)
        _C._set_log_sink(None)
        _C._set_collect_garbage_hook(None)
        _C._set_capture_scope_hook(None)
        _C._set_pytree_hooks(None, None)
        _C._set_find_storages_hook(None)

    atexit.register(_shutdown)
