#pragma once

// Flattening of Python arguments and results, in C++ so that the per-call cost stays small.
//
// Arguments: tensors (torch.Tensor and nn.Parameter, also inside tuples, lists, namedtuples and
// dicts) are collected in order; everything else is part of the call signature, encoded as bytes
// together with each tensor's shape, strides, dtype, device and requires_grad. Equal signatures
// mean the same recorded function.
//
// Results: tensors, None, Python scalars and strings, in tuples, lists, namedtuples and dicts.
//
// Other containers, in arguments and results: any type registered with torch.utils._pytree
// (transformers' ModelOutput, for instance) and dataclasses are taken apart and rebuilt through
// the Python layer's hooks (setPyTreeHooks), one level at a time; the plain containers above keep
// the fast C++ path.

#include "ArgumentAliases.h"
#include "KeyObjects.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

namespace graphtrees {

namespace py = pybind11;

// `flatten(obj)` returns None, or a (children, context) pair for one level of obj;
// `unflatten(type, context, children)` rebuilds it. Installed by the bindings.
void setPyTreeHooks(py::object flatten, py::object unflatten);

struct FlatArgs {
  std::vector<at::Tensor> tensors;
  std::vector<uint8_t> is_static;         // per tensor
  std::vector<at::Generator> generators;  // torch.Generator arguments, in order
  // The call signature: the structure bytes (containers, non-tensor values, a 'T' per tensor),
  // then each argument tensor's metadata. Whoever appends to it afterwards (the wrapper's module
  // tensors and autocast state) does so after rekey().
  std::string key;
  std::string unsupported;  // why the arguments cannot be graphed, if they cannot
  // The device of the tensor argument that made them unsupported (its tree counts the fallback).
  std::optional<c10::Device> unsupported_device;
  size_t structure_bytes = 0;
  size_t keyed_tensors = 0;  // the argument tensors (the first ones of `tensors`)
  // Other argument objects, keyed by their hash only (Note [Objects in the call signature]);
  // owned, since a pytree node's children may be made by its flatten function.
  std::vector<py::object> key_objects;
  // Which tensors are the same or share memory (Note [Argument aliases]): made with the key.
  ArgumentAliases aliases;

  // Recomputes the key's tensor part after the argument tensors changed (bucket padding), without
  // flattening the arguments again.
  void rekey();
};

// Flattens `args` and `kwargs`. Tensors inside positional argument i are static when
// `static_args[i]` is set.
void flattenArgs(py::handle args, py::handle kwargs, const std::vector<uint8_t>& static_args,
                 FlatArgs* out);

// Rebuilds (args, kwargs) with the tensors replaced, in the order flattenArgs() found them.
std::pair<py::tuple, py::dict> rebuildArgs(py::handle args, py::handle kwargs,
                                           const std::vector<at::Tensor>& tensors);

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
