// Python bindings of graphtrees._C. Every entry point is wrapped with torch's own error and
// warning handling (torch::wrap_pybind_function): c10::Error subclasses reach Python as their
// proper types (ValueError, TypeError, ...) and TORCH_WARN reaches the warnings module.

#include "BackendFactory.h"
#include "BoxedCall.h"
#include "CallRange.h"
#include "CallStats.h"
#include "CaptureObserver.h"
#include "FailureInjection.h"
#include "GraphedCallable.h"
#include "Logging.h"
#include "OwnSyncScope.h"
#include "PythonHooks.h"
#include "ThreadState.h"
#include "TreeRegistry.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/headeronly/version.h>

namespace graphtrees {
namespace {

c10::Device parseDevice(const py::handle& device) {
  return c10::Device(py::str(device).cast<std::string>());
}

py::dict poolDict(const PoolStats& p) {
  py::dict d;
  d["reserved_bytes"] = p.reserved_bytes;
  d["allocated_bytes"] = p.allocated_bytes;
  d["segments"] = p.segments;
  d["blocks"] = p.blocks;
  d["allocated_blocks"] = p.allocated_blocks;
  return d;
}

py::dict treeInfo(const py::handle& device_obj) {
  bool has_tree = false;
  const TreeInfo t = TreeRegistry::info(parseDevice(device_obj), &has_tree);
  py::dict d;
  d["device"] = t.device;
  d["backend"] = has_tree ? py::object(py::str(t.backend)) : py::object(py::none());
  d["thread"] = has_tree ? t.thread : threadId();
  d["state"] = t.state;
  d["generation"] = t.generation;
#define GRAPHTREES_COUNTER_TO_DICT(name, doc) d[#name] = t.counters.name;
  GRAPHTREES_TREE_COUNTERS(GRAPHTREES_COUNTER_TO_DICT)
#undef GRAPHTREES_COUNTER_TO_DICT
  d["num_roots"] = t.num_roots;
  d["memory_budget"] = t.memory_budget < 0 ? py::object(py::none()) : py::int_(t.memory_budget);
  d["retired_trees"] = t.retired_trees;
  d["leaked_bytes"] = t.leaked_bytes;
  d["pending_backward"] = t.pending_backward;
  d["live_outputs"] = t.live_outputs;
  d["current_node"] =
      t.current_node >= 0 ? py::object(py::int_(t.current_node)) : py::object(py::none());
  d["pool"] = poolDict(t.pool);
  py::list nodes;
  for (const auto& n : t.nodes) {
    py::dict nd;
    nd["id"] = n.id;
    nd["parent"] = n.parent >= 0 ? py::object(py::int_(n.parent)) : py::object(py::none());
    nd["function"] = n.function;
    nd["function_id"] = n.function_id;
    nd["children"] = n.children;
    nd["pool_bytes"] = n.pool_bytes;
    nd["num_outputs"] = n.num_outputs;
    nd["input_kinds"] = n.input_kinds;
    nd["live_outputs"] = n.live_outputs;
    nd["replays"] = n.replays;
    nd["on_current_path"] = n.on_current_path;
    nd["cpu_replay"] = n.cpu_replay.empty() ? py::object(py::none()) : py::str(n.cpu_replay);
    nd["kind"] = n.kind;
    py::list conditionals;                  // Note [Control steps of a program] in cpu/OpProgram.h
    for (const auto& c : n.conditionals) {  // "kind:form" (Graph::conditionals())
      py::dict cd;
      const auto colon = c.find(':');
      cd["kind"] = c.substr(0, colon);
      cd["form"] = colon == std::string::npos ? std::string() : c.substr(colon + 1);
      conditionals.append(cd);
    }
    nd["conditionals"] = conditionals;
    nodes.append(nd);
  }
  d["nodes"] = nodes;
  return d;
}

std::string treeToDot(const py::handle& device_obj) {
  const c10::Device device = parseDevice(device_obj);
  bool has_tree = false;
  const TreeInfo t = TreeRegistry::info(device, &has_tree);
  if (!has_tree) {
    return "digraph graphtrees {\n  label=\"graphtrees: no tree on " + device.str() + "\";\n}\n";
  }
  return toDot(t);
}

py::list callStats() {
  py::list out;
  for (const auto& s : CallStats::all()) {
    py::dict d;
    d["name"] = s->name();
    d["callable_id"] = s->callableId();
    d["replays"] = s->count(RunKind::kReplay);
    d["recordings"] = s->count(RunKind::kRecord);
    d["warmups"] = s->count(RunKind::kWarmup);
    d["eager"] = s->count(RunKind::kEager);
    py::list reasons;  // Note [Reason kinds] in CallStats.h
    for (const auto& [why, n] : s->reasons()) {
      py::dict r;
      r["reason"] = why.first;
      r["kind"] = why.second;
      r["count"] = n;
      reasons.append(r);
    }
    d["eager_reasons"] = reasons;
    d["signatures"] = s->signatures();
    out.append(d);
  }
  return out;
}

std::pair<bool, std::string> checkPoolInvariants(const py::handle& device_obj) {
  auto tree = TreeRegistry::acquire(parseDevice(device_obj), /*create=*/false);
  if (!tree) return {true, std::string()};
  std::string why;
  const bool ok = tree->checkPoolInvariants(&why);
  return {ok, why};
}

// Holds a Python callable for the C++ side; the object is released under the GIL.
std::shared_ptr<py::object> holdPython(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

void setLogSinkFromPython(py::object sink) {
  if (sink.is_none()) {
    setLogSink(nullptr);
    return;
  }
  auto holder = holdPython(std::move(sink));
  setLogSink([holder](LogLevel level, const std::string& msg) {
    py::gil_scoped_acquire gil;
    try {
      (*holder)(static_cast<int>(level), msg);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("graphtrees log sink");
    }
  });
}

// Installs a Python callable (None clears) as `hook`, through `adapt(holder)`, which turns the held
// callable into the hook's C++ function.
template <typename Sig, typename Adapt>
void installHook(Hook<Sig>& hook, py::object fn, Adapt adapt) {
  if (fn.is_none()) {
    hook.set(nullptr);
    return;
  }
  hook.set(adapt(holdPython(std::move(fn))));
}

void setCollectGarbageHookFromPython(py::object fn) {
  installHook(collectGarbageHook(), std::move(fn), [](std::shared_ptr<py::object> holder) {
    return [holder]() -> bool {
      py::gil_scoped_acquire gil;
      const py::object collected = (*holder)();
      return collected.is_none() || collected.cast<bool>();
    };
  });
}

void setFindStoragesHookFromPython(py::object fn) {
  installHook(findStoragesHook(), std::move(fn), [](std::shared_ptr<py::object> holder) {
    return [holder](const std::vector<void*>& blocks) {
      py::gil_scoped_acquire gil;
      py::list addresses;
      for (void* p : blocks) addresses.append(reinterpret_cast<uintptr_t>(p));
      std::vector<c10::Storage> out;
      for (py::handle t : (*holder)(addresses)) out.push_back(t.cast<at::Tensor>().storage());
      return out;
    };
  });
}

void setCaptureScopeHookFromPython(py::object fn) {
  installHook(captureScopeHook(), std::move(fn), [](std::shared_ptr<py::object> holder) {
    return [holder]() -> std::function<void()> {
      py::gil_scoped_acquire gil;
      auto exit = holdPython((*holder)());
      return [exit] {
        py::gil_scoped_acquire gil;
        (*exit)();
      };
    };
  });
}

}  // namespace
}  // namespace graphtrees

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace graphtrees;
  using torch::wrap_pybind_function;
  m.doc() = "graphtrees C++ core: tree manager, backends and the graphed-callable wrapper";

