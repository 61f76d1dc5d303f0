#pragma once

// Python containers, one level at a time, for the flattening of arguments (CallSignature) and of
// results (OutputSpec), and the rebuild of a call's arguments around other tensors.
//
// Tensors (torch.Tensor and nn.Parameter) are found inside tuples, lists, namedtuples and dicts
// by the fast C++ path. Any other container type registered with torch.utils._pytree
// (transformers' ModelOutput, for instance) and dataclasses are taken apart and rebuilt through
// the Python layer's hooks (setPyTreeHooks), one level at a time.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

namespace graphtrees {

namespace py = pybind11;

// How deep arguments and results may nest.
constexpr int kMaxPyTreeDepth = 64;

// `flatten(obj)` returns None, or a (children, context) pair for one level of obj;
// `unflatten(type, context, children)` rebuilds it. Installed by the bindings.
void setPyTreeHooks(py::object flatten, py::object unflatten);

// One level of a pytree-registered object or dataclass: (children, context), or None.
py::object flattenNode(PyObject* obj);
py::object unflattenNode(py::handle type, py::handle context, py::list children);

inline bool isNamedTuple(PyObject* obj) {
  return PyTuple_Check(obj) &&
         PyObject_HasAttrString(reinterpret_cast<PyObject*>(Py_TYPE(obj)), "_fields");
}

inline std::string typeName(PyObject* obj) {
  return Py_TYPE(obj)->tp_name;
}

// Rebuilds (args, kwargs) with the tensors replaced, in the order flattenArgs() found them.
std::pair<py::tuple, py::dict> rebuildArgs(py::handle args, py::handle kwargs,
                                           const std::vector<at::Tensor>& tensors);

}  // namespace graphtrees
