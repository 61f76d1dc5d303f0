// The value engine's host work: snapshots of an op's arguments, and the host function that
// computes the op on CPU aliases of device memory (Note [Stand-in values] in values.cpp).

#include "values.h"

#include <sstream>

namespace standin_values {

namespace {

TensorDesc describe(const at::Tensor& t) {
  TensorDesc d;
  d.ptr = t.data_ptr();
  d.dtype = t.scalar_type();
  d.sizes = t.sizes().vec();
  d.strides = t.strides().vec();
  d.conj = t.is_conj();
  d.neg = t.is_neg();
  if (t.numel() > 0) {
    int64_t last = 0;
    for (size_t i = 0; i < d.sizes.size(); ++i) last += (d.sizes[i] - 1) * d.strides[i];
    d.extent = static_cast<size_t>(last + 1) * t.element_size();
  }
  return d;
}

// The CPU alias of a device tensor, or an undefined tensor if its memory is gone.
at::Tensor alias(const TensorDesc& d) {
  auto opts = at::TensorOptions().dtype(d.dtype).device(at::kCPU);
  if (d.extent == 0) return at::empty_strided(d.sizes, d.strides, opts);
  void* view = standin_host_view(d.ptr, d.extent);
  if (view == nullptr) return at::Tensor();
  at::Tensor t = at::from_blob(view, d.sizes, d.strides, opts);
  if (d.conj) t._set_conj(true);
  if (d.neg) t._set_neg(true);
  return t;
}

bool unknown(const TensorDesc& d) {
  return d.extent > 0 && standin_values_unknown(d.ptr, d.extent);
}

// Whether the view covers every byte of its span once (no gaps, no overlap).
bool dense(const TensorDesc& d) {
  int64_t n = 1;
  for (int64_t s : d.sizes) n *= s;
  return static_cast<size_t>(n) * c10::elementSize(d.dtype) == d.extent;
}

// Unknown: the whole span (erring towards unknown). Known: only a dense view's span; a strided
// view's gaps keep what they were, and so, conservatively, do its elements (found in review:
// fill_diagonal_ made a whole matrix known).
void mark(const TensorDesc& d, bool is_unknown) {
  if (d.extent == 0 || (!is_unknown && !dense(d))) return;
  standin_values_mark(d.ptr, d.extent, is_unknown ? 1 : 0);
}

c10::IValue byValue(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? c10::IValue(t.clone()) : v;
  }
  if (v.isDevice()) return c10::IValue(c10::Device(at::kCPU));
  return v;
}

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Reads an int64 of device memory through the stand-in's view.
bool readDevice(const int64_t* p, int64_t* out) {
  void* v = standin_host_view(p, sizeof(int64_t));
  if (v == nullptr) return false;
  std::memcpy(out, v, sizeof(int64_t));
  return true;
}

}  // namespace

bool isDevice(const at::Tensor& t) {
  return t.defined() && t.is_cuda() && t.layout() == at::kStrided;
}

Arg snapshotArg(const c10::IValue& v, bool written) {
  Arg a;
  a.written = written;
  if (v.isTensor() && isDevice(v.toTensor())) {
    a.kind = Arg::kDevice;
    a.tensors.push_back(describe(v.toTensor()));
    return a;
  }
  if (v.isTensorList()) {
    auto list = v.toTensorList();
    bool any = false;
    for (const at::Tensor& t : list) any = any || isDevice(t);
    if (any) {
      a.kind = Arg::kDeviceList;
      for (const at::Tensor& t : list) {
        a.present.push_back(isDevice(t));
        a.tensors.push_back(isDevice(t) ? describe(t) : TensorDesc());
        a.others.push_back(isDevice(t) ? c10::IValue() : byValue(c10::IValue(t)));
      }
      return a;
    }
  }
  if (v.isList() && !v.isTensorList()) {
    auto list = v.toList();
    if (list.elementType()->kind() == c10::TypeKind::OptionalType) {
      bool tensors = false;
      for (const c10::IValue& e : list) tensors = tensors || e.isTensor();
      if (tensors) {
        a.kind = Arg::kOptDeviceList;
        for (const c10::IValue& e : list) {
          const bool dev = e.isTensor() && isDevice(e.toTensor());
          a.present.push_back(dev);
          a.tensors.push_back(dev ? describe(e.toTensor()) : TensorDesc());
          a.others.push_back(dev ? c10::IValue() : byValue(e));
        }
        return a;
      }
    }
  }
  a.value = byValue(v);
  return a;
}

