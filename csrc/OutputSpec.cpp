#include "OutputSpec.h"

#include "KeyObjects.h"
#include "PyTree.h"
#include "StorageInvalidated.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstring>

namespace graphtrees {

namespace {

bool sameConstant(const py::object& a, const py::object& b) {
  if (a.is(b)) return true;
  if (Py_TYPE(a.ptr()) != Py_TYPE(b.ptr())) return false;
  if (PyFloat_CheckExact(a.ptr())) {  // bit for bit: a NaN equals itself, 0.0 is not -0.0
    const double x = PyFloat_AS_DOUBLE(a.ptr());
    const double y = PyFloat_AS_DOUBLE(b.ptr());
    return std::memcmp(&x, &y, sizeof(double)) == 0;
  }
  if (PyComplex_CheckExact(a.ptr())) {  // so is a complex number (found by the OpInfo sweep)
    const Py_complex x = PyComplex_AsCComplex(a.ptr());
    const Py_complex y = PyComplex_AsCComplex(b.ptr());
    return std::memcmp(&x.real, &y.real, sizeof(double)) == 0 &&
           std::memcmp(&x.imag, &y.imag, sizeof(double)) == 0;
  }
  const int r = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (r < 0) {
    PyErr_Clear();
    return false;
  }
  return r == 1;
}

}  // namespace

OutputSpec OutputSpec::flatten(py::handle result, std::vector<at::Tensor>* tensors,
                               const std::string& function_name, py::handle call_args,
                               py::handle call_kwargs) {
  OutputSpec spec;
  spec.call_args_ = call_args;
  spec.call_kwargs_ = call_kwargs;
  spec.flattenInto(result, tensors, function_name, 0);
  spec.call_args_ = spec.call_kwargs_ = py::handle();
  return spec;
}

bool OutputSpec::flattenArgument(PyObject* obj) {
  if (call_args_.ptr() != nullptr && PyTuple_Check(call_args_.ptr())) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(call_args_.ptr()); ++i) {
      if (PyTuple_GET_ITEM(call_args_.ptr(), i) == obj) {
        entries_.push_back({Kind::kArgument, 0, py::int_(i)});
        return true;
      }
    }
  }
  if (call_kwargs_.ptr() != nullptr && PyDict_Check(call_kwargs_.ptr())) {
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(call_kwargs_.ptr(), &pos, &k, &v)) {
      if (v == obj) {
        entries_.push_back({Kind::kArgument, 0, py::reinterpret_borrow<py::object>(k)});
        return true;
      }
    }
  }
  return false;
}

