// Python bindings of graphtrees._C.

#include "CpuBackend.h"
#include "CpuPool.h"
#include "GraphedCallable.h"
#include "Hooks.h"
#include "Logging.h"
#include "TreeManager.h"

#include <torch/csrc/utils/pybind.h>

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
  const c10::Device device = parseDevice(device_obj);
  auto tree = TreeManager::get(device, /*create=*/false, nullptr);
  TreeInfo t;
  t.device = device.str();
  if (tree != nullptr) {
    auto lock = lockTree(*tree);
    t = tree->info();
  }
  py::dict d;
  d["device"] = t.device;
  d["backend"] = tree ? py::object(py::str(t.backend)) : py::object(py::none());
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

}  // namespace
}  // namespace graphtrees

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace graphtrees;
  m.doc() = "graphtrees C++ core: tree manager, backends and the graphed-callable wrapper";

  py::class_<GraphedCallable, std::shared_ptr<GraphedCallable>>(m, "GraphedCallable",
                                                                py::dynamic_attr())
      .def(py::init<py::object, const std::vector<int64_t>&, int, int, py::object, std::string, int,
                    std::string, int>(),
           py::arg("fn"), py::arg("static_argnums"), py::arg("warmup_iters"),
           py::arg("rerecord_limit"), py::arg("module"), py::arg("name"), py::arg("mode") = 0,
           py::arg("eager_reason") = "", py::arg("max_signatures") = 0)
      .def("__call__", &GraphedCallable::call)
      .def("signatures", &GraphedCallable::signatures,
           "Per call signature: function id, warmups, re-records and the eager-fallback reason.")
      .def("__get__",
           [](py::object self, py::object obj, py::object /*type*/) -> py::object {
             if (obj.is_none()) return self;
             return py::module_::import("types").attr("MethodType")(self, obj);
           })
      .def("__repr__", [](const GraphedCallable& g) {
        return "<graphtrees.GraphedCallable '" + g.name() + "'>";
      });

  m.def("mark_step_begin", &TreeManager::markStepBegin,
        "Starts a new step: the next call of any graphed function begins a new generation.");
  m.def(
      "reset",
      [] {
        TORCH_CHECK(!TreeManager::inCall(),
                    "graphtrees.reset() (or torch._dynamo.reset()) was called from inside a "
                    "graphed function's run; call it between graphed calls.");
        py::gil_scoped_release no_gil;
        TreeManager::resetAll();
      },
      "Frees every tree: nodes, graphs and pools. Outputs still alive become invalid.");
  m.def("tree_info", &treeInfo, py::arg("device"));
  m.def(
      "tree_to_dot",
      [](const py::handle& device_obj) {
        const c10::Device device = parseDevice(device_obj);
        auto tree = TreeManager::get(device, false, nullptr);
        if (tree == nullptr) {
          return std::string("digraph graphtrees {\n  label=\"graphtrees: no tree on ") +
                 device.str() + "\";\n}\n";
        }
        auto lock = lockTree(*tree);
        return tree->toDot();
      },
      py::arg("device"));
  m.def(
      "check_pool_invariants",
      [](const py::handle& device_obj) {
        auto tree = TreeManager::get(parseDevice(device_obj), false, nullptr);
        if (tree == nullptr) return std::make_pair(true, std::string());
        auto lock = lockTree(*tree);
        std::string why;
        const bool ok = tree->checkPoolInvariants(&why);
        return std::make_pair(ok, why);
      },
      py::arg("device"),
      "(ok, why): the pool's allocated blocks are exactly the live outputs that own pool memory.");
  m.def("_bump_module_epoch", &GraphedCallable::bumpModuleEpoch);
  m.def("_set_log_sink", [](py::object sink) {
    if (sink.is_none()) {
      setLogSink(nullptr);
      return;
    }
    auto holder = std::make_shared<py::object>(std::move(sink));
    setLogSink([holder](LogLevel level, const std::string& msg) {
      py::gil_scoped_acquire gil;
      try {
        (*holder)(static_cast<int>(level), msg);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("graphtrees log sink");
      }
    });
  });
  m.def("_set_collect_garbage_hook", [](py::object hook) {
    if (hook.is_none()) {
      TreeManager::setCollectGarbageHook(nullptr);
      return;
    }
    auto holder = std::make_shared<py::object>(std::move(hook));
    TreeManager::setCollectGarbageHook([holder] {
      py::gil_scoped_acquire gil;
      (*holder)();
    });
  });
  m.def("_set_debug_checks", &TreeManager::setDebugChecks, py::arg("on"));
  m.def("_fail_next_restores", &TreeManager::failNextRestores, py::arg("n"),
        "Testing hook: the next n pool restores fail as PyTorch issue #140419 does.");
  m.def(
      "_inject_failure",
      [](const std::string& point, int n) { injectFailure(failurePointFromName(point), n); },
      py::arg("point"), py::arg("n") = 1,
      "Testing hook: the next n arrivals at `point` fail (restore, backend_restore, "
      "partial_restore, checkpoint, capture_end, end_allocate, release_pool).");
  m.def(
      "_note_host_sync", [](const std::string& what) { noteHostSync(what.c_str()); },
      py::arg("what"),
      "Reports a host read that ATen does not dispatch (Tensor.tolist) on this thread.");
  m.def("_set_capture_scope_hook", [](py::object hook) {
    if (hook.is_none()) {
      setCaptureScopeHook(nullptr);
      return;
    }
    auto holder = std::make_shared<py::object>(std::move(hook));
    setCaptureScopeHook([holder]() -> std::function<void()> {
      py::gil_scoped_acquire gil;
      auto exit = std::make_shared<py::object>((*holder)());
      return [exit] {
        py::gil_scoped_acquire gil;
        py::object done = std::move(*exit);  // dropped here, under the GIL
        done();
      };
    });
  });
  m.def("_cpu_pool_totals", &CpuPool::globalStats,
        "[pools alive, allocated blocks, reserved bytes] over every CPU pool, released ones too.");
  py::list backends;
  backends.append("cpu");
#ifdef GRAPHTREES_WITH_CUDA
  backends.append("cuda");
#endif
  m.attr("backends") = backends;
}
