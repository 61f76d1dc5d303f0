// The CUDA stand-in's value engine: every aten op on stand-in CUDA tensors computes its result on
// the host, in stream order, as part of the stand-in (a test tool: nothing of it ships). The host
// work itself is in values_host.cpp.

#include "values.h"

// Note [Stand-in values]
// The stand-in never runs a kernel; the value engine (this file, its own .so, loaded into every
// process that runs on the stand-in unless CUDA_STANDIN_VALUES=0: standin.py and README.md) makes
// every aten op on stand-in CUDA tensors compute its values anyway, on the host, where the GPU
// would compute them in stream order:
//   - It overrides, on the CUDA dispatch key (torch::Library IMPL, one boxed functor per op), every
//     aten op that has its own CUDA kernel, plus copy_ (whose device work is a DispatchStub). Not
//     a TorchDispatchMode: dynamo compiles nothing under one, and torch code that disables modes
//     (tensor printing) would silently run value-less kernels. Views, inplace_view ops, empty*,
//     set_, resize_ and the like launch nothing and are not overridden.
//   - Each functor first calls the op's original CUDA kernel (kept from
//     getComputedKernelForDispatchKey), so allocations, workspaces, launches, cuBLAS calls and
//     generator increments are exactly a GPU run's. Then it snapshots the arguments (a device
//     tensor as pointer, dtype, sizes, strides; a CPU tensor as a private copy; anything else by
//     value: no reference to a caller's tensor is kept) and enqueues a host function
//     (cudaLaunchHostFunc) on the current stream. That host function makes CPU tensors aliasing
//     the device bytes (at::from_blob over standin_host_view, the stand-in's private mapping: the
//     device addresses stay PROT_NONE, so code under test still faults on them) and redispatches
//     the op to its CPU kernel, writing mutated arguments in place and copying new results into
//     the device outputs. Eagerly it runs at once (or when the host waits, in deferred mode);
//     inside a capture it is attached to the last node the op captured (its kernel, copy or
//     memset: standin_values_attach), so it sits wherever that kernel sits (a conditional body
//     takes no host node) and every replay recomputes from whatever the memory holds then; only
//     an op that captured no node of its own on the stream gets a host node instead. The
//     stand-in runs host functions without its lock, as a driver does on its own thread.
//   - Ops nested inside an overridden op (a CUDA kernel calling other ops) compute nothing: the
//     outermost computes the whole op on the host (a thread-local depth).
//   - Data-dependent ops (nonzero, masked_select, unique*, index with a boolean index, ...) are
//     computed first: the stream is synchronised (which a capture refuses, as on a GPU), the CPU
//     kernel runs on aliases, and the results are copied into fresh device tensors. A
//     device-to-host copy made while an op computes is refused by the stand-in naming the op:
//     its CUDA kernel reads values the engine has not computed yet (add it to the table).
//   - Random numbers: the original kernel advances the CUDA generator exactly as on a GPU; the
//     engine takes the philox (seed, offset) the kernel was given (philox_cuda_state(0) just
//     before it; in a capture, device pointers to seed and offset that each replay's prologue
//     writes, read through host views when the host node runs) and runs the CPU kernel with a
//     CPU generator seeded from that pair. So replay k draws what eager call k draws from the
//     same seed, each replay draws anew, and manual_seed reproduces; the bits are not a GPU's.
//   - Unknown values: a kernel launched while no engine op computes it (Triton, a user's
//     load_inline kernel, a cuBLAS call outside the dispatcher) marks, when it runs, the device
//     memory its pointer arguments point into as unknown (standin_values_unknown); an op with no
//     host kernel marks its outputs unknown; an op reading unknown bytes makes its outputs
//     unknown; a computed op or a copy from known bytes makes them known again.
// What it is not: a GPU. Kernels' own bugs, numerics (CPU reduction orders, no TF32), timing and
// concurrency between streams are the host's. README.md, "The value mode", says more.

