#include "CallSignature.h"

#include "AutocastState.h"
#include "BackendFactory.h"
#include "PyTree.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DefaultDtype.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/python_variable.h>

#include <functional>

namespace graphtrees {

namespace {

template <typename T>
void appendRaw(std::string* key, const T& v) {
  key->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void appendTensorKey(std::string* key, const at::Tensor& t, bool is_static) {
  appendRaw(key, static_cast<int8_t>(t.scalar_type()));
  appendRaw(key, static_cast<int8_t>(t.device().type()));
  appendRaw(key, static_cast<int8_t>(t.device().index()));
  // requires_grad only changes what a call does while grad mode is on (under no_grad and in
  // AOTAutograd's forward/backward graphs it does not), so it is keyed only then.
  key->push_back(t.requires_grad() && at::GradMode::is_enabled() ? 1 : 0);
  key->push_back(static_cast<char>(is_static));
  // A conjugate or negative view reads its bytes another way (Note in TensorMeta).
  key->push_back(static_cast<char>((t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0)));
  appendRaw(key, static_cast<int16_t>(t.dim()));
  for (int64_t s : t.sizes()) appendRaw(key, s);
  for (int64_t s : t.strides()) appendRaw(key, s);
}

// Component 3 (and 4's): the alias pairs from `same`'s and `storage`'s pair on.
void appendAliasKey(std::string* key, const ArgumentAliases& aliases, size_t same, size_t storage) {
  const auto append = [key](char tag, const ArgumentAliases::Pairs& pairs, size_t from) {
    for (size_t p = from; p < pairs.size(); ++p) {
      key->push_back(tag);
      appendRaw(key, pairs[p].first);
      appendRaw(key, pairs[p].second);
    }
  };
  append('=', aliases.samePairs(), same);
  append('~', aliases.storagePairs(), storage);
}

void flattenArg(PyObject* obj, bool is_static, int depth, FlatArgs* out) {
  if (!out->unsupported.empty()) return;
  std::string* key = &out->key;
  if (depth > kMaxPyTreeDepth) {
    out->unsupported =
        "arguments nested deeper than " + std::to_string(kMaxPyTreeDepth) + " levels";
    return;
  }
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!THPVariable_CheckExact(obj)) {
      out->unsupported = "an argument of tensor subclass type '" + typeName(obj) + "'";
      out->unsupported_device = t.device();
      return;
    }
    if (t.is_nested()) {
      out->unsupported =
          "a nested tensor argument (only strided tensors with storage can be "
          "graphed)";
      out->unsupported_device = t.device();
      return;
    }
    if (t.is_quantized()) {
      out->unsupported =
          "a quantized tensor argument (its scale and zero point live outside its "
          "storage, so a graph cannot take it as an input)";
      out->unsupported_device = t.device();
      return;
    }
    if (t._is_zerotensor()) {
      out->unsupported = "an efficient zero tensor argument (autograd's ZeroTensor has no memory)";
      out->unsupported_device = t.device();
      return;
    }
    if (t.layout() != c10::kStrided || !t.has_storage()) {
      out->unsupported_device = t.device();
      out->unsupported = "a tensor argument with layout " + c10::str(t.layout()) +
                         " (only strided tensors with storage can be graphed)";
      return;
    }
    key->push_back('T');  // its metadata follows the structure (FlatArgs::rekey())
    out->tensors.push_back(t);
    out->is_static.push_back(is_static ? 1 : 0);
  } else if (obj == Py_None) {
    key->push_back('N');
  } else if (PyBool_Check(obj)) {
    key->push_back(obj == Py_True ? 't' : 'F');
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) {
      key->push_back('I');
      const std::string s = py::str(obj);
      appendRaw(key, static_cast<uint32_t>(s.size()));
      key->append(s);
    } else {
      key->push_back('i');
      appendRaw(key, static_cast<int64_t>(v));
    }
  } else if (PyFloat_CheckExact(obj)) {
    key->push_back('f');
    appendRaw(key, PyFloat_AS_DOUBLE(obj));
  } else if (PyUnicode_CheckExact(obj)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == nullptr) throw py::error_already_set();
    key->push_back('s');
    appendRaw(key, static_cast<uint32_t>(n));
    key->append(s, static_cast<size_t>(n));
  } else if (PyTuple_CheckExact(obj) || isNamedTuple(obj)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(obj);
    key->push_back(PyTuple_CheckExact(obj) ? '(' : 'n');
    if (!PyTuple_CheckExact(obj)) appendRaw(key, reinterpret_cast<uintptr_t>(Py_TYPE(obj)));
    appendRaw(key, static_cast<uint32_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i)
      flattenArg(PyTuple_GET_ITEM(obj, i), is_static, depth + 1, out);
  } else if (PyList_CheckExact(obj)) {
    const Py_ssize_t n = PyList_GET_SIZE(obj);
    key->push_back('[');
    appendRaw(key, static_cast<uint32_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i)
      flattenArg(PyList_GET_ITEM(obj, i), is_static, depth + 1, out);
  } else if (PyDict_CheckExact(obj)) {
    key->push_back('{');
    appendRaw(key, static_cast<uint32_t>(PyDict_GET_SIZE(obj)));
    PyObject* k = nullptr;
    PyObject* v = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(obj, &pos, &k, &v)) {
      if (THPVariable_Check(k)) {
        out->unsupported = "a dict argument with tensor keys";
        return;
      }
      flattenArg(k, is_static, depth + 1, out);
      flattenArg(v, is_static, depth + 1, out);
    }
  } else if (py::object node = flattenNode(obj); !node.is_none()) {
    // A pytree-registered type or a dataclass: its type, context and children are the key.
    key->push_back('P');
    appendRaw(key, reinterpret_cast<uintptr_t>(Py_TYPE(obj)));
    py::tuple pair = node;
    const Py_hash_t h = PyObject_Hash(py::repr(pair[1]).ptr());
    if (h == -1) throw py::error_already_set();
    appendRaw(key, static_cast<int64_t>(h));
    py::list children = pair[0];
    appendRaw(key, static_cast<uint32_t>(children.size()));
    for (py::handle child : children) flattenArg(child.ptr(), is_static, depth + 1, out);
  } else if (THPGenerator_Check(obj) == 1) {
    // By identity: a recording registers this very generator (FunctionRecord::generators), and
    // the signature's record holds its implementation, whose address is the key: no other
    // generator can take that address while the signature lives.
    const at::Generator& gen = reinterpret_cast<THPGenerator*>(obj)->cdata;
    key->push_back('G');
    appendRaw(key, reinterpret_cast<uintptr_t>(gen.unsafeGetGeneratorImpl()));
    out->generators.push_back(gen);
  } else {
    // A float or complex (numpy's float64 and complex128 too) or a numpy floating or complex
    // scalar hashes by its bytes (valueBits): hash() makes 0.0 and -0.0 one value and gives a
    // NaN its address.
    std::string bits;
    const Py_hash_t h =
        valueBits(obj, &bits)
            ? static_cast<Py_hash_t>(std::hash<std::string>()(bits) & 0x3fffffffffffffff)
            : PyObject_Hash(obj);
    if (h == -1) {
      PyErr_Clear();
      out->unsupported = "an argument of unhashable type '" + typeName(obj) +
                         "' (its value cannot be part of the call signature)";
      return;
    }
    key->push_back('o');
    appendRaw(key, reinterpret_cast<uintptr_t>(Py_TYPE(obj)));
    appendRaw(key, static_cast<int64_t>(h));
    // Held beside the key: Note [Objects in the call signature] in KeyObjects.h.
    out->key_objects.push_back(py::reinterpret_borrow<py::object>(obj));
  }
}

}  // namespace

