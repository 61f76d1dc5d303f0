#include "PyTree.h"

#include <torch/csrc/autograd/python_variable.h>

namespace graphtrees {

namespace {

// The Python layer's torch.utils._pytree hooks (see setPyTreeHooks); used with the GIL held.
py::object& flattenHook() {
  static auto* hook = new py::object();  // never destroyed: no Python at static destruction
  return *hook;
}
py::object& unflattenHook() {
  static auto* hook = new py::object();
  return *hook;
}

py::object rebuildArg(py::handle obj, const std::vector<at::Tensor>& tensors, size_t* next) {
  PyObject* o = obj.ptr();
  if (THPVariable_Check(o)) {
    TORCH_INTERNAL_ASSERT(*next < tensors.size());
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(tensors[(*next)++]));
  }
  if (PyTuple_CheckExact(o) || isNamedTuple(o)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    py::tuple items(n);
    for (Py_ssize_t i = 0; i < n; ++i) items[i] = rebuildArg(PyTuple_GET_ITEM(o, i), tensors, next);
    if (PyTuple_CheckExact(o)) return std::move(items);
    return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(o)))(*items);
  }
  if (PyList_CheckExact(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    py::list items(n);
    for (Py_ssize_t i = 0; i < n; ++i) items[i] = rebuildArg(PyList_GET_ITEM(o, i), tensors, next);
    return std::move(items);
  }
  if (PyDict_CheckExact(o)) {
    py::dict d;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) d[k] = rebuildArg(v, tensors, next);
    return std::move(d);
  }
  if (!PyLong_CheckExact(o) && !PyFloat_CheckExact(o) && !PyUnicode_CheckExact(o) &&
      !PyBool_Check(o) && o != Py_None) {
    py::object node = flattenNode(o);
    if (!node.is_none()) {
      py::tuple pair = node;
      py::list children;
      for (py::handle child : py::list(pair[0])) children.append(rebuildArg(child, tensors, next));
      return unflattenNode(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(o))), pair[1], children);
    }
  }
  return py::reinterpret_borrow<py::object>(obj);
}

}  // namespace

void setPyTreeHooks(py::object flatten, py::object unflatten) {
  flattenHook() = flatten.is_none() ? py::object() : std::move(flatten);
  unflattenHook() = unflatten.is_none() ? py::object() : std::move(unflatten);
}

py::object flattenNode(PyObject* obj) {
  if (!flattenHook()) return py::none();
  return flattenHook()(py::handle(obj));
}

py::object unflattenNode(py::handle type, py::handle context, py::list children) {
  return unflattenHook()(type, context, children);
}

std::pair<py::tuple, py::dict> rebuildArgs(py::handle args, py::handle kwargs,
                                           const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  py::tuple new_args = rebuildArg(args, tensors, &next);
  py::dict new_kwargs;
  if (kwargs.ptr() != nullptr && kwargs.ptr() != Py_None) {
    new_kwargs = rebuildArg(kwargs, tensors, &next);
  }
  return {std::move(new_args), std::move(new_kwargs)};
}

}  // namespace graphtrees