namespace standin_values {

namespace {

bool enabledByEnv() {
  const char* v = std::getenv("CUDA_STANDIN_VALUES");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

thread_local int depth = 0;  // overridden ops on this thread's stack

struct Depth {
  explicit Depth(const char* name) {
    depth++;
    standin_values_enter(name);
  }
  ~Depth() {
    standin_values_exit();
    depth--;
  }
};

}  // namespace

namespace {

std::vector<bool> writtenArgs(const c10::FunctionSchema& s) {
  std::vector<bool> w;
  for (const auto& a : s.arguments())
    w.push_back(a.alias_info() != nullptr && a.alias_info()->isWrite());
  return w;
}

// Which ops are data-dependent: their output's shape or their kernel reads device values.
bool computeFirst(const c10::OperatorName& n) {
  // Whole ops (every overload): their output's shape depends on values, or their CUDA kernel
  // reads device values back (found by the detector: a device-to-host copy while they compute).
  static const std::set<std::string> names = {"aten::nonzero",
                                              "aten::masked_select",
                                              "aten::unique_consecutive",
                                              "aten::unique_dim",
                                              "aten::_unique",
                                              "aten::_unique2",
                                              "aten::unique_dim_consecutive",
                                              "aten::bincount",
                                              "aten::equal",
                                              "aten::isin",
                                              "aten::linalg_matrix_exp",
                                              "aten::linalg_eig",
                                              "aten::segment_reduce",
                                              "aten::_to_sparse",
                                              "aten::_to_sparse_csr",
                                              "aten::_to_sparse_csc",
                                              "aten::_to_sparse_bsr",
                                              "aten::_to_sparse_bsc",
                                              "aten::nonzero_numpy",
                                              "aten::_grouped_mm"};
  // Single overloads: a 0-dim device tensor as the value, read with item().
  static const std::set<std::string> overloads = {"aten::masked_fill_.Tensor",
                                                  "aten::index_fill_.int_Tensor"};
  return names.count(n.name) > 0 || overloads.count(n.name + "." + n.overload_name) > 0;
}

bool skipped(const std::string& n) {
  static const std::set<std::string> names = {"aten::set_",
                                              "aten::resize_",
                                              "aten::resize_as_",
                                              "aten::record_stream",
                                              "aten::_local_scalar_dense",
                                              "aten::is_pinned",
                                              "aten::_pin_memory",
                                              "aten::is_set_to",
                                              "aten::_assert_async",
                                              "aten::_assert_scalar",
                                              "aten::_functional_assert_async",
                                              "aten::_print",
                                              "aten::_cudnn_rnn_flatten_weight",
                                              "aten::_use_cudnn_ctc_loss",
                                              "aten::_nested_tensor_from_mask_left_aligned",
                                              "aten::lift_fresh",
                                              "aten::_make_per_tensor_quantized_tensor",
                                              "aten::_make_per_channel_quantized_tensor",
                                              "aten::_fused_sdp_choice",
                                              "aten::_copy_from_and_resize",
                                              "aten::_copy_from",
                                              "aten::_debug_has_internal_overlap",
                                              "aten::_has_same_storage_numel",
                                              "aten::_efficientzerotensor",
                                              "aten::_cufft_get_plan_cache_size"};
  if (names.count(n)) return true;
  return n.rfind("aten::empty", 0) == 0 || n.rfind("aten::new_empty", 0) == 0 ||
         n.rfind("aten::_empty", 0) == 0;
}

bool isView(const c10::FunctionSchema& s) {
  for (const auto& r : s.returns()) {
    if (r.alias_info() != nullptr && !r.alias_info()->isWrite()) return true;
  }
  return false;
}

// The op's CUDA kernel before the override (torch.library.get_kernel's C++ side).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
using Original = c10::SafeKernelFunction;
Original originalKernel(const c10::OperatorHandle& op) {
  return op.getComputedKernelForDispatchKey(c10::DispatchKey::CUDA);
}
#else
#error "the value engine needs torch >= 2.9 (c10::SafeKernelFunction)"
#endif

bool hasCpuKernel(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
         op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
         op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
         op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
}

at::CUDAGeneratorImpl* cudaGenerator(const OpInfo& info, const torch::jit::Stack& stack,
                                     size_t base) {
  if (info.generator_arg >= 0) {
    const c10::IValue& g = stack[base + info.generator_arg];
    if (g.isGenerator()) {
      at::Generator gen = g.toGenerator();
      if (gen.device().is_cuda()) return at::check_generator<at::CUDAGeneratorImpl>(gen);
    }
  }
  return at::check_generator<at::CUDAGeneratorImpl>(at::cuda::detail::getDefaultCUDAGenerator());
}

}  // namespace

// ---- the functor --------------------------------------------------------------------------------

class ValueKernel final : public c10::OperatorKernel {
 public:
  ValueKernel(std::shared_ptr<OpInfo> info, Original original)
      : info_(std::move(info)), original_(std::move(original)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    if (depth > 0 || info_->mode == OpInfo::kPassThrough) {
      original_.callBoxed(op, ks, stack);
      return;
    }
    const auto& schema = op.schema();
    const size_t nargs = schema.arguments().size();
    const size_t base = stack->size() - nargs;
    if (info_->mode == OpInfo::kCopy) {
      const c10::IValue& self = (*stack)[base];
      const c10::IValue& src = (*stack)[base + 1];
      if (!(self.isTensor() && isDevice(self.toTensor()) && src.isTensor() &&
            isDevice(src.toTensor()))) {
        original_.callBoxed(op, ks, stack);  // a memcpy, and nested device copy_ calls
        return;
      }
    }
    if (info_->mode == OpInfo::kComputeFirst ||
        (info_->mode == OpInfo::kMaybeFirst && dataDependent(*info_, *stack, base))) {
      computeFirst(ks, stack);
      return;
    }
    // The arguments as they are after the kernel (an out= argument it resized), held only here.
    std::vector<c10::IValue> held(stack->begin() + base, stack->end());
    auto work = std::make_unique<HostWork>();
    work->info = info_.get();
    const bool rng = info_->seeded || info_->generator_arg >= 0;
    at::CUDAGeneratorImpl* gen = nullptr;
    if (rng) {
      gen = cudaGenerator(*info_, *stack, base);
      std::lock_guard<std::mutex> lock(gen->mutex_);
      // The state the kernel is about to take (increment 0 draws nothing).
      at::PhiloxCudaState st = gen->philox_cuda_state(0);
      work->rng = true;
      work->rng_arg = info_->generator_arg;
      work->captured_rng = st.captured_;
      if (st.captured_) {
        work->seed_ptr = st.seed_.ptr;
        work->offset_ptr = st.offset_.ptr;
        work->offset_intragraph = st.offset_intragraph_;
      } else {
        work->seed = st.seed_.val;
        work->offset = st.offset_.val;
      }
    }
    {
      Depth d(info_->name.c_str());
      original_.callBoxed(op, ks, stack);
    }
    if (rng && info_->generator_arg < 0 && info_->name != "aten::native_dropout") {
      // The CPU kernel would draw from the CPU default generator: nothing to give it ours.
      report(info_->name +
             " draws from the default generator, which its host kernel cannot be "
             "given: its outputs are unknown");
      work->info = info_->no_host.get();
      work->rng = false;
      const size_t nret = schema.returns().size();
      for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
        work->outs.push_back(snapshotArg((*stack)[i], true));
      }
      enqueue(std::move(work));
      return;
    }
    for (size_t i = 0; i < nargs; ++i)
      work->args.push_back(snapshotArg(held[i], info_->written[i]));
    held.clear();
    const size_t nret = schema.returns().size();
    for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
      Arg o = snapshotArg((*stack)[i], true);
      if (o.kind == Arg::kValue) o.value = c10::IValue();
      work->outs.push_back(std::move(o));
    }
    enqueue(std::move(work));
  }