void flattenArgs(py::handle args, py::handle kwargs, const std::vector<uint8_t>& static_args,
                 FlatArgs* out) {
  PyObject* a = args.ptr();
  const Py_ssize_t n = PyTuple_GET_SIZE(a);
  out->key.reserve(64);
  appendRaw(&out->key, static_cast<uint32_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const bool is_static = static_cast<size_t>(i) < static_args.size() && static_args[i];
    flattenArg(PyTuple_GET_ITEM(a, i), is_static, 0, out);
  }
  if (kwargs.ptr() != nullptr && kwargs.ptr() != Py_None && PyDict_GET_SIZE(kwargs.ptr()) > 0) {
    out->key.push_back('K');
    flattenArg(kwargs.ptr(), false, 0, out);
  }
  out->structure_bytes = out->key.size();
  out->keyed_tensors = out->tensors.size();
  out->rekey();
}

void FlatArgs::rekey() {
  key.resize(structure_bytes);
  key.reserve(structure_bytes + keyed_tensors * 40);
  for (size_t i = 0; i < keyed_tensors; ++i) appendTensorKey(&key, tensors[i], is_static[i] != 0);
  // Which arguments are one tensor or share memory is part of the signature (Note [Argument
  // aliases] in ArgumentAliases.h).
  aliases.compute(tensors, keyed_tensors);
  appendAliasKey(&key, aliases, 0, 0);
}

