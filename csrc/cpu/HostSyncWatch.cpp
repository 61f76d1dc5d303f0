#include "cpu/HostSyncWatch.h"

#include "CollectiveBuffers.h"

#include <Python.h>

#include <cstring>
#include <string>
#include <unordered_map>

namespace graphtrees {

// Note [Rejected captures]
// A CUDA stream capture fails when the function synchronises with the host (.item(), bool() of a
// tensor, .tolist(), printing, nonzero and boolean-mask indexing, unique, torch.equal, ...). The
// CPU emulation could record such a function without complaint (its op program bakes whatever
// the host read, its Python replay would re-read it), so a test passing on CPU would say nothing
// about CUDA. During a CPU capture a watcher of the capture observer (Note [One capture observer]
// in CaptureObserver.h) therefore watches the ops the function dispatches (nested ones included)
// and Tensor.tolist(), which ATen does not
// dispatch, is reported by the Python layer through noteHostSync(). Any of them makes the capture
// rejected exactly like a CUDA one: capture() throws CaptureRejected and the tree runs the
// function eagerly from then on (a capture that ran to its end hands its real results over, so
// this call does not run it twice). Ops whose CPU kernels read values where their CUDA kernels do
// not (_assert_async) are exempt, with everything they call (the watcher is not shown those).

namespace {

thread_local HostSyncWatch* tls_watch = nullptr;

const char* hostSyncDescription(const char* op) {
  static const std::unordered_map<std::string, const char*> ops = {
      {"aten::item", ".item(), or int()/float() of a tensor"},
      {"aten::is_nonzero", "bool() of a tensor, e.g. `if tensor:`"},
      {"aten::_local_scalar_dense", "reading a tensor's value on the host (.item(), bool(), ...)"},
      {"aten::nonzero", "nonzero(), torch.where(cond) or indexing with a boolean mask"},
      {"aten::argwhere", "argwhere()"},
      {"aten::masked_select", "masked_select() (also used when a tensor is printed)"},
      {"aten::_unique", "unique()"},
      {"aten::_unique2", "unique()"},
      {"aten::unique_dim", "unique(dim=...)"},
      {"aten::unique_consecutive", "unique_consecutive()"},
      {"aten::unique_dim_consecutive", "unique_consecutive(dim=...)"},
      {"aten::equal", "torch.equal()"},
      {"c10d::barrier",
       "torch.distributed.barrier() (it blocks the host until every rank arrives)"},
      {"c10d::monitored_barrier_", "torch.distributed.monitored_barrier() (it blocks the host)"},
  };
  auto it = ops.find(op);
  return it == ops.end() ? nullptr : it->second;
}

// Kernels that read tensor values on the host inside ATen, where no nested op shows it: their
// results' shapes or values depend on data a replay would not read again (the CUDA kernels of
// most of them synchronise for the same reason). By name, or by name and overload.
const char* dataDependentKernel(const at::RecordFunction& fn) {
  static const std::unordered_map<std::string, const char*> kernels = {
      {"aten::bincount", "bincount() (its length is the input's maximum, read on the host)"},
      {"aten::tensor_split.tensor_indices_or_sections",
       "tensor_split() with a tensor of indices (read on the host)"},
      {"aten::repeat_interleave.Tensor", "repeat_interleave() with a tensor of repeats"},
      {"aten::repeat_interleave.self_Tensor", "repeat_interleave() with a tensor of repeats"},
      {"aten::narrow.Tensor", "narrow() with a tensor start (read on the host)"},
  };
  const char* name = fn.name();
  if (auto it = kernels.find(name); it != kernels.end()) return it->second;
  const char* overload = fn.overload_name();
  if (overload == nullptr || *overload == '\0') return nullptr;
  auto it = kernels.find(std::string(name) + "." + overload);
  return it == kernels.end() ? nullptr : it->second;
}

// The folder of an imported package ("/.../site-packages/torch/"), or "" when it is not imported.
// Called with the GIL held.
std::string packageDir(const char* module) {
  std::string dir;
  PyObject* name = PyUnicode_FromString(module);
  PyObject* m = name != nullptr ? PyImport_GetModule(name) : nullptr;  // a new reference
  PyObject* file = m != nullptr ? PyObject_GetAttrString(m, "__file__") : nullptr;
  const char* path = file != nullptr && PyUnicode_Check(file) ? PyUnicode_AsUTF8(file) : nullptr;
  if (path != nullptr) {
    dir = path;
    dir.resize(dir.rfind('/') + 1);  // npos + 1 == 0: no folder
  }
  Py_XDECREF(file);
  Py_XDECREF(m);
  Py_XDECREF(name);
  PyErr_Clear();
  return dir;
}

// Whether a frame of `file` is the user's: not torch's own Python (its installed folder, not any
// path with "/torch/" in it), not graphtrees' (its hooks that report an undispatched host read),
// not code FX generated ("<eval_with_key>.N" of a GraphModule).
bool usersFrame(const std::string& file) {
  static const std::string torch_dir = packageDir("torch");
  static const std::string graphtrees_dir = packageDir("graphtrees");
  const auto under = [&file](const std::string& dir) {
    return !dir.empty() && file.compare(0, dir.size(), dir) == 0;
  };
  return !under(torch_dir) && !under(graphtrees_dir) && file.rfind("<eval_with_key", 0) != 0;
}

// " at file.py:12": the line of the Python code that read the host -- the innermost frame of this
// thread that is the user's (usersFrame()) -- so that the eager reason names it
// (graphtrees.report() groups calls by their reasons); empty when no such frame runs. Asked once
// per capture (only the first host read is kept), with the GIL taken for it.
std::string pythonLocation() {
  if (!Py_IsInitialized()) return std::string();
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  std::string where;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && where.empty()) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // a new reference
    PyObject* file = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
    const char* name = file != nullptr ? PyUnicode_AsUTF8(file) : nullptr;
    if (name != nullptr && usersFrame(name)) {
      where = std::string(" at ") + name + ":" + std::to_string(PyFrame_GetLineNumber(frame));
    }
    Py_XDECREF(file);
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // a new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  PyErr_Clear();
  PyErr_Restore(type, value, traceback);
  PyGILState_Release(gil);
  return where;
}

bool exemptFromHostSyncWatch(const char* op) {
  return std::strcmp(op, "aten::_assert_async") == 0 ||
         std::strcmp(op, "aten::_functional_assert_async") == 0;
}

}  // namespace