 private:
  void enqueue(std::unique_ptr<HostWork> work) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    HostWork* w = work.release();
    const cudaError_t e =
        standin_submit_host_work(stream, hostFunction, w, freeWork, &w->persistent);
    if (e != cudaSuccess) {
      if (!w->persistent) delete w;
      C10_CUDA_CHECK(e);
    }
  }

  static bool dataDependent(const OpInfo& info, const torch::jit::Stack& stack, size_t base) {
    // histc(self, bins, min, max): its CUDA kernel reads the input's range back when min == max.
    if (info.name.rfind("aten::histc", 0) == 0) {
      return stack.size() - base >= 4 && stack[base + 2].isScalar() && stack[base + 3].isScalar() &&
             stack[base + 2].toScalar().toDouble() == stack[base + 3].toScalar().toDouble();
    }
    for (size_t i = base; i < stack.size(); ++i) {
      const c10::IValue& v = stack[i];
      if (v.isList() && !v.isTensorList()) {  // index's Tensor?[] indices
        for (const c10::IValue& e : v.toList()) {
          if (e.isTensor() && e.toTensor().defined() &&
              (e.toTensor().scalar_type() == at::kBool || e.toTensor().scalar_type() == at::kByte))
            return true;
        }
      }
    }
    // repeat_interleave.Tensor(repeats, *, output_size=None): its last argument.
    return stack.size() - base == 2 && stack.back().isNone();
  }

  // Data-dependent: sync, compute on the host, copy into fresh device tensors.
  void computeFirst(c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const auto& schema = info_->op.schema();
    const size_t nargs = schema.arguments().size();
    const size_t base = stack->size() - nargs;
    std::vector<c10::IValue> dev(stack->begin() + base, stack->end());
    c10::Device device(at::kCUDA, 0);
    for (const auto& v : dev) {
      if (v.isTensor() && isDevice(v.toTensor())) device = v.toTensor().device();
    }
    if (std::getenv("CUDA_STANDIN_VALUES_DEBUG") != nullptr) {
      std::fprintf(stderr, "[values] computed first: %s\n", info_->name.c_str());
    }
    // As the GPU's kernel does: wait for the values (refused inside a capture).
    C10_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream().stream()));
    torch::jit::Stack host;
    std::vector<int> outs_at;
    std::vector<std::pair<const void*, size_t>> aliases;  // host data of a device arg -> its index
    std::vector<Arg> snapped;
    bool in_unknown = false;  // anything read unknown: so is everything written (found in review)
    for (size_t i = 0; i < nargs; ++i) {
      snapped.push_back(snapshotArg(dev[i], info_->written[i]));
      const Arg& a = snapped.back();
      if (info_->is_out[i]) continue;
      for (size_t j = 0; j < a.tensors.size(); ++j) {
        const TensorDesc& d = a.tensors[j];
        if ((a.kind == Arg::kDevice || (j < a.present.size() && a.present[j])) && d.extent > 0 &&
            standin_values_unknown(d.ptr, d.extent)) {
          in_unknown = true;
        }
      }
    }
    for (size_t i = 0; i < nargs; ++i) {
      const Arg& a = snapped[i];
      c10::IValue v;
      if (info_->is_out[i] && a.kind == Arg::kDevice) {
        v = at::empty({0}, at::TensorOptions().dtype(a.tensors[0].dtype));
        outs_at.push_back(static_cast<int>(i));
      } else {
        TORCH_CHECK(rebuild(a, &v), info_->name, ": device memory of an argument is gone");
        if (a.kind == Arg::kDevice) aliases.emplace_back(v.toTensor().data_ptr(), i);
      }
      host.push_back(std::move(v));
    }
    // histc has no CPU kernel for integers (CUDA's has: MoE routing counts expert indices with
    // it): the host counts their values as doubles, which bins non-negative integers alike.
    c10::optional<at::ScalarType> histc_int;
    if (info_->name.rfind("aten::histc", 0) == 0 && host[0].isTensor() &&
        at::isIntegralType(host[0].toTensor().scalar_type(), /*includeBool=*/false)) {
      histc_int = host[0].toTensor().scalar_type();
      host[0] = host[0].toTensor().to(at::kDouble);
    }
    try {
      c10::impl::ExcludeDispatchKeyGuard no_modes(hostExcluded());
      at::DisableRecordFunctionGuard no_observers;
      at::NoGradGuard no_grad;
      info_->op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &host);
      if (histc_int && !host.empty() && host[0].isTensor()) {
        host[0] = host[0].toTensor().to(*histc_int);
      }
    } catch (const c10::Error& e) {
      // No host kernel for these arguments (histc on integers, say): the op's own CUDA kernel
      // runs instead, outside the engine, so the ops it calls compute and what it launches
      // itself marks its outputs unknown.
      std::string msg = e.what();
      msg.resize(std::min(msg.find('\n'), msg.size()));
      report("no host result for " + info_->name + ": " + msg + " (its outputs are unknown)");
      original_.callBoxed(info_->op, ks, stack);
      return;
    }
    // Written in place on the host, now (the stream is idle): known from here on, unless computed
    // from unknown bytes.
    for (const Arg& a : snapped) {
      if (a.kind == Arg::kDevice && a.written && a.tensors[0].extent > 0) {
        standin_values_mark(a.tensors[0].ptr, a.tensors[0].extent, in_unknown ? 1 : 0);
      }
    }
    torch::jit::drop(*stack, nargs);
    size_t next_out = 0;
    for (c10::IValue& r : host) {
      if (r.isTensor() && r.toTensor().defined() && r.toTensor().device().is_cpu()) {
        const at::Tensor& t = r.toTensor();
        const c10::IValue* same = nullptr;  // an in-place result: the device argument
        for (const auto& al : aliases) {
          if (t.layout() == at::kStrided && t.numel() > 0 && t.data_ptr() == al.first) {
            same = &dev[al.second];
          }
        }
        if (same != nullptr) {
          stack->push_back(*same);
        } else if (next_out < outs_at.size()) {
          at::Tensor out = dev[outs_at[next_out++]].toTensor();
          out.resize_(t.sizes());
          out.copy_(t);
          stack->push_back(c10::IValue(out));
        } else {
          stack->push_back(c10::IValue(t.to(device)));
        }
      } else {
        stack->push_back(std::move(r));
      }
    }
    if (in_unknown) {  // the new results too, once their copies ran (deferred mode queues them)
      C10_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream().stream()));
      for (size_t i = stack->size() - host.size(); i < stack->size(); ++i) {
        const c10::IValue& r = (*stack)[i];
        if (!r.isTensor() || !r.toTensor().defined() || !isDevice(r.toTensor())) continue;
        const at::Tensor& t = r.toTensor();
        const size_t n = t.storage().nbytes() - t.storage_offset() * t.element_size();
        if (t.numel() > 0 && n > 0) standin_values_mark(t.data_ptr(), n, 1);
      }
    }
  }

  std::shared_ptr<OpInfo> info_;
  Original original_;
};

