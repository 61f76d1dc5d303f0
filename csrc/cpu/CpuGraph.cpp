#include "cpu/CpuGraph.h"

#include "AutocastState.h"
#include "CaptureObserver.h"
#include "CollectiveBuffers.h"
#include "PythonHooks.h"
#include "ThreadState.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>

namespace graphtrees {

namespace {

// Contiguous copies compared byte for byte (NaNs included).
bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  // Values, not raw bytes: a conjugate or negative view's bytes are read through its bit.
  const at::Tensor ca = a.resolve_conj().resolve_neg().contiguous();
  const at::Tensor cb = b.resolve_conj().resolve_neg().contiguous();
  return std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

std::vector<uint8_t> bytesOf(uintptr_t begin, uintptr_t end) {
  const auto* p = reinterpret_cast<const uint8_t*>(begin);
  return std::vector<uint8_t>(p, p + (end - begin));
}

std::string firstLine(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

// Runs `program` as a replay of the recording that made `recorded` runs it.
void runOpProgram(const OpProgram& program, const std::vector<at::Tensor>& inputs,
                  const std::vector<Allocation>& recorded, const std::string& function_name,
                  bool wait_for_frees = false, OpProgram::Proof* proof = nullptr) {
  RouteState st = replayRoute(&recorded, &function_name);
  st.wait_for_frees = wait_for_frees;  // Note [Collective buffers]
  ReplayScope replay_scope(st.liveness);
  AutocastCacheOff no_cast_cache;  // as it ran when captured (Note [Autocast and recordings])
  RouteGuard guard(&st);
  program.run(inputs, &st, function_name, proof);
}

}  // namespace

OutputLayout layoutOf(const at::Tensor& t) {
  return {t.storage().data(), t.sizes().vec(), t.strides().vec(), t.storage_offset()};
}

std::vector<at::Generator> withDefaultCpuGenerator(const std::vector<at::Generator>& generators) {
  std::vector<at::Generator> all{at::detail::getDefaultCPUGenerator()};
  all.insert(all.end(), generators.begin(), generators.end());
  return all;
}

CpuGraph::CpuGraph(std::vector<Allocation> allocations, std::vector<OutputLayout> outputs,
                   std::string name, bool uses_collectives, std::unique_ptr<OpProgram> program,
                   std::vector<std::string> controls)
    : uses_collectives_(uses_collectives),
      allocations_(std::move(allocations)),
      footprint_(footprintOf(allocations_)),
      outputs_(std::move(outputs)),
      name_(std::move(name)),
      program_(std::move(program)),
      controls_(std::move(controls)) {
  for (const auto& o : outputs_) output_storages_.insert(reinterpret_cast<uintptr_t>(o.storage));
}

void CpuGraph::replay(const RunFn& run, const std::vector<at::Tensor>& call_inputs,
                      const std::vector<int64_t>& copied,
                      const std::vector<at::Tensor>& placeholders) {
  std::vector<at::Tensor> inputs = call_inputs;  // the recording's addresses for copied inputs
  for (size_t k = 0; k < copied.size(); ++k) inputs[copied[k]] = placeholders[k];
  if (program_) {
    replayProgram(inputs);
  } else {
    replayPython(run, inputs);
  }
}

void CpuGraph::replayProgram(const std::vector<at::Tensor>& inputs) {
  // No Python runs: the GIL is released.
  runBlocking([&] { runOpProgram(*program_, inputs, allocations_, name_, uses_collectives_); });
}

void CpuGraph::replayPython(const RunFn& run, const std::vector<at::Tensor>& inputs) {
  RouteState st = replayRoute(&allocations_, &name_);
  st.wait_for_frees = uses_collectives_;
  ReplayScope replay_scope(st.liveness);
  std::vector<at::Tensor> outputs;
  // Note [Collective buffers]: their storages are seen through RecordFunction, which the user's
  // choice to switch it off is not overridden for (Note [One capture observer]).
  TORCH_CHECK(!uses_collectives_ || !CaptureObserver::blind(), "graphtrees: the replay of '", name_,
              "' runs its Python code again, and it calls collectives, whose buffers graphtrees "
              "tells through RecordFunction: it is switched off on this thread (torch._C._autograd."
              "_enable_record_function(False)). Switch it on around graphed calls");
  CollectiveBuffers collective_buffers(uses_collectives_);
  {
    RouteGuard guard(&st);
    RecordingGraphScope recording;   // the recorded function runs again, as it was captured
    AutocastCacheOff no_cast_cache;  // as it ran when captured (Note [Autocast and recordings])
    try {
      outputs = run(inputs);
    } catch (const std::exception&) {
      // An allocation that diverged raised inside the user's code, and came back through Python:
      // the divergence is graphtrees' own error (Note [A failed replay] in TreeManager.h), any
      // other the function's.
      if (st.divergence.empty()) throw;
    }
  }
  if (st.divergence.empty() && st.cursor != allocations_.size()) {
    st.divergence = "the replay made " + std::to_string(st.cursor) +
                    " allocations where the recording made " + std::to_string(allocations_.size());
  }
  // The outputs must come back where and as the recording's did: the tree rebuilds them from
  // the recording's metadata (as a CUDA graph replay would).
  for (size_t i = 0; st.divergence.empty() && i < outputs.size(); ++i) {
    const OutputLayout now = layoutOf(outputs[i]);
    const OutputLayout& then = outputs_[i];
    if (now.storage != then.storage) {
      st.divergence = "output " + std::to_string(i) +
                      " came back at another address (the order of its allocations changed)";
    } else if (now.sizes != then.sizes || now.strides != then.strides ||
               now.storage_offset != then.storage_offset) {
      st.divergence = "output " + std::to_string(i) + " has shape " +
                      c10::str(c10::IntArrayRef(now.sizes)) + " where the recording's had " +
                      c10::str(c10::IntArrayRef(then.sizes)) +
                      " (its shape or layout depends on the input values)";
    }
  }
  if (st.divergence.empty() && outputs.size() != outputs_.size()) {
    st.divergence = "it returned " + std::to_string(outputs.size()) +
                    " tensors where the recording returned " + std::to_string(outputs_.size());
  }
  TORCH_CHECK(st.divergence.empty(), "graphtrees: the replay of '", name_,
              "' diverged from its recording: ", st.divergence,
              ". It depends on the input values (data-dependent control flow, shapes or "
              "lifetimes), which a recorded graph cannot reproduce.");
  // Anything still alive that is not an output was kept by the function (on a module, in a
  // global): the next run would overwrite it without anyone knowing.
  outputs.clear();
  size_t kept = 0;  // Note [Collective buffers]: a collective's are not kept
  {
    std::lock_guard<std::mutex> lock(st.liveness->mutex);
    for (const auto& kv : st.liveness->alive) {
      kept += output_storages_.count(kv.first) || collective_buffers.contains(kv.first) ? 0 : 1;
    }
  }
  TORCH_CHECK(kept == 0, "graphtrees: the replay of '", name_, "' kept ", kept,
              " tensor(s) it allocated without returning them (for example a cache stored on a "
              "module or in a global). Their memory belongs to the graph and is overwritten by "
              "the next run. Create such state before wrapping the function, or return it.");
}

std::string CpuGraph::explainDifference(const std::function<void()>& eager,
                                        const std::vector<at::Tensor>& eager_inputs) const {
  if (!program_ || CaptureObserver::blind()) {  // a blind trace would compare nothing
    eager();
    return std::string();
  }
  ProgramRecorder trace(eager_inputs, /*allocations=*/nullptr, /*pool=*/nullptr);
  eager();
  std::string why;
  const auto traced = trace.finish(&why);
  return traced ? program_->firstDifference(*traced) : std::string();
}

std::string proveProgram(const OpProgram& program, const std::vector<at::Tensor>& inputs,
                         const std::vector<at::Tensor>& outputs,
                         const std::vector<Allocation>& allocations,
                         const std::vector<ProgramRecorder::SavedStorage>& saved,
                         const RngStates& at_start, const std::vector<at::Generator>& generators,
                         const std::string& function_name) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].layout() != at::kStrided) {
      return "output " + std::to_string(i) + " is not a strided tensor, which it cannot compare";
    }
  }
  RouteSuspended outside_the_pool;  // the copies below are graphtrees' own
  // What the capture left: its outputs, the memory it wrote, the storages it wrote but did not
  // make, the RNG.
  std::vector<at::Tensor> expected;
  expected.reserve(outputs.size());
  for (const auto& o : outputs) expected.push_back(o.clone());
  const std::vector<Interval> written = footprintOf(allocations);
  std::vector<std::vector<uint8_t>> written_bytes;
  for (const auto& iv : written) written_bytes.push_back(bytesOf(iv.begin, iv.end));
  std::vector<std::vector<uint8_t>> saved_after;
  for (const auto& s : saved) {
    const auto begin = reinterpret_cast<uintptr_t>(s.storage.data());
    saved_after.push_back(bytesOf(begin, begin + s.before.size()));
  }
  const RngStates at_end(withDefaultCpuGenerator(generators));
  std::string why;
  // Three times, over memory filled with 0x00, with 0xFF and with random bytes drawn for this
  // proof: an output that depends on memory no op wrote (a tensor Python filled, an
  // uninitialised read) cannot match every time -- not even a Python-filled value that happens
  // to survive both fixed patterns (all-zero bytes from a masked write, say).
  std::mt19937_64 random_bytes(std::random_device{}());
  std::vector<at::Tensor> untaken_first;  // Note [Arms a recording did not run] in OpProgram.h
  for (const int pattern : {0x00, 0xFF, -1}) {
    if (!why.empty()) break;
    for (const auto& iv : written) {
      if (pattern >= 0) {
        std::memset(reinterpret_cast<void*>(iv.begin), pattern, iv.end - iv.begin);
        continue;
      }
      for (uintptr_t at = iv.begin; at < iv.end; at += sizeof(uint64_t)) {
        const uint64_t word = random_bytes();
        std::memcpy(reinterpret_cast<void*>(at), &word,
                    std::min<uintptr_t>(sizeof(word), iv.end - at));
      }
    }
    for (const auto& s : saved) {
      std::memcpy(s.storage.mutable_data(), s.before.data(), s.before.size());
    }
    try {
      at_start.restore();
      OpProgram::Proof proof{withDefaultCpuGenerator(generators), {}, 0};
      runOpProgram(program, inputs, allocations, function_name, false, &proof);
      std::vector<at::Tensor>& untaken = proof.untaken;
      for (size_t i = 0; why.empty() && i < outputs.size(); ++i) {
        if (!sameBytes(outputs[i], expected[i])) {
          why = "output " + std::to_string(i) + " differed from the recording's";
        }
      }
      if (pattern == 0x00) untaken_first = std::move(untaken);
      for (size_t k = 0; why.empty() && k < untaken.size(); ++k) {
        if (k >= untaken_first.size() || !sameBytes(untaken[k], untaken_first[k])) {
          why =
              "a branch or loop body the recording's inputs do not take read memory no op "
              "wrote (its results changed with the memory's contents)";
        }
      }
      for (size_t k = 0; why.empty() && k < saved.size(); ++k) {
        if (std::memcmp(saved[k].storage.data(), saved_after[k].data(), saved_after[k].size())) {
          why = "a tensor it writes in place ended with other values than in the recording";
        }
      }
    } catch (const std::exception& e) {
      const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
      why = "running it raised: " +
            firstLine(c10_error ? c10_error->what_without_backtrace() : e.what());
    }
  }
  // Put back what the capture left.
  for (size_t k = 0; k < written.size(); ++k) {
    std::memcpy(reinterpret_cast<void*>(written[k].begin), written_bytes[k].data(),
                written_bytes[k].size());
  }
  for (size_t k = 0; k < saved.size(); ++k) {
    std::memcpy(saved[k].storage.mutable_data(), saved_after[k].data(), saved_after[k].size());
  }
  at_end.restore();
  return why;
}

}  // namespace graphtrees