HostSyncWatchGuard::HostSyncWatchGuard(HostSyncWatch* watch)
    : CaptureWatcher(Needs{/*inputs=*/false, /*outputs=*/false}), watch_(watch), prev_(tls_watch) {
  tls_watch = watch;
  startWatching();
}

HostSyncWatchGuard::~HostSyncWatchGuard() {
  stopWatching();
  tls_watch = prev_;
}

Descend HostSyncWatchGuard::onStart(const ObservedOp& o, int /*level*/) {
  HostSyncWatch* w = watch_;
  const char* op = o.fn.name();
  w->collectives = w->collectives || CollectiveBuffers::isCollective(op);
  if (exemptFromHostSyncWatch(op)) {
    w->exempt_depth++;  // noteHostSync() too is exempt while it runs
    return Descend::kNo;
  }
  if (w->first.empty()) {
    if (const char* what = hostSyncDescription(op)) {
      w->first = std::string(op) + " (" + what + ")" + pythonLocation();
    } else if (const char* kernel = dataDependentKernel(o.fn)) {
      w->first = std::string(op) + " (" + kernel + ")" + pythonLocation();
    }
  }
  return Descend::kNested;
}

void HostSyncWatchGuard::onEnd(const ObservedOp& o, int /*level*/, Descend /*chosen*/) {
  if (exemptFromHostSyncWatch(o.fn.name()) && watch_->exempt_depth > 0) watch_->exempt_depth--;
}

void noteHostSync(const char* what) {
  HostSyncWatch* w = tls_watch;
  if (w != nullptr && w->exempt_depth == 0 && w->first.empty()) w->first = what + pythonLocation();
}

}  // namespace graphtrees
