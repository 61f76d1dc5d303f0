#include "cpu/CpuBackend.h"

#include "FailureInjection.h"
#include "Logging.h"
#include "cpu/CpuGraph.h"
#include "cpu/CpuPool.h"
#include "cpu/HostSyncWatch.h"
#include "cpu/ProgramRecorder.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/UniqueVoidPtr.h>

#include <mutex>
#include <optional>
#include <unordered_set>

namespace graphtrees {

namespace {

// Says once per function and reason why a CPU graph replays by running Python.
void logPythonReplay(const std::string& name, const std::string& why, bool asked) {
  static std::mutex mutex;
  static std::unordered_set<std::string> logged;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!logged.insert(name.substr(0, name.find('#')) + "\n" + why).second) return;
  }
  GRAPHTREES_LOG(asked ? LogLevel::kInfo : LogLevel::kWarning,
                 "CPU replays of '" + name +
                     "' run its Python code again instead of its recorded "
                     "ops: " +
                     why +
                     (asked ? ""
                            : ". Python attributes it reads are then re-read on each "
                              "replay, where a CUDA graph bakes them (Note [CPU graphs])"));
}

}  // namespace

CpuBackend::CpuBackend() : pool_(CpuPool::create()) {
  installRouter();
}

CpuBackend::~CpuBackend() {
  try {
    releasePool();
  } catch (const std::exception& e) {
    GRAPHTREES_LOG(LogLevel::kWarning, std::string("releasing the CPU pool failed: ") + e.what());
  }
}

void CpuBackend::releasePool() {
  if (pool_ == nullptr) return;
  CpuPool* pool = pool_;
  pool_ = nullptr;
  // A pool that a failed restore left inconsistent has blocks nobody will free; the tree has
  // invalidated every output by now, so nothing can reach them.
  if (poisoned_) {
    pool->releaseAll();
  } else {
    pool->release();
  }
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kReleasePool),
              "graphtrees: injected failure after releasing the CPU pool (as an asynchronous "
              "device error surfacing at the final synchronisation)");
}

void CpuBackend::beginAllocateToPool() {
  TORCH_INTERNAL_ASSERT(pool_ != nullptr);
  checkRouterInstalled();
  auto st = std::make_unique<RouteState>();
  st->mode = RouteMode::kPool;
  st->pool = pool_;
  pushRoute(st.release());  // deleted by endAllocateToPool()
}

void CpuBackend::endAllocateToPool() {
  RouteState* top = currentRoute();
  TORCH_INTERNAL_ASSERT(top != nullptr && top->mode == RouteMode::kPool && top->pool == pool_,
                        "endAllocateToPool without a matching beginAllocateToPool");
  delete popRoute();
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kEndAllocate),
              "graphtrees: injected failure after ending the routing into the CPU pool (as an "
              "asynchronous device error surfacing at the synchronisation)");
}

