#include "CallRange.h"

#include "Backend.h"

#include <atomic>
#include <unordered_map>

namespace graphtrees {

namespace {
std::atomic<int64_t> g_begun{0};
}  // namespace

const char* CallRange::name(Kind kind) {
  static const char* const kNames[] = {"graphtrees::replay", "graphtrees::record",
                                       "graphtrees::warmup", "graphtrees::restore",
                                       "graphtrees::eager"};
  return kNames[static_cast<int>(kind)];
}

int64_t CallRange::begun() {
  return g_begun.load(std::memory_order_relaxed);
}

CallRange::CallRange(Kind kind, Backend* backend, const std::string& function, int64_t node,
                     const std::string& reason)
    : CallRange(kind, backend != nullptr ? backend->rangeMarks() : nullptr, function, node,
                reason) {}

CallRange::CallRange(Kind kind, const RangeMarks* marks, const std::string& function, int64_t node,
                     const std::string& reason) {
  // Note [Call ranges]: nothing below runs while nothing watches. The profiler's callbacks for
  // this scope, from the thread's cache (what RECORD_FUNCTION_WITH_SCOPE asks first).
  if (auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE)) {
    record_.emplace(std::move(*callbacks));
    if (record_->needsInputs()) {
      std::unordered_map<std::string, c10::IValue> kwargs;
      kwargs.emplace("function", function);
      kwargs.emplace("node", node);
      if (!reason.empty()) kwargs.emplace("reason", reason);
      record_->before(name(kind), &kwargs);
    } else {
      record_->before(name(kind));
    }
    g_begun.fetch_add(1, std::memory_order_relaxed);
  }
  if (marks != nullptr && marks->attached()) {
    std::string text = std::string(name(kind)) + " " + function;
    if (node >= 0) text += " #" + std::to_string(node);
    if (!reason.empty()) text += ": " + reason;
    marks->push(text);
    marked_ = marks;
    g_begun.fetch_add(1, std::memory_order_relaxed);
  }
}

CallRange::~CallRange() {
  if (marked_ != nullptr) marked_->pop();
  // record_'s destructor ends the profiler's range.
}

}  // namespace graphtrees
