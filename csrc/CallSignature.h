#pragma once

// A call's arguments, flat, and its call key: every byte of the key is written here.

#include "ArgumentAliases.h"
#include "CallStats.h"
#include "KeyObjects.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace graphtrees {

namespace py = pybind11;

// Note [The call signature]
// Two calls of a wrapper have the same signature, and share one FunctionRecord (one recorded
// function of the tree), exactly when their keys are equal and their key objects match. The key
// is a byte string; its components, in the order they are written:
//   1. the structure of the arguments (flattenArgs): the number of positional arguments, then
//      per argument, depth first: 'T' a tensor (its metadata follows in 2), 'N' None, 't'/'F' a
//      bool, 'i' an int (its value; 'I' and its digits past 64 bits), 'f' a float (its bits),
//      's' a str (its bytes), '(' a tuple, 'n' a namedtuple (its type), '[' a list, '{' a dict
//      (with their lengths), 'P' a type registered with torch.utils._pytree or a dataclass (its
//      type, the hash of its context's repr, its children), 'G' a torch.Generator (by identity:
//      a recording registers that generator), 'o' any other object (its type and hash: the
//      object itself is held beside the key, Note [Objects in the call signature] in
//      KeyObjects.h); 'K' then the kwargs dict;
//   2. per argument tensor (FlatArgs::rekey, redone when buckets pad the batch): dtype, device,
//      requires_grad (only while grad mode is on), static or not (static_argnums), conjugate and
//      negative bits, sizes and strides;
//   3. the aliases among argument tensors, '=' the same tensor, '~' the same storage (Note
//      [Argument aliases] in ArgumentAliases.h);
//   4. with a module: 'R' or 'E' (training or eval), the number of its parameters and buffers
//      (their metadata is not keyed: they are used in place), and the arguments that are or
//      share memory with one of them, as in 3 (FlatArgs::addModule);
//   5. the call's state (FlatArgs::complete): 'A' and the dtype under autocast (Note [Autocast
//      and recordings] in AutocastState.h), 'D' and the default dtype when it is not float32,
//      'g' under grad mode;
//   6. '\x01' and a number for a variant: a call whose objects hash like a signature's but are
//      not its objects (GraphedCallable::signatureFor).
// Not in the key, because they are not the function's to see: the padding to a bucket (the key is
// the padded call's, Note [Buckets] in GraphedCallable.cpp) and the values in tensors. A call
// that cannot have a key (an argument type graphtrees cannot graph, no tensor, tensors on several
// devices or on neither CPU nor CUDA, an input that needs autograd) runs eagerly with the reason
// FlatArgs::complete gives.

// A call's tensors in order (its arguments', then a wrapped module's), and its key.
struct FlatArgs {
  std::vector<at::Tensor> tensors;
  std::vector<uint8_t> is_static;         // per tensor
  std::vector<at::Generator> generators;  // torch.Generator arguments, in order
  // The call key (Note [The call signature]).
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

  // Recomputes the key's tensor part (components 2 and 3) after the argument tensors changed
  // (bucket padding), without flattening the arguments again.
  void rekey();
  // Appends a module's parameters and buffers as static tensors, and component 4 to the key.
  void addModule(bool training, const std::vector<at::Tensor>& module_tensors,
                 const ModuleTensorIndex& index);

  enum class Verdict : uint8_t {
    kGraph,   // the key is complete: the call goes to its signature, on device()
    kEager,   // the call cannot be graphed: it runs eagerly, for the reason given
    kNested,  // the call is part of the caller's own capture (torch.cuda.graph): it runs as is
  };
  // Appends component 5, the state the call runs under, or says why the call cannot be graphed
  // (`why_eager`, of kind `why_kind`: Note [Reason kinds] in CallStats.h). Last of the key but a
  // variant.
  Verdict complete(std::string* why_eager);
  ReasonKind why_kind = ReasonKind::kOther;
  c10::Device device() const { return tensors[0].device(); }
};

// Flattens `args` and `kwargs` and writes components 1 to 3 of the key. Tensors inside positional
// argument i are static when `static_args[i]` is set.
void flattenArgs(py::handle args, py::handle kwargs, const std::vector<uint8_t>& static_args,
                 FlatArgs* out);

}  // namespace graphtrees