void OutputSpec::flattenInto(py::handle obj, std::vector<at::Tensor>* tensors,
                             const std::string& name, int depth) {
  PyObject* o = obj.ptr();
  if (depth > kMaxPyTreeDepth) {
    throw py::type_error("graphtrees: the result of '" + name + "' is nested too deeply");
  }
  if (THPVariable_Check(o)) {
    if (!THPVariable_CheckExact(o)) {
      throw py::type_error("graphtrees: '" + name + "' returned a tensor subclass ('" +
                           typeName(o) + "'), which graphtrees cannot rebuild on replay");
    }
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.layout() != c10::kStrided || !t.has_storage()) {
      throw py::type_error("graphtrees: '" + name + "' returned a tensor with layout " +
                           c10::str(t.layout()) + "; only strided tensors can be graphed");
    }
    if (t.is_quantized()) {
      throw py::type_error("graphtrees: '" + name +
                           "' returned a quantized tensor, which graphtrees cannot rebuild on "
                           "replay (its scale and zero point live outside its storage)");
    }
    if (t._is_zerotensor()) {  // found by the OpInfo sweep: the sgn backward's gradient
      throw py::type_error("graphtrees: '" + name +
                           "' returned an efficient zero tensor (autograd's ZeroTensor, as a "
                           "backward returns for a gradient known to be zero), which has no "
                           "memory for a graph to write");
    }
    // An nn.Parameter comes back as one: a module's weight returned as it is as that Parameter,
    // one the function made (over its result) as a new Parameter over the replayed tensor.
    // (a weak reference to it, its requires_grad)
    py::object param;
    if (Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(ParameterClass)) {
      auto weak = py::reinterpret_steal<py::object>(PyWeakref_NewRef(o, nullptr));
      if (!weak) throw py::error_already_set();
      param = py::make_tuple(std::move(weak), py::bool_(t.requires_grad()));
    }
    entries_.push_back({Kind::kTensor, 0, std::move(param)});
    tensors->push_back(t);
    return;
  }
  if (o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) ||
      PyUnicode_CheckExact(o) || PyComplex_CheckExact(o) || PyBytes_CheckExact(o)) {
    entries_.push_back({Kind::kConstant, 0, py::reinterpret_borrow<py::object>(obj)});
    return;
  }
  if (PyTuple_CheckExact(o) || isNamedTuple(o)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    if (PyTuple_CheckExact(o)) {
      entries_.push_back({Kind::kTuple, n, py::object()});
    } else {
      entries_.push_back(
          {Kind::kNamedTuple, n,
           py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(o)))});
    }
    for (Py_ssize_t i = 0; i < n; ++i)
      flattenInto(PyTuple_GET_ITEM(o, i), tensors, name, depth + 1);
    return;
  }
  if (PyList_CheckExact(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    entries_.push_back({Kind::kList, n, py::object()});
    for (Py_ssize_t i = 0; i < n; ++i) flattenInto(PyList_GET_ITEM(o, i), tensors, name, depth + 1);
    return;
  }
  if (PyDict_CheckExact(o)) {
    py::list keys;
    std::vector<py::handle> values;
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &k, &v)) {
      keys.append(k);
      values.push_back(v);
    }
    entries_.push_back({Kind::kDict, static_cast<int64_t>(values.size()), py::tuple(keys)});
    for (auto v2 : values) flattenInto(v2, tensors, name, depth + 1);
    return;
  }
  py::object node = flattenNode(o);
  if (!node.is_none()) {
    py::tuple pair = node;
    py::list children = pair[0];
    entries_.push_back(
        {Kind::kNode, static_cast<int64_t>(children.size()),
         py::make_tuple(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(o))), pair[1])});
    for (py::handle child : children) flattenInto(child, tensors, name, depth + 1);
    return;
  }
  if (flattenArgument(o)) return;
  throw py::type_error("graphtrees: '" + name + "' returned a value of type '" + typeName(o) +
                       "'; graphed functions may return tensors, None, Python scalars and "
                       "strings, in tuples, lists, namedtuples, dicts, dataclasses and types "
                       "registered with torch.utils._pytree");
}

py::object OutputSpec::unflatten(const std::vector<at::Tensor>& tensors, py::handle call_args,
                                 py::handle call_kwargs) const {
  size_t pos = 0;
  size_t next = 0;
  py::object r = build(&pos, tensors, &next, call_args, call_kwargs);
  TORCH_INTERNAL_ASSERT(pos == entries_.size() && next == tensors.size());
  return r;
}

