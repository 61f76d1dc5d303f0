#pragma once

// The CUDA stand-in's value engine (Note [Stand-in values] in values.cpp): what the functor
// (values.cpp) and the host work (values_host.cpp) share.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <ATen/core/stack.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "standin_api.h"

namespace standin_values {

// ---- snapshots (values_host.cpp) --------------------------------------------------------------

// A device tensor, without a reference to it.
struct TensorDesc {
  void* ptr = nullptr;  // data_ptr(): the storage's data plus the offset
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  bool conj = false, neg = false;
  size_t extent = 0;  // bytes from ptr that the view spans (0: no elements)
};

// One argument of the op as the host work rebuilds it.
struct Arg {
  enum Kind { kValue, kDevice, kDeviceList, kOptDeviceList } kind = kValue;
  c10::IValue value;                // kValue: by value (a CPU tensor: a private copy)
  std::vector<TensorDesc> tensors;  // kDevice (one), kDeviceList, kOptDeviceList
  std::vector<bool> present;        // kOptDeviceList: which entries are tensors
  std::vector<c10::IValue> others;  // kOptDeviceList / kDeviceList: non-device entries
  bool written = false;             // a mutable (alias_info isWrite) argument
};

bool isDevice(const at::Tensor& t);
// The argument `v` as the host work will rebuild it: no reference to a caller's tensor is kept.
Arg snapshotArg(const c10::IValue& v, bool written);
// Rebuilds an argument on the host (CPU aliases of device memory); false if that memory is gone.
bool rebuild(const Arg& a, c10::IValue* out);
// The dispatch keys the host work must not see: it is below autograd, outside every mode.
c10::DispatchKeySet hostExcluded();
// Reports work the engine cannot compute (once per message on stderr; counted by the stand-in).
void report(const std::string& what);

// ---- one op's host work (values_host.cpp) -----------------------------------------------------

struct OpInfo;

// What a host function needs: the op, its arguments and outputs, the philox state it drew from.
struct HostWork {
  const OpInfo* info = nullptr;
  std::vector<Arg> args;
  std::vector<Arg> outs;    // the device returns (kDevice / kDeviceList), or kValue for others
  bool persistent = false;  // captured: a host node that every replay runs; freed with the graph
  // Random numbers: the CUDA philox state of the op.
  bool rng = false;
  int rng_arg = -1;  // the Generator? argument, replaced by a CPU generator
  bool captured_rng = false;
  uint64_t seed = 0, offset = 0;
  int64_t* seed_ptr = nullptr;  // in a capture: device int64s written by each replay's prologue
  int64_t* offset_ptr = nullptr;
  uint64_t offset_intragraph = 0;
  void run();
};

struct OpInfo {
  c10::OperatorHandle op;
  std::string name;
  // kCopy: copy_, computed when both sides are device tensors, else its bytes move by memcpy
  // (nested same-device copy_ calls compute any conversion); kMaybeFirst: data-dependent for
  // some arguments only (index with a boolean index, repeat_interleave without output_size).
  enum Mode { kCompute, kComputeFirst, kPassThrough, kNoHost, kCopy, kMaybeFirst } mode = kCompute;
  std::shared_ptr<OpInfo> no_host;  // the same op as kNoHost: host work that marks unknown
  int generator_arg = -1;           // the Generator? argument's index, or -1
  bool seeded = false;              // uses the CUDA generator (nondeterministic_seeded)
  std::vector<bool> written;        // per argument: alias_info isWrite
  std::vector<bool> is_out;
  // Whether its written arguments' old values are never read (fill_, zero_, copy_, the in-place
  // random ops): then they do not make its results unknown.
  bool overwrites = false;
  OpInfo(c10::OperatorHandle h) : op(std::move(h)) {}
};

// The host function of a HostWork (deleted after it runs unless persistent), and the destructor
// of a persistent one's user object.
void CUDART_CB hostFunction(void* p);
void CUDART_CB freeWork(void* p);

}  // namespace standin_values
