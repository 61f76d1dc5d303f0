#include "CallStats.h"

#include <algorithm>

namespace graphtrees {

namespace {
std::mutex& listMutex() {
  static std::mutex m;
  return m;
}
std::vector<std::shared_ptr<CallStats>>& list() {
  static auto* l = new std::vector<std::shared_ptr<CallStats>>();  // outlives every callable
  return *l;
}
}  // namespace

std::shared_ptr<CallStats> CallStats::create(const std::string& name, int64_t callable_id) {
  auto stats = std::make_shared<CallStats>(name, callable_id);
  std::lock_guard<std::mutex> lock(listMutex());
  auto& l = list();
  static size_t swept_at = 64;  // Note [Call statistics]: the size that triggers the next sweep
  if (l.size() >= swept_at) {
    l.erase(std::remove_if(l.begin(), l.end(),
                           [](const auto& s) { return s.use_count() == 1 && !s->counted(); }),
            l.end());
    swept_at = std::max<size_t>(64, 2 * l.size());
  }
  l.push_back(stats);
  return stats;
}

bool CallStats::counted() const {
  for (const auto& c : counts_) {
    if (c.load(std::memory_order_relaxed) != 0) return true;
  }
  return false;
}

void CallStats::addSignature(int64_t function_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  signatures_.push_back(function_id);
}

std::vector<int64_t> CallStats::signatures() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return signatures_;
}

std::vector<std::shared_ptr<CallStats>> CallStats::all() {
  std::lock_guard<std::mutex> lock(listMutex());
  return list();
}

void CallStats::resetAll() {
  std::lock_guard<std::mutex> lock(listMutex());
  auto& l = list();
  l.erase(std::remove_if(l.begin(), l.end(), [](const auto& s) { return s.use_count() == 1; }),
          l.end());
  for (const auto& s : l) s->zero();
}

std::map<std::pair<std::string, std::string>, int64_t> CallStats::reasons() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reasons_;
}

void CallStats::noteReason(const std::string& reason, ReasonKind why) {
  std::lock_guard<std::mutex> lock(mutex_);
  reasons_[{reason.empty() ? std::string("(no reason given)") : reason, reasonKindName(why)}]++;
}

const char* reasonKindName(ReasonKind kind) {
  static const char* const kNames[] = {"other",
                                       "host sync",
                                       "unsupported op",
                                       "thrashing shapes",
                                       "memory budget",
                                       "re-recorded too often",
                                       "autograd",
                                       "arguments",
                                       "device",
                                       "record function off",
                                       "another thread",
                                       "capture elsewhere",
                                       "graphtrees failure"};
  return kNames[static_cast<int>(kind)];
}

ReasonKind treeReasonKind(const std::string& reason) {
  // Note [Reason kinds]: the text each of the tree's sources begins with, or contains when it
  // is passed on within another reason (the capture observer's refusal, CaptureRejected's).
  const auto starts = [&reason](const char* p) { return reason.rfind(p, 0) == 0; };
  const auto has = [&reason](const char* p) { return reason.find(p) != std::string::npos; };
  if (has("RecordFunction is switched off on this thread")) return ReasonKind::kRecordFunctionOff;
  if (starts("it ran out of memory")) return ReasonKind::kMemory;
  if (starts("it was called on another thread while a call on its tree ran user code")) {
    return ReasonKind::kOtherThread;  // TreeRegistry::runOn()
  }
  if (starts("it was re-recorded ")) return ReasonKind::kRerecord;
  if (starts("its replay failed") || starts("the pool could not be checkpointed")) {
    return ReasonKind::kFailure;
  }
  if (has("reads tensor values on the host") || has("synchronis")) return ReasonKind::kHostSync;
  if (starts("it cannot be recorded as a graph")) return ReasonKind::kUnsupportedOp;
  if (starts("it was called while another thread's capture")) return ReasonKind::kCaptureElsewhere;
  if (starts("it mutates") || has("static_argnums")) return ReasonKind::kArguments;
  return ReasonKind::kOther;
}

void CallStats::zero() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  reasons_.clear();
}

}  // namespace graphtrees
