#pragma once

// The one place that names the backends: which backend serves a device.

#include "Backend.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

// Creates the backend for a device, or returns nullptr with `why_not` set when no backend for it
// was compiled in or it cannot be used (e.g. CUDA with a non-native allocator).
std::unique_ptr<Backend> makeBackend(c10::Device device, std::string* why_not);

// The ranges of `device`'s own tracing tool (NVTX on CUDA, when the CUDA backend is compiled in),
// or nullptr: what its backend's rangeMarks() gives, without a backend (Note [Call ranges]).
const RangeMarks* rangeMarks(c10::Device device);

// The backends compiled in ("cpu", and "cuda" when built with the CUDA backend).
std::vector<std::string> compiledBackends();
// Why CUDA tensors would run eagerly (not compiled in, not enabled, another allocator), or "".
std::string cudaBackendDisabledReason();

// Whether the caller is capturing a graph of its own on `device` (torch.cuda.graph around a
// graphed call): the call is then part of that capture and runs eagerly (review 4, #13).
bool callerIsCapturing(c10::Device device);

// A host read that ATen does not dispatch (Tensor.tolist()), reported by the Python layer: the CPU
// backend rejects a capture that makes one (Note [Rejected captures] in cpu/HostSyncWatch.cpp).
void noteUndispatchedHostRead(const char* what);
// Access to tensor memory that ATen does not dispatch (Tensor.numpy(), Tensor.data_ptr()),
// reported by the Python layer: a CPU recording keeps the Python replay (Note [CPU graphs]).
void noteUndispatchedAccess(const char* what);

// torch.cond and torch.while_loop inside a recording (Note [Control flow in a recording] in
// graphtrees/_control_flow.py): cpu/ControlFlowCapture.h's events and predicate read.
bool controlFlowEvent(const std::string& event, const std::vector<at::Tensor>& first,
                      const std::vector<at::Tensor>& second);
bool controlFlowPredicate(const at::Tensor& pred);
// Runs `run` with this thread's ops watched for host reads (.item(), nonzero, ...: Note [Rejected
// captures] in cpu/HostSyncWatch.cpp) while a warmup or capture observes them; the first one met,
// or "" (also when nothing observes this thread).
std::string runWatchingHostReads(const std::function<void()>& run);

// The CUDA backend's conditional nodes (Note [Conditional nodes on CUDA] in
// cuda/ConditionalNodes.cpp): why a CUDA recording cannot hold them ("" if it can), and one step
// of a cond's or a while_loop's capture.
std::string cudaConditionalUnavailable();
void cudaConditionalStep(const std::string& what, const at::Tensor& pred);

// For the tests: {pools alive, allocated blocks, reserved bytes} over every CPU pool, released
// ones that still have blocks in use included.
std::vector<int64_t> cpuPoolTotals();

}  // namespace graphtrees