  // Waiting for another thread's tree call releases the GIL: that call may need it to finish.
  blockingWaitHook().set([](const std::function<void()>& wait) {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      wait();
    } else {
      wait();
    }
  });
  propagatesHook().set([](const std::exception& error) {
    const auto* e = dynamic_cast<const py::error_already_set*>(&error);
    if (e == nullptr) return false;
    py::gil_scoped_acquire gil;
    return !e->matches(PyExc_RuntimeError);  // KeyboardInterrupt, SystemExit, the user's own
  });

  py::enum_<FunctionMode>(m, "FunctionMode",
                          "What a graphed function is in a training step (see docs/training.md).")
      .value("INFERENCE", FunctionMode::kInference)
      .value("FORWARD", FunctionMode::kForward)
      .value("BACKWARD", FunctionMode::kBackward);

  py::class_<GraphedCallable, std::shared_ptr<GraphedCallable>>(m, "GraphedCallable",
                                                                py::dynamic_attr())
      .def(py::init(wrap_pybind_function([](py::object fn, py::dict options, py::object module,
                                            py::object name, FunctionMode mode,
                                            std::string eager_reason) {
             const GraphOptions validated = validateOptions("graphtrees.cudagraphify", options);
             TORCH_CHECK_TYPE(py::isinstance<py::str>(name),
                              "graphtrees.cudagraphify: name must be a str, got ",
                              py::str(py::type::of(name).attr("__name__")).cast<std::string>());
             return std::make_shared<GraphedCallable>(std::move(fn), validated, std::move(module),
                                                      name.cast<std::string>(), mode,
                                                      std::move(eager_reason));
           })),
           py::arg("fn"), py::arg("options") = py::dict(), py::arg("module") = py::none(),
           py::arg("name") = "", py::arg("mode") = FunctionMode::kInference,
           py::arg("eager_reason") = "",
           "options: any of graphtrees._C.graph_option_names (see graphtrees.cudagraphify).")
      .def("__call__",
           wrap_pybind_function([](GraphedCallable& self, const py::args& args,
                                   const py::kwargs& kwargs) { return self.call(args, kwargs); }))
      .def("_resize_example",
           wrap_pybind_function([](const GraphedCallable& self, const py::args& args,
                                   const py::kwargs& kwargs) {
             TORCH_CHECK_VALUE(args.size() >= 1 && PyLong_Check(args[0].ptr()),
                               "_resize_example(size, *args, **kwargs)");
             const int64_t size = args[0].cast<int64_t>();
             return self.resizeExample(py::args(args[py::slice(1, args.size(), 1)]), kwargs, size);
           }),
           "(args, kwargs) of an example call with its batch cut or zero-padded to `size`.")
      .def_property_readonly(
          "options", [](const GraphedCallable& g) { return toDict(g.options()); },
          "The validated options, by the names graphtrees.cudagraphify takes them.")
      .def_property("_counts_pending", &GraphedCallable::countsPending,
                    &GraphedCallable::setCountsPending,
                    "Whether its runs open or close a pending backward (Note [Pending backward]); "
                    "graphtrees turns it off on all pieces of a split graph but one.")
      .def_property(
          "_evict_when_freed", &GraphedCallable::evictWhenFreed,
          &GraphedCallable::setEvictWhenFreed,
          "Whether its recordings leave every tree when it is freed (graphtrees.install()'s "
          "functions).")
      .def("_evict_recordings",
           wrap_pybind_function(
               [](GraphedCallable& self, const std::string& why) { self.evictRecordings(why); }),
           py::arg("why"),
           "Forgets every signature and removes their recordings from every tree (those on a "
           "tree's current path once the path moves off them).")
      .def("_set_tree_branch_factory", &GraphedCallable::setTreeBranchFactory, py::arg("factory"),
           "Note [A wrapper's cond split into tree branches]: factory(why) -> the callable that "
           "takes over its calls when a warmup asks for the tree-branch form, or None.")
      .def_property("_delegate", &GraphedCallable::delegate, &GraphedCallable::setDelegate,
                    "The callable that runs its calls instead (the tree-branch form), or None.")
      .def("signatures", &GraphedCallable::signatures,
           "Per call signature: function id, warmups and re-records (in the calling thread's "
           "tree) and the eager-fallback reason.")
      .def("__get__",
           [](py::object self, py::object obj, py::object /*type*/) -> py::object {
             if (obj.is_none()) return self;
             return py::module_::import("types").attr("MethodType")(self, obj);
           })
      .def("__repr__", [](const GraphedCallable& g) {
        return "<graphtrees.GraphedCallable '" + g.name() + "'>";
      });

  py::class_<BoxedCall> boxed(m, "BoxedCall", py::dynamic_attr(),
                              "A GraphedCallable in AOTAutograd's boxed calling convention: "
                              "called with one list of inputs, which it empties.");
  boxed.def(py::init<std::shared_ptr<GraphedCallable>>(), py::arg("graphed"))
      .def("__call__", wrap_pybind_function([](const BoxedCall& self, const py::handle& inputs) {
             return self.call(inputs);
           }))
      .def("__repr__", [](const BoxedCall& b) {
        return "<graphtrees.BoxedCall '" + b.graphed()->name() + "'>";
      });
  boxed.attr("_boxed_call") = true;

  m.def("mark_step_begin", &markStepBegin,
        "Starts a new step for the calling thread: its next graphed call begins a new "
        "generation.");
  m.def("reset", wrap_pybind_function([] {
          TORCH_CHECK(!inTreeCall(),
                      "graphtrees.reset() (or torch._dynamo.reset()) was called from inside a "
                      "graphed function's run; call it between graphed calls.");
          py::gil_scoped_release no_gil;
          TreeRegistry::resetAll();
        }),
        "Frees every tree: nodes, graphs and pools. Outputs still alive become invalid.");
  m.def("_function_states", wrap_pybind_function([](const py::handle& device) {
          TreeRegistry::Handle tree = TreeRegistry::acquire(parseDevice(device), /*create=*/false);
          return tree ? static_cast<int64_t>(tree->functionStates()) : 0;
        }),
        py::arg("device"), "How many functions the calling thread's tree keeps a state of.");
  m.def("_release_empty_trees", wrap_pybind_function([] {
          py::gil_scoped_release no_gil;
          TreeRegistry::releaseEmptyTrees();
        }),
        "Frees the trees that hold no recording, no live output and no call.");
  m.def("tree_info", wrap_pybind_function(&treeInfo), py::arg("device"));
  m.def("set_memory_budget", wrap_pybind_function([](const py::handle& device, py::object bytes) {
          int64_t n = -1;
          if (!bytes.is_none()) {
            const bool ok = PyLong_Check(bytes.ptr()) && !PyBool_Check(bytes.ptr()) &&
                            bytes.cast<int64_t>() >= 0;
            TORCH_CHECK_VALUE(ok,
                              "graphtrees.set_memory_budget: max_pool_bytes must be an int >= 0 "
                              "or None, got ",
                              py::repr(bytes).cast<std::string>());
            n = bytes.cast<int64_t>();
          }
          TreeRegistry::setMemoryBudget(parseDevice(device), n);
        }),
        py::arg("device"), py::arg("max_pool_bytes"));
  m.def("memory_budget", wrap_pybind_function([](const py::handle& device) -> py::object {
          const int64_t n = TreeRegistry::memoryBudget(parseDevice(device));
          return n < 0 ? py::object(py::none()) : py::object(py::int_(n));
        }),
        py::arg("device"));
  m.def("tree_to_dot", wrap_pybind_function(&treeToDot), py::arg("device"));
  m.def("_call_stats", &callStats,
        "Per wrapped callable, what its calls ran as (Note [Call statistics] in CallStats.h).");
  m.def("_reset_call_stats", &CallStats::resetAll,
        "Zeroes every callable's call statistics and forgets those of freed callables.");
  m.def(
      "_tree_reason_kind",
      [](const std::string& reason) { return std::string(reasonKindName(treeReasonKind(reason))); },
      "The kind of a reason the tree gave (Note [Reason kinds] in CallStats.h), for the tests.");
  m.def("_call_ranges_begun", &CallRange::begun,
        "Profiler and NVTX ranges begun since the process started (Note [Call ranges]).");
  m.def(
      "check_pool_invariants", wrap_pybind_function(&checkPoolInvariants), py::arg("device"),
      "(ok, why): the pool's allocated blocks are exactly the live outputs that own pool memory.");
  m.def("_validate_options",
        wrap_pybind_function(
            [](const std::string& who, py::dict options, int64_t min_recorded_shapes) {
              validateOptions(who, options, min_recorded_shapes);
            }),
        py::arg("who"), py::arg("options"), py::arg("min_recorded_shapes") = 0,
        "Raises ValueError for options graphtrees cannot take (the one place they are checked).");
  m.attr("graph_option_names") = py::tuple(py::cast(graphOptionNames()));
  py::dict counters;
