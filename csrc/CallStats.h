#pragma once

// What happened to the calls of one wrapped callable, for graphtrees.report().
//
// Note [Call statistics]
// Each GraphedCallable counts its calls by what ran -- a replay, a recording, a warmup, an eager
// run -- and its eager runs by reason (the tree's reason for that call, or the record's
// eager_reason; a fallback decided before the tree was asked gives its own). A call nested in
// another graphed call's run is part of that run and is not counted. The counts outlive the
// callable (a compiled graph that torch._dynamo.reset() freed still reports what it did): every
// CallStats made is kept in one process-wide list until resetAll(), which zeroes them and drops
// those whose callable is gone. Counting a replay is one relaxed atomic increment; a reason is
// counted under the stats' mutex (an eager run costs a Python call anyway).

#include "FunctionRecord.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace graphtrees {

class CallStats {
 public:
  // A new entry of the process-wide list.
  static std::shared_ptr<CallStats> create(const std::string& name, int64_t callable_id);
  // Every entry, in the order they were made.
  static std::vector<std::shared_ptr<CallStats>> all();
  // Zeroes every entry and forgets those only the list holds.
  static void resetAll();

  explicit CallStats(std::string name, int64_t callable_id)
      : name_(std::move(name)), callable_id_(callable_id) {}

  // One call ran as `kind`; `reason`: why, for an eager run.
  void note(RunKind kind, const std::string& reason) {
    counts_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
    if (kind == RunKind::kEager) noteReason(reason);
  }
  int64_t count(RunKind kind) const {
    return counts_[static_cast<int>(kind)].load(std::memory_order_relaxed);
  }
  std::map<std::string, int64_t> reasons() const;
  const std::string& name() const { return name_; }
  int64_t callableId() const { return callable_id_; }

 private:
  void noteReason(const std::string& reason);
  void zero();

  const std::string name_;
  const int64_t callable_id_;
  std::atomic<int64_t> counts_[4] = {};  // by RunKind
  mutable std::mutex mutex_;
  std::map<std::string, int64_t> reasons_;
};

}  // namespace graphtrees
