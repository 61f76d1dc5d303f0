#include "BoxedCall.h"

#include <c10/util/Exception.h>

namespace graphtrees {

BoxedCall::BoxedCall(std::shared_ptr<GraphedCallable> graphed) : graphed_(std::move(graphed)) {
  TORCH_CHECK_VALUE(graphed_ != nullptr, "graphtrees: BoxedCall needs a GraphedCallable");
}

py::object BoxedCall::call(const py::handle& inputs) const {
  TORCH_CHECK_TYPE(
      PyList_Check(inputs.ptr()),
      "graphtrees: a boxed graphed function takes its inputs as one list (AOTAutograd's "
      "boxed calling convention), got ",
      Py_TYPE(inputs.ptr())->tp_name);
  PyObject* list = inputs.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  PyObject* tuple = PyList_AsTuple(list);
  if (tuple == nullptr) throw py::error_already_set();
  auto args = py::reinterpret_steal<py::args>(tuple);
  // The callee owns the inputs now: the list lets go of them before the call, as AOTAutograd's
  // boxed functions do (an input it no longer needs can be freed during the call).
  if (PyList_SetSlice(list, 0, n, nullptr) != 0) throw py::error_already_set();
  return graphed_->call(args, py::kwargs());
}

}  // namespace graphtrees