#define GRAPHTREES_COUNTER_DOC(name, doc) counters[#name] = doc;
  GRAPHTREES_TREE_COUNTERS(GRAPHTREES_COUNTER_DOC)
#undef GRAPHTREES_COUNTER_DOC
  m.attr("tree_counters") = counters;
  m.def("_set_module_epoch_source", &GraphedCallable::setModuleEpochSource, py::arg("counter"));
  m.def(
      "_run_sparing_inputs",
      [](const py::function& fn, const py::list& args) {
        // Note [Inputs of a split graph] in ThreadState.h.
        std::vector<const void*> storages;
        for (py::handle a : args) {
          if (THPVariable_Check(a.ptr())) {
            const at::Tensor& t = THPVariable_Unpack(a.ptr());
            if (t.defined() && t.has_storage()) {
              storages.push_back(t.storage().unsafeGetStorageImpl());
            }
          }
        }
        SparedInputsScope scope(std::move(storages));
        return fn(args);
      },
      "Runs fn(args) (a split graph's top level, boxed) sparing the inputs' storages from the "
      "invalidation of a step that begins inside it.");
  m.def("_set_log_sink", &setLogSinkFromPython);
  m.def("_set_log_threshold", &setLogThreshold, py::arg("level"),
        "The lowest level the graphtrees logger emits (the Python layer keeps it current).");
  m.def("_log_messages_built", &messagesBuilt,
        "How many log messages the C++ core has built (only those the logger would emit).");
  m.def("_set_collect_garbage_hook", &setCollectGarbageHookFromPython);
  m.def("_set_capture_scope_hook", &setCaptureScopeHookFromPython);
  m.def("_set_find_storages_hook", &setFindStoragesHookFromPython);
  m.def("_set_debug_checks", &setDebugChecks, py::arg("on"));
  m.def(
      "_in_own_sync_scope",
      [](const py::function& fn) {
        OwnSyncScope own;
        return fn();
      },
      py::arg("fn"),
      "Testing hook: fn() called inside an OwnSyncScope (Note [Syncs of graphtrees' own]).");
  m.def("_recording_graph", &recordingGraph,
        "True while this thread records a graph (or replays one on the CPU emulation).");
  m.def("_set_pytree_hooks", &setPyTreeHooks, py::arg("flatten"), py::arg("unflatten"),
        "flatten(obj) -> None or (children, context); unflatten(type, context, children).");
  py::dict points;
  for (const auto& p : failurePoints()) points[p.name] = p.what;
  m.attr("failure_points") = points;
  m.def("_inject_failure", wrap_pybind_function([](const std::string& point, int n, int skip) {
          injectFailure(failurePointFromName(point), n, skip);
        }),
        py::arg("point"), py::arg("n") = 1, py::arg("skip") = 0,
        "Testing hook: after `skip` arrivals at `point` (a key of graphtrees._C.failure_points) "
        "that pass, the next n fail.");
  m.def("_pending_failures", wrap_pybind_function([](const std::string& point) {
          return pendingInjectedFailures(failurePointFromName(point));
        }),
        py::arg("point"), "Testing hook: failures still armed at `point`.");
  m.def(
      "_note_host_sync", [](const std::string& what) { noteUndispatchedHostRead(what.c_str()); },
      py::arg("what"),
      "Reports a host read that ATen does not dispatch (Tensor.tolist) on this thread.");
  m.def(
      "_note_undispatched_access",
      [](const std::string& what) { noteUndispatchedAccess(what.c_str()); }, py::arg("what"),
      "Reports access to tensor memory that ATen does not dispatch (Tensor.numpy) on this thread.");
  m.def("_control_flow_event", wrap_pybind_function(&controlFlowEvent), py::arg("event"),
        py::arg("first") = std::vector<at::Tensor>(), py::arg("second") = std::vector<at::Tensor>(),
        "Note [Control flow in a recording] (graphtrees/_control_flow.py): True iff a CPU program "
        "recorder on this thread saw the event ('generators_taken': iff an op took a generator).");
  m.def("_control_flow_predicate", wrap_pybind_function(&controlFlowPredicate), py::arg("pred"),
        "A one-element CPU tensor read as a condition without dispatching an op.");
  m.def(
      "_run_watching_host_reads",
      [](const py::function& fn, const py::tuple& args) {
        py::object result;
        std::string first = runWatchingHostReads([&] { result = fn(*args); });
        return py::make_tuple(result, first);
      },
      py::arg("fn"), py::arg("args"),
      "fn(*args) with this thread's host reads watched during a warmup or capture: (its result, "
      "the first host read met or '').");
  m.def("_cuda_conditional_unavailable", &cudaConditionalUnavailable,
        "Why a CUDA recording cannot hold conditional nodes (this torch, this driver), or ''.");
  m.def("_cuda_conditional_step",
        wrap_pybind_function([](const std::string& what, const std::optional<at::Tensor>& pred) {
          cudaConditionalStep(what, pred.value_or(at::Tensor()));
        }),
        py::arg("what"), py::arg("pred") = py::none(),
        "Note [Conditional nodes on CUDA]: 'cond', 'else', 'while_loop', 'set' or 'end' in the "
        "capture under way on the current stream.");
  m.def("_refuse_recording", wrap_pybind_function(&CaptureObserver::refuseCurrent), py::arg("why"),
        "Refuses the warmup or capture under way on this thread (it runs eagerly from then on, "
        "for `why`); False if none is.");
  m.def("_request_tree_branches", &requestTreeBranches, py::arg("why"),
        "Note [A wrapper's cond split into tree branches]: the warmup under way refused a "
        "torch.cond that the tree-branch form can serve, for `why`.");
  m.def("_in_tree_call", &inTreeCall,
        "Whether this thread is inside a graphed call (a warmup, recording or replay).");
  m.def(
      "_tree_call_device",
      [] {
        // Only a warmup, a capture (an observer watches both) or a CPU Python replay: an eager
        // run inside a call runs torch's own kernels.
        const int t = treeCallDeviceType();
        if (t < 0 || (CaptureObserver::current() == nullptr && !recordingGraph()))
          return std::string();
        return c10::DeviceTypeName(static_cast<c10::DeviceType>(t), /*lower_case=*/true);
      },
      "The device type ('cpu', 'cuda') of the tree whose warmup, recording or CPU Python replay "
      "runs on this thread, or '' (none, or an eager run inside a call).");
  m.def("_cpu_pool_totals", &cpuPoolTotals,
        "[pools alive, allocated blocks, reserved bytes] over every CPU pool, released ones too.");
  m.attr("backends") = compiledBackends();
  m.def("_cuda_backend_disabled_reason", &cudaBackendDisabledReason,
        "Why CUDA tensors would run eagerly, or '' when the CUDA backend is enabled.");
#ifdef TORCH_VERSION
  m.attr("built_with_torch") = TORCH_VERSION;
#endif
}