// ---- registration -------------------------------------------------------------------------------

namespace {

struct Registry {
  std::unique_ptr<torch::Library> lib;
  int registered = 0;
};

Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

// Overriding a kernel makes torch warn (once); the override is the point here.
struct Silent : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

void install() {
  auto& reg = registry();
  if (reg.lib) return;
  Silent silent;
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  standin_values_engine(1);
  // SDPA's fused CUDA kernels (flash, memory-efficient, cuDNN) have no CPU kernel to compute their
  // values with. With them off, scaled_dot_product_attention takes its math path (matmuls and a
  // softmax), which is computed, as on a GPU where none of them applies; asking for one by name
  // (sdpa_kernel) gets torch's own refusal.
  at::globalContext().setSDPUseFlash(false);
  at::globalContext().setSDPUseMemEfficient(false);
  at::globalContext().setSDPUseCuDNN(false);
  auto& dispatcher = c10::Dispatcher::singleton();
  std::vector<c10::OperatorName> names =
      dispatcher.getRegistrationsForDispatchKey(c10::DispatchKey::CUDA);
  names.push_back(c10::OperatorName("aten::copy_", ""));
  reg.lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA,
                                             __FILE__, __LINE__);
  std::set<std::string> done;
  for (const auto& n : names) {
    if (n.name.rfind("aten::", 0) != 0) continue;
    const std::string full = n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
    if (!done.insert(full).second) continue;
    if (skipped(n.name)) continue;
    auto handle = dispatcher.findOp(n);
    if (!handle) continue;
    const auto& schema = handle->schema();
    if (isView(schema) || handle->hasTag(at::Tag::inplace_view)) continue;
    if (!handle->hasComputedKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
    auto info = std::make_shared<OpInfo>(*handle);
    info->name = full;
    info->written = writtenArgs(schema);
    for (const auto& a : schema.arguments()) info->is_out.push_back(a.is_out());
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      const auto& t = schema.arguments()[i].type();
      if (t->kind() == c10::TypeKind::OptionalType &&
          t->castRaw<c10::OptionalType>()->getElementType()->kind() ==
              c10::TypeKind::GeneratorType) {
        info->generator_arg = static_cast<int>(i);
      }
    }
    info->seeded = handle->hasTag(at::Tag::nondeterministic_seeded);
    static const std::set<std::string> overwriting = {
        "aten::fill_",          "aten::zero_",      "aten::copy_",   "aten::_foreach_zero_",
        "aten::_foreach_copy_", "aten::uniform_",   "aten::normal_", "aten::random_",
        "aten::exponential_",   "aten::geometric_", "aten::cauchy_", "aten::log_normal_"};
    info->overwrites = overwriting.count(n.name) > 0 ||
                       (n.name == "aten::bernoulli_" && n.overload_name == "float");
    if (n.name == "aten::copy_") info->mode = OpInfo::kCopy;
    if (computeFirst(n)) info->mode = OpInfo::kComputeFirst;
    if (n.name == "aten::histc" || full == "aten::index.Tensor" ||
        full == "aten::index.Tensor_out" || full == "aten::repeat_interleave.Tensor" ||
        full == "aten::_index_put_impl_" || full == "aten::index_put_" ||
        full == "aten::_unsafe_index_put") {
      info->mode = OpInfo::kMaybeFirst;
    }
    if (!hasCpuKernel(*handle)) info->mode = OpInfo::kNoHost;
    info->no_host = std::make_shared<OpInfo>(*handle);
    info->no_host->name = full;
    info->no_host->mode = OpInfo::kNoHost;
    if (std::getenv("CUDA_STANDIN_VALUES_DEBUG") != nullptr && info->seeded &&
        info->generator_arg < 0) {
      std::fprintf(stderr, "[values] seeded without a generator argument: %s\n", full.c_str());
    }
    Original original = originalKernel(*handle);
    reg.lib->impl(full.substr(6).c_str(),
                  torch::CppFunction::makeFromBoxedFunctor(
                      std::make_unique<ValueKernel>(info, std::move(original))));
    reg.registered++;
  }
}

struct Init {
  Init() {
    if (!enabledByEnv()) return;
    install();
  }
} init;

}  // namespace

}  // namespace standin_values

extern "C" __attribute__((visibility("default"))) int standin_values_registered(void) {
  return standin_values::registry().registered;
}
