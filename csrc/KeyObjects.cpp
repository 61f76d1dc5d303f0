#include "KeyObjects.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <iterator>

namespace graphtrees {

namespace {

// Whether `a` and `b` (of one type) are the same value bit for bit, as Python floats in the key
// are: 0.0 is not -0.0 and a NaN is itself. Sets *decided when the type is one valueBits() takes.
bool sameBits(PyObject* a, PyObject* b, bool* decided) {
  std::string x;
  std::string y;
  *decided = valueBits(a, &x) && valueBits(b, &y);
  return *decided && x == y;
}

}  // namespace

bool valueBits(PyObject* obj, std::string* bytes) {
  if (PyFloat_Check(obj)) {
    const double v = PyFloat_AS_DOUBLE(obj);
    bytes->assign(reinterpret_cast<const char*>(&v), sizeof(v));
    return true;
  }
  if (PyComplex_Check(obj)) {
    const Py_complex v = PyComplex_AsCComplex(obj);
    bytes->assign(reinterpret_cast<const char*>(&v), sizeof(v));
    return true;
  }
  static const char* const kNumpyFloats[] = {"numpy.float16", "numpy.float32", "numpy.longdouble",
                                             "numpy.complex64", "numpy.clongdouble"};
  const char* name = Py_TYPE(obj)->tp_name;
  if (std::none_of(std::begin(kNumpyFloats), std::end(kNumpyFloats),
                   [&](const char* n) { return std::strcmp(name, n) == 0; }) ||
      !PyObject_CheckBuffer(obj)) {
    return false;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) != 0) {
    PyErr_Clear();
    return false;
  }
  bytes->assign(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
  PyBuffer_Release(&view);
  return true;
}

py::object weakReferent(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  if (PyWeakref_GetRef(ref, &target) < 0) PyErr_Clear();
  return py::reinterpret_steal<py::object>(target);
#else
  PyObject* target = PyWeakref_GetObject(ref);
  return target == Py_None ? py::object() : py::reinterpret_borrow<py::object>(target);
#endif
}

void KeyObjects::hold(const std::vector<py::object>& objects) {
  TORCH_INTERNAL_ASSERT(held_.empty());
  held_.reserve(objects.size());
  for (const py::object& o : objects) {
    PyObject* obj = o.ptr();
    if (PyMethod_Check(obj)) {
      if (PyObject* weak = PyWeakref_NewRef(PyMethod_GET_SELF(obj), nullptr)) {
        PyObject* func = PyMethod_GET_FUNCTION(obj);
        Py_INCREF(func);
        held_.push_back({weak, How::kMethod, func});
        continue;
      }
      PyErr_Clear();
    }
    if (Py_TYPE(obj)->tp_hash != PyBaseObject_Type.tp_hash) {
      Py_INCREF(obj);
      held_.push_back({obj, How::kValue});
      continue;
    }
    if (PyObject* weak = PyWeakref_NewRef(obj, nullptr)) {
      held_.push_back({weak, How::kWeak});
      continue;
    }
    PyErr_Clear();  // a type without weak references: held, so that its address stays its own
    Py_INCREF(obj);
    held_.push_back({obj, How::kIdentity});
  }
}

KeyObjects::~KeyObjects() {
  if (held_.empty() || !Py_IsInitialized()) return;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return;  // the interpreter frees everything itself
#else
  if (_Py_IsFinalizing()) return;
#endif
  py::gil_scoped_acquire gil;
  for (const Held& h : held_) {
    Py_DECREF(h.ref);
    Py_XDECREF(h.func);
  }
}

bool KeyObjects::anyDead() const {
  for (const Held& h : held_) {
    if ((h.how == How::kWeak || h.how == How::kMethod) && !weakReferent(h.ref)) return true;
  }
  return false;
}

bool KeyObjects::matches(const std::vector<py::object>& objects) const {
  if (objects.size() != held_.size()) return false;
  for (size_t i = 0; i < held_.size(); ++i) {
    PyObject* obj = objects[i].ptr();
    const Held& h = held_[i];
    switch (h.how) {
      case How::kWeak:
        if (weakReferent(h.ref).ptr() != obj) return false;
        break;
      case How::kMethod:
        if (!PyMethod_Check(obj) || PyMethod_GET_FUNCTION(obj) != h.func ||
            weakReferent(h.ref).ptr() != PyMethod_GET_SELF(obj)) {
          return false;
        }
        break;
      case How::kIdentity:
        if (h.ref != obj) return false;
        break;
      case How::kValue:
        if (h.ref != obj) {
          bool decided = false;
          const bool same = sameBits(h.ref, obj, &decided);
          if (decided) {
            if (!same) return false;
            break;
          }
          const int eq = PyObject_RichCompareBool(h.ref, obj, Py_EQ);
          if (eq < 0) PyErr_Clear();
          if (eq != 1) return false;
        }
        break;
    }
  }
  return true;
}

}  // namespace graphtrees