py::object OutputSpec::build(size_t* pos, const std::vector<at::Tensor>& tensors, size_t* next,
                             py::handle call_args, py::handle call_kwargs) const {
  const Entry& e = entries_[(*pos)++];
  switch (e.kind) {
    case Kind::kTensor: {
      const at::Tensor& t = tensors[(*next)++];
      if (e.value) {  // a Parameter when recorded: that Parameter, if it is still this tensor
        PyObject* weak = PyTuple_GET_ITEM(e.value.ptr(), 0);
        py::object owner = weakReferent(weak);
        if (owner && THPVariable_Check(owner.ptr())) {
          const at::Tensor& p = THPVariable_Unpack(owner.ptr());
          // An earlier run's result a later run overwrote is not this one's.
          const bool overwritten =
              p.has_storage() && storageInvalidated(*p.storage().unsafeGetStorageImpl());
          if (p.is_same(t) ||
              (!overwritten && p.data_ptr() == t.data_ptr() && p.sizes().equals(t.sizes()) &&
               p.strides().equals(t.strides()) && p.scalar_type() == t.scalar_type())) {
            return owner;
          }
        }
        // One the function made: a new Parameter over this run's tensor, as eagerly.
        return py::reinterpret_borrow<py::object>(ParameterClass)(
            py::reinterpret_steal<py::object>(THPVariable_Wrap(t)),
            py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(e.value.ptr(), 1)));
      }
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
    }
    case Kind::kConstant:
      return e.value;
    case Kind::kArgument: {
      // The same call signature passes the same arguments (its key holds their identities).
      PyObject* found = nullptr;
      if (PyLong_Check(e.value.ptr())) {
        const Py_ssize_t i = e.value.cast<Py_ssize_t>();
        if (call_args.ptr() != nullptr && i < PyTuple_GET_SIZE(call_args.ptr())) {
          found = PyTuple_GET_ITEM(call_args.ptr(), i);
        }
      } else if (call_kwargs.ptr() != nullptr && PyDict_Check(call_kwargs.ptr())) {
        found = PyDict_GetItem(call_kwargs.ptr(), e.value.ptr());
      }
      TORCH_INTERNAL_ASSERT(found != nullptr, "graphtrees: a result that is the call's argument ",
                            py::repr(e.value).cast<std::string>(), " has no such argument now");
      return py::reinterpret_borrow<py::object>(found);
    }
    case Kind::kTuple:
    case Kind::kNamedTuple: {
      py::tuple items(e.count);
      for (int64_t i = 0; i < e.count; ++i)
        items[i] = build(pos, tensors, next, call_args, call_kwargs);
      if (e.kind == Kind::kTuple) return std::move(items);
      return e.value(*items);
    }
    case Kind::kList: {
      py::list items(e.count);
      for (int64_t i = 0; i < e.count; ++i)
        items[i] = build(pos, tensors, next, call_args, call_kwargs);
      return std::move(items);
    }
    case Kind::kDict: {
      py::dict d;
      py::tuple keys = e.value;
      for (int64_t i = 0; i < e.count; ++i)
        d[keys[i]] = build(pos, tensors, next, call_args, call_kwargs);
      return std::move(d);
    }
    case Kind::kNode: {
      py::list children(e.count);
      for (int64_t i = 0; i < e.count; ++i)
        children[i] = build(pos, tensors, next, call_args, call_kwargs);
      py::tuple type_and_context = e.value;
      return unflattenNode(type_and_context[0], type_and_context[1], children);
    }
  }
  return py::none();
}

bool OutputSpec::sameAs(const OutputSpec& other) const {
  if (entries_.size() != other.entries_.size()) return false;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& a = entries_[i];
    const Entry& b = other.entries_[i];
    if (a.kind != b.kind || a.count != b.count) return false;
    if (a.kind == Kind::kConstant || a.kind == Kind::kDict || a.kind == Kind::kNamedTuple ||
        a.kind == Kind::kNode || a.kind == Kind::kArgument) {
      if (!sameConstant(a.value, b.value)) return false;
    }
  }
  return true;
}

std::string OutputSpec::describe() const {
  std::string s;
  for (const auto& e : entries_) {
    switch (e.kind) {
      case Kind::kTensor:
        s += "T ";
        break;
      case Kind::kConstant:
        s += py::repr(e.value).cast<std::string>() + " ";
        break;
      case Kind::kArgument:
        s += "argument[" + py::str(e.value).cast<std::string>() + "] ";
        break;
      case Kind::kTuple:
        s += "tuple[" + std::to_string(e.count) + "] ";
        break;
      case Kind::kNamedTuple:
        s += py::str(e.value.attr("__name__")).cast<std::string>() + "[" + std::to_string(e.count) +
             "] ";
        break;
      case Kind::kList:
        s += "list[" + std::to_string(e.count) + "] ";
        break;
      case Kind::kNode:
        s += py::str(py::tuple(e.value)[0].attr("__name__")).cast<std::string>() + "[" +
             std::to_string(e.count) + "] ";
        break;
      case Kind::kDict:
        s += "dict" + py::repr(e.value).cast<std::string>() + " ";
        break;
    }
  }
  if (!s.empty()) s.pop_back();
  return s;
}

}  // namespace graphtrees
