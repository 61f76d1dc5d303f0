#pragma once

// The structure of a callable's results: tensors, None, Python scalars and strings, in tuples,
// lists, namedtuples and dicts, and the containers PyTree.h takes apart through the Python
// layer's hooks.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <vector>

namespace graphtrees {

namespace py = pybind11;

// The structure of a callable's result.
class OutputSpec {
 public:
  // Flattens `result`; throws a TypeError naming the offending type for unsupported results.
  // `call_args` and `call_kwargs` are the call's own arguments: a value of a type graphtrees
  // cannot rebuild that is one of them (a transformers cache passed in and returned) is the
  // caller's own object, and the result holds that argument of each later call, as it is.
  static OutputSpec flatten(py::handle result, std::vector<at::Tensor>* tensors,
                            const std::string& function_name, py::handle call_args = py::handle(),
                            py::handle call_kwargs = py::handle());
  py::object unflatten(const std::vector<at::Tensor>& tensors, py::handle call_args = py::handle(),
                       py::handle call_kwargs = py::handle()) const;
  // Same structure and equal non-tensor values.
  bool sameAs(const OutputSpec& other) const;
  std::string describe() const;

 private:
  enum class Kind : uint8_t {
    kTensor,
    kConstant,
    kTuple,
    kList,
    kDict,
    kNamedTuple,
    kNode,
    kArgument  // the call's own argument: value is its position (int) or keyword (str)
  };
  struct Entry {
    Kind kind;
    int64_t count = 0;  // children that follow (containers)
    py::object value;   // constant value, dict keys (tuple), namedtuple type, (type, context)
  };
  void flattenInto(py::handle obj, std::vector<at::Tensor>* tensors, const std::string& name,
                   int depth);
  py::object build(size_t* pos, const std::vector<at::Tensor>& tensors, size_t* next,
                   py::handle call_args, py::handle call_kwargs) const;
  // The entry naming `obj` as one of the call's arguments, if it is one.
  bool flattenArgument(PyObject* obj);
  std::vector<Entry> entries_;          // pre-order
  py::handle call_args_, call_kwargs_;  // only while flatten() runs
};

}  // namespace graphtrees