// Rebuilds an argument on the host; false if device memory it names is gone.
bool rebuild(const Arg& a, c10::IValue* out) {
  switch (a.kind) {
    case Arg::kValue:
      *out = a.value;
      return true;
    case Arg::kDevice: {
      at::Tensor t = alias(a.tensors[0]);
      if (!t.defined()) return false;
      *out = c10::IValue(t);
      return true;
    }
    case Arg::kDeviceList: {
      c10::List<at::Tensor> list;
      for (size_t i = 0; i < a.tensors.size(); ++i) {
        if (a.present[i]) {
          at::Tensor t = alias(a.tensors[i]);
          if (!t.defined()) return false;
          list.push_back(t);
        } else {
          list.push_back(a.others[i].toTensor());
        }
      }
      *out = c10::IValue(list);
      return true;
    }
    case Arg::kOptDeviceList: {
      c10::List<std::optional<at::Tensor>> list;
      for (size_t i = 0; i < a.tensors.size(); ++i) {
        if (a.present[i]) {
          at::Tensor t = alias(a.tensors[i]);
          if (!t.defined()) return false;
          list.push_back(t);
        } else if (a.others[i].isTensor()) {
          list.push_back(a.others[i].toTensor());
        } else {
          list.push_back(std::nullopt);
        }
      }
      *out = c10::IValue(list);
      return true;
    }
  }
  return false;
}

// The dispatch keys the host work must not see: it is below autograd, outside every mode.
c10::DispatchKeySet hostExcluded() {
  return c10::autograd_dispatch_keyset |
         c10::DispatchKeySet(
             {c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::Python,
              c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::PythonDispatcher,
              c10::DispatchKey::PreDispatch, c10::DispatchKey::Functionalize,
              c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA,
              c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
              c10::DispatchKey::FuncTorchDynamicLayerBackMode, c10::DispatchKey::FuncTorchBatched});
}

void report(const std::string& what) {
  standin_values_note(what.c_str());
  static std::mutex m;
  static std::set<std::string> said;
  std::lock_guard<std::mutex> g(m);
  if (said.insert(what).second && std::getenv("CUDA_STANDIN_QUIET") == nullptr) {
    std::fprintf(stderr, "[cuda stand-in] value mode: %s\n", what.c_str());
  }
}

void CUDART_CB hostFunction(void* p) {
  auto* w = static_cast<HostWork*>(p);
  w->run();
  if (!w->persistent) delete w;
}

void CUDART_CB freeWork(void* p) {
  delete static_cast<HostWork*>(p);
}

