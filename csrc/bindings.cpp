// Python bindings of graphtrees._C. Every entry point is wrapped with torch's own error and
// warning handling (torch::wrap_pybind_function): c10::Error subclasses reach Python as their
// proper types (ValueError, TypeError, ...) and TORCH_WARN reaches the warnings module.

#include "BackendFactory.h"
#include "GraphedCallable.h"
#include "Logging.h"
#include "ProcessState.h"
#include "TreeRegistry.h"

#include <torch/csrc/Exceptions.h>
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
  d["num_nodes"] = t.num_nodes;
  d["num_roots"] = t.num_roots;
  d["num_checkpoints"] = t.num_checkpoints;
  d["num_rerecords"] = t.num_rerecords;
  d["num_fallbacks"] = t.num_fallbacks;
  d["num_warmups"] = t.num_warmups;
  d["num_recordings"] = t.num_recordings;
  d["num_replays"] = t.num_replays;
  d["num_invalidations"] = t.num_invalidations;
  d["num_evictions"] = t.num_evictions;
  d["num_out_of_memory"] = t.num_out_of_memory;
  d["bytes_released"] = t.bytes_released;
  d["memory_budget"] = t.memory_budget < 0 ? py::object(py::none()) : py::int_(t.memory_budget);
  d["num_migrations"] = t.num_migrations;
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

void setCollectGarbageHookFromPython(py::object hook) {
  if (hook.is_none()) {
    setCollectGarbageHook(nullptr);
    return;
  }
  auto holder = holdPython(std::move(hook));
  setCollectGarbageHook([holder] {
    py::gil_scoped_acquire gil;
    (*holder)();
  });
}

void setFindStoragesHookFromPython(py::object hook) {
  if (hook.is_none()) {
    setFindStoragesHook(nullptr);
    return;
  }
  auto holder = holdPython(std::move(hook));
  setFindStoragesHook([holder](const std::vector<void*>& blocks) {
    py::gil_scoped_acquire gil;
    py::list addresses;
    for (void* p : blocks) addresses.append(reinterpret_cast<uintptr_t>(p));
    std::vector<c10::Storage> out;
    for (py::handle t : (*holder)(addresses)) out.push_back(t.cast<at::Tensor>().storage());
    return out;
  });
}

void setCaptureScopeHookFromPython(py::object hook) {
  if (hook.is_none()) {
    setCaptureScopeHook(nullptr);
    return;
  }
  auto holder = holdPython(std::move(hook));
  setCaptureScopeHook([holder]() -> std::function<void()> {
    py::gil_scoped_acquire gil;
    auto exit = holdPython((*holder)());
    return [exit] {
      py::gil_scoped_acquire gil;
      (*exit)();
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
  setBlockingWaitHook([](const std::function<void()>& wait) {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      wait();
    } else {
      wait();
    }
  });

  setInterruptCheck([](const std::exception& error) {
    const auto* e = dynamic_cast<const py::error_already_set*>(&error);
    if (e == nullptr) return false;
    py::gil_scoped_acquire gil;
    return e->matches(PyExc_KeyboardInterrupt) || e->matches(PyExc_SystemExit);
  });

  py::enum_<FunctionMode>(m, "FunctionMode",
                          "What a graphed function is in a training step (see README).")
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
           "options: static_argnums, warmup_iters, rerecord_limit, max_recorded_shapes, "
           "on_overwrite, chain_limit, buckets, bucket_dim (see graphtrees.cudagraphify).")
      .def("__call__",
           wrap_pybind_function([](GraphedCallable& self, const py::args& args,
                                   const py::kwargs& kwargs) { return self.call(args, kwargs); }))
      .def("_buckets", &GraphedCallable::buckets)
      .def("_bucket_dim", &GraphedCallable::bucketDim)
      .def("_warmup_iters", &GraphedCallable::warmupIters)
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
  m.def(
      "check_pool_invariants", wrap_pybind_function(&checkPoolInvariants), py::arg("device"),
      "(ok, why): the pool's allocated blocks are exactly the live outputs that own pool memory.");
  m.def("_validate_options",
        wrap_pybind_function([](const std::string& who, py::dict options, int64_t min_signatures) {
          validateOptions(who, options, min_signatures);
        }),
        py::arg("who"), py::arg("options"), py::arg("min_signatures") = 0,
        "Raises ValueError for options graphtrees cannot take (the one place they are checked).");
  m.def("_bump_module_epoch", &GraphedCallable::bumpModuleEpoch);
  m.def("_set_log_sink", &setLogSinkFromPython);
  m.def("_set_collect_garbage_hook", &setCollectGarbageHookFromPython);
  m.def("_set_capture_scope_hook", &setCaptureScopeHookFromPython);
  m.def("_set_find_storages_hook", &setFindStoragesHookFromPython);
  m.def("_set_debug_checks", &setDebugChecks, py::arg("on"));
  m.def("_recording_graph", &recordingGraph,
        "True while this thread records a graph (or replays one on the CPU emulation).");
  m.def("_set_pytree_hooks", &setPyTreeHooks, py::arg("flatten"), py::arg("unflatten"),
        "flatten(obj) -> None or (children, context); unflatten(type, context, children).");
  m.def(
      "_fail_next_restores", [](int n) { injectFailure(FailurePoint::kRestore, n); }, py::arg("n"),
      "Testing hook: the next n pool restores fail as PyTorch issue #140419 does.");
  m.def("_inject_failure", wrap_pybind_function([](const std::string& point, int n, int skip) {
          injectFailure(failurePointFromName(point), n, skip);
        }),
        py::arg("point"), py::arg("n") = 1, py::arg("skip") = 0,
        "Testing hook: after `skip` arrivals at `point` that pass, the next n fail (restore, "
        "backend_restore, partial_restore, checkpoint, capture_end, end_allocate, release_pool, "
        "pool_alloc: an out-of-memory error).");
  m.def("_pending_failures", wrap_pybind_function([](const std::string& point) {
          return pendingInjectedFailures(failurePointFromName(point));
        }),
        py::arg("point"), "Testing hook: failures still armed at `point`.");
  m.def(
      "_note_host_sync", [](const std::string& what) { noteUndispatchedHostRead(what.c_str()); },
      py::arg("what"),
      "Reports a host read that ATen does not dispatch (Tensor.tolist) on this thread.");
  m.def("_cpu_pool_totals", &cpuPoolTotals,
        "[pools alive, allocated blocks, reserved bytes] over every CPU pool, released ones too.");
  m.attr("backends") = compiledBackends();
  m.def("_cuda_backend_disabled_reason", &cudaBackendDisabledReason,
        "Why CUDA tensors would run eagerly, or '' when the CUDA backend is enabled.");
#ifdef TORCH_VERSION
  m.attr("built_with_torch") = TORCH_VERSION;
#endif
}