void FlatArgs::addModule(bool training, const std::vector<at::Tensor>& module_tensors,
                         const ModuleTensorIndex& index) {
  key.push_back(training ? 'R' : 'E');
  appendRaw(&key, static_cast<uint32_t>(module_tensors.size()));
  const size_t keyed = tensors.size();
  for (const auto& t : module_tensors) {
    tensors.push_back(t);
    is_static.push_back(1);
  }
  // An argument that is one of the module's tensors (model(x, model.buf)) is that tensor.
  const size_t same = aliases.samePairs().size();
  const size_t storage = aliases.storagePairs().size();
  aliases.addModuleTensors(tensors, keyed, index);
  appendAliasKey(&key, aliases, same, storage);
}

FlatArgs::Verdict FlatArgs::complete(std::string* why_eager) {
  if (!unsupported.empty()) {
    *why_eager = "it was called with " + unsupported;
    why_kind = ReasonKind::kArguments;
    return Verdict::kEager;
  }
  if (tensors.empty()) {
    *why_eager = "it has no tensor arguments to tell its device";
    why_kind = ReasonKind::kArguments;
    return Verdict::kEager;
  }
  const c10::Device device = tensors[0].device();
  if (!device.is_cpu() && !device.is_cuda()) {
    *why_eager = "its tensors are on the " + device.str() +
                 " device; graphtrees records functions on CPU and CUDA tensors";
    why_kind = ReasonKind::kDevice;
    return Verdict::kEager;
  }
  // Inside the caller's own capture (torch.cuda.graph): part of it, like a nested call.
  if (callerIsCapturing(device)) return Verdict::kNested;
  // Autocast changes what the function computes: a recording made under it is another function
  // (Note [Autocast and recordings] in AutocastState.h).
  if (at::autocast::is_autocast_enabled(device.type())) {
    key.push_back('A');
    key.push_back(static_cast<char>(at::autocast::get_autocast_dtype(device.type())));
  }
  // torch.set_default_dtype() changes what factory calls inside the function make: another
  // recording, as autocast is.
  if (const auto d = c10::typeMetaToScalarType(c10::get_default_dtype());
      d != c10::ScalarType::Float) {
    key.push_back('D');
    key.push_back(static_cast<char>(d));
  }
  const bool grad = at::GradMode::is_enabled();
  // Grad mode changes what a function that reaches tensors requiring grad computes (a closure's
  // parameters): another signature.
  if (grad) key.push_back('g');
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.device() != device) {
      *why_eager = "its tensors are on several devices (" + device.str() + " and " +
                   t.device().str() + "); a graph runs on one device";
      why_kind = ReasonKind::kDevice;
      return Verdict::kEager;
    }
    if (grad && t.requires_grad()) {
      *why_eager = std::string("it needs autograd: grad mode is on and ") +
                   (is_static[i] ? "a parameter or static input" : "an input") +
                   " requires grad. Call it under torch.no_grad() or torch.inference_mode() to "
                   "graph it";
      why_kind = ReasonKind::kAutograd;
      return Verdict::kEager;
    }
  }
  return Verdict::kGraph;
}

}  // namespace graphtrees