void HostWork::run() {
  std::vector<size_t> mismatched;  // outputs the host kernel sized differently: unknown
  // Whether anything read is unknown: then so is everything written.
  bool in_unknown = false;
  for (size_t k = 0; k < args.size(); ++k) {
    const Arg& a = args[k];
    if (a.written && (info->overwrites || info->is_out[k])) continue;  // not read
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      if ((a.kind == Arg::kDevice || a.present[i]) && unknown(a.tensors[i])) in_unknown = true;
    }
  }
  auto markWritten = [&](bool u) {
    for (const Arg& a : args) {
      if (!a.written) continue;
      for (size_t i = 0; i < a.tensors.size(); ++i) {
        if (a.kind == Arg::kDevice || a.present[i]) mark(a.tensors[i], u);
      }
    }
    for (const Arg& o : outs) {
      for (size_t i = 0; i < o.tensors.size(); ++i) {
        if (o.kind == Arg::kDevice || o.present[i]) mark(o.tensors[i], u);
      }
    }
  };
  if (info->mode == OpInfo::kNoHost) {
    markWritten(true);
    return;
  }
  try {
    c10::impl::ExcludeDispatchKeyGuard no_modes(hostExcluded());
    at::DisableRecordFunctionGuard no_observers;
    at::NoGradGuard no_grad;
    torch::jit::Stack stack;
    stack.reserve(args.size());
    for (const Arg& a : args) {
      c10::IValue v;
      if (!rebuild(a, &v)) {
        report(info->name + ": its device memory was freed before its host work ran");
        markWritten(true);
        return;
      }
      stack.push_back(std::move(v));
    }
    if (rng) {
      uint64_t s = seed, o = offset;
      if (captured_rng) {
        int64_t sv = 0, ov = 0;
        if (!readDevice(seed_ptr, &sv) || !readDevice(offset_ptr, &ov)) {
          report(info->name + ": the generator's graph-safe seed and offset are not readable");
          markWritten(true);
          return;
        }
        s = static_cast<uint64_t>(sv);
        o = static_cast<uint64_t>(ov) + offset_intragraph;
      }
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(mix(s ^ mix(o)));
      if (rng_arg >= 0) stack[rng_arg] = c10::IValue(gen);
      if (info->name == "aten::native_dropout") {
        // native_dropout(input, p, train?) draws from the default generator: the same on the host.
        const at::Tensor input = stack[0].toTensor();
        const double p = stack[1].toDouble();
        at::Tensor mask = at::empty_like(input, at::kBool);
        at::Tensor out;
        if (stack[2].isNone() || stack[2].toBool()) {
          mask.bernoulli_(1 - p, gen);
          out = p >= 1 ? at::zeros_like(input) : input * mask * (1.0 / (1 - p));
        } else {
          mask.fill_(true);
          out = input.clone();
        }
        stack = {c10::IValue(out), c10::IValue(mask)};
      }
    }
    // histc has no CPU kernel for integers (CUDA's has: MoE routing counts expert indices with
    // it): the host counts their values as doubles (non-negative integers bin alike), and the
    // copy into the device output converts back.
    if (info->name == "aten::histc" && stack[0].isTensor() &&
        at::isIntegralType(stack[0].toTensor().scalar_type(), /*includeBool=*/false)) {
      stack[0] = stack[0].toTensor().to(at::kDouble);
    }
    if (!(rng && info->name == "aten::native_dropout")) {
      info->op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &stack);
    }
    // New results into the device outputs; in-place results are the aliases themselves.
    for (size_t i = 0; i < outs.size() && i < stack.size(); ++i) {
      const Arg& o = outs[i];
      if (o.kind == Arg::kDevice) {
        const at::Tensor& r = stack[i].toTensor();
        at::Tensor dst = alias(o.tensors[0]);
        if (!dst.defined()) continue;
        if (r.data_ptr() == dst.data_ptr() && r.sizes() == dst.sizes()) continue;
        if (r.sizes() != dst.sizes()) {
          // An auxiliary output the two backends size differently (batch norm's saved
          // statistics in eval, log_sigmoid's buffer): that one is unknown, the rest computed.
          std::ostringstream why;
          why << info->name << ": output " << i << " has sizes " << r.sizes() << " on the host, "
              << dst.sizes() << " from the CUDA kernel: it is unknown";
          report(why.str());
          mismatched.push_back(i);
          continue;
        }
        dst.copy_(r);
      } else if (o.kind == Arg::kDeviceList) {
        auto rl = stack[i].toTensorList();
        for (size_t j = 0; j < o.tensors.size() && j < rl.size(); ++j) {
          if (!o.present[j]) continue;
          const at::Tensor r = rl[j];
          at::Tensor dst = alias(o.tensors[j]);
          if (!dst.defined() || r.data_ptr() == dst.data_ptr()) continue;
          dst.copy_(r);
        }
      }
    }
  } catch (const std::exception& e) {
    std::string msg = e.what();
    const auto nl = msg.find('\n');
    if (nl != std::string::npos) msg.resize(nl);
    report("no host result for " + info->name + ": " + msg + " (its outputs are unknown)");
    markWritten(true);
    return;
  }
  markWritten(in_unknown);
  for (size_t i : mismatched) {
    for (const TensorDesc& d : outs[i].tensors) mark(d, true);
  }
}

}  // namespace standin_values