std::unique_ptr<Graph> CpuBackend::capture(const RunFn& run, const std::vector<at::Tensor>& inputs,
                                           std::vector<at::Tensor>* outputs,
                                           const CaptureSpec& spec) {
  TORCH_INTERNAL_ASSERT(pool_ != nullptr);
  checkRouterInstalled();
  std::vector<Allocation> allocations;
  RouteState st;
  st.mode = RouteMode::kCapture;
  st.pool = pool_;
  st.recording = &allocations;
  st.function_name = &spec.function_name;
  HostSyncWatch watch;
  // Note [CPU graphs]: the program the function dispatches, unless the Python replay was asked.
  std::string python_replay = spec.python_replay;
  const bool record_program = python_replay.empty();
  std::optional<RngStates> rng_at_start;
  if (record_program) rng_at_start.emplace(withDefaultCpuGenerator(spec.generators));
  RngStates op_generators;  // as the ops first took them
  std::string unproven;
  std::unique_ptr<OpProgram> program;
  std::vector<ProgramRecorder::SavedStorage> saved;
  bool ran = false;
  try {
    RouteGuard guard(&st);
    HostSyncWatchGuard watching(&watch);
    std::optional<ProgramRecorder> recorder;
    std::optional<OtherThreadAllocations> other_threads;  // Note [Tensors made on other threads]
    if (record_program) {
      other_threads.emplace();
      recorder.emplace(inputs, &allocations, pool_);
    }
    *outputs = run(inputs);
    ran = true;
    if (recorder) {
      program = recorder->finish(&python_replay);
      saved = std::move(recorder->savedStorages());
      op_generators = recorder->generatorStates();
      unproven = recorder->unproven();
    }
  } catch (...) {
    // On CUDA the host read itself would have failed the capture, before this error.
    if (watch.first.empty()) throw;
  }
  if (!watch.first.empty()) {
    if (!ran) outputs->clear();
    throw CaptureRejected(
        "it reads tensor values on the host while it is recorded: " + watch.first +
            ". A CUDA graph capture cannot synchronise with the host. Keep such code "
            "out of the graphed function, or express it with tensor ops (e.g. "
            "torch.where instead of `if tensor:`)",
        ran);
  }
  if (consumeInjectedFailure(FailurePoint::kCaptureEnd)) {
    // The function ran to its end: its results are this call's (its side effects happened once).
    throw CaptureRejected("injected failure at the end of the capture", /*ran=*/true);
  }
  // A program with collectives is not proved: running them once more would take this rank out
  // of step with the others (Note [CPU graphs]). Nor is one whose inputs are too large to copy.
  if (program && !unproven.empty()) {
    GRAPHTREES_LOG(LogLevel::kInfo, "the recorded ops of '" + spec.function_name +
                                        "' replay without the completeness proof: " + unproven);
  }
  const std::vector<std::string> controls =
      program ? program->controlKinds() : std::vector<std::string>();
  if (program && !watch.collectives && unproven.empty()) {
    std::vector<at::Generator> generators = spec.generators;
    for (const auto& g : op_generators.generators()) generators.push_back(g);
    // Generators the ops took, as first seen; then the default one and the arguments as the
    // capture found them.
    RngStates at_start = op_generators;
    at_start.append(*rng_at_start);
    const std::string failed = proveProgram(*program, inputs, *outputs, allocations, saved,
                                            at_start, generators, spec.function_name);
    if (!failed.empty()) {
      program.reset();
      python_replay = "running its recorded ops once more did not reproduce its recording (" +
                      failed +
                      "): some of its work does not go through the dispatcher (a pybind or "
                      "ctypes call, a numpy view of tensor memory, a compiled kernel)";
    }
  }
  if (!program) logPythonReplay(spec.function_name, python_replay, !spec.python_replay.empty());
  std::vector<OutputLayout> layouts;
  layouts.reserve(outputs->size());
  for (const auto& t : *outputs) layouts.push_back(layoutOf(t));
  return std::make_unique<CpuGraph>(std::move(allocations), std::move(layouts), spec.function_name,
                                    watch.collectives, std::move(program), controls);
}

void CpuBackend::copyInputs(const std::vector<at::Tensor>& dst,
                            const std::vector<at::Tensor>& src) {
  TORCH_INTERNAL_ASSERT(dst.size() == src.size());
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

std::shared_ptr<Checkpoint> CpuBackend::checkpoint() {
  TORCH_CHECK(!consumeInjectedFailure(FailurePoint::kCheckpoint),
              "graphtrees: injected failure while checkpointing the CPU pool");
  return pool_->checkpoint();
}

RestoreResult CpuBackend::restore(const Checkpoint& checkpoint) {
  if (consumeInjectedFailure(FailurePoint::kBackendRestore)) {
    throw RestoreError("injected failure before the restore changed the CPU pool",
                       /*pool_unchanged=*/true);
  }
  RestoreResult r;
  try {
    r = pool_->restore(checkpoint);
  } catch (const std::exception& e) {
    throw RestoreError(e.what(), /*pool_unchanged=*/true);  // CpuPool::restore is all or nothing
  }
  if (consumeInjectedFailure(FailurePoint::kPartialRestore)) {
    // As c10's setCheckpointPoolState can fail: the pool has changed and the blocks it
    // re-created are never handed out.
    for (auto& dp : r.dataptrs_allocd) {
      dp.compare_exchange_deleter(&CpuPool::deleteBlock, &c10::detail::deleteNothing);
    }
    poisoned_ = true;
    throw RestoreError("injected failure after the restore changed the CPU pool",
                       /*pool_unchanged=*/false);
  }
  return r;
}

void CpuBackend::freeBlock(void* ptr) {
  pool_->free(ptr);
}

c10::DeleterFnPtr CpuBackend::poolDeleter() const {
  return &CpuPool::deleteBlock;
}

bool CpuBackend::inPool(const void* ptr) const {
  return pool_ != nullptr && pool_->contains(ptr);
}

bool CpuBackend::checkLiveAllocations(const std::unordered_set<void*>& expected) {
  return pool_->checkLiveAllocations(expected);
}

std::vector<void*> CpuBackend::allocatedBlocks() {
  return pool_->allocatedBlocks();
}

PoolStats CpuBackend::stats() {
  return pool_ != nullptr ? pool_->stats() : PoolStats{};
}

void CpuBackend::setReservedLimit(int64_t bytes) {
  if (pool_ != nullptr) pool_->setLimit(bytes);
}

int64_t CpuBackend::refusedBytes() const {
  return pool_ != nullptr ? pool_->refusedBytes() : 0;
}

int64_t CpuBackend::releaseFreeSegments(const std::vector<const Checkpoint*>& keep) {
  return pool_ != nullptr ? pool_->releaseFreeSegments(keep) : 0;
}

}  // namespace graphtrees
