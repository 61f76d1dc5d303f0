#pragma once

// What happened to the calls of one wrapped callable, for graphtrees.report().
//
// Note [Call statistics]
// Each GraphedCallable counts its calls by what ran -- a replay, a recording, a warmup, an eager
// run -- and its eager runs by reason (the tree's reason for that call, or the record's
// eager_reason; a fallback decided before the tree was asked gives its own). A call nested in
// another graphed call's run is part of that run and is not counted, and so is a call that raised
// (whether graphtrees decided before the tree -- fallback() -- or the tree ran it: a call is
// counted once it returned, as what it ran as). The counts outlive the callable (a compiled graph
// that torch._dynamo.reset() freed still reports what it did): every CallStats made is kept in one
// process-wide list; resetAll() zeroes them and drops those whose callable is gone, and create()
// drops those whose callable is gone and that counted nothing (a callable made per request and
// never called), whenever the list doubled since its last sweep, so that it stays bounded by what
// is alive or counted. An entry knows the ids of its signatures' function records (addSignature():
// tree_info()'s node function_id), so that report() files each node under its callable, not its
// name. Counting a replay is one relaxed atomic increment; a reason is counted under the stats'
// mutex (an eager run costs a Python call anyway).

#include "FunctionRecord.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace graphtrees {

// Note [Reason kinds]
// What kind of reason made a call run eagerly, for graphtrees.report()'s grouping: given where
// the reason is made -- GraphedCallable::fallback()'s callers, FlatArgs::complete(), the
// registry's cross-thread path, graphtrees/_piecewise.py's eager pieces -- rather than guessed
// from the reason's words. The tree's own reasons (TreeManager.cpp, at its line cap) are told
// apart by the fixed text each of its sources begins with (treeReasonKind(), one test per
// source in tests/test_observability.py). reasonKindName() is what report() shows; a new kind
// adds its name there and to _report.py's REASON_KINDS.
enum class ReasonKind : uint8_t {
  kOther,
  kHostSync,
  kUnsupportedOp,
  kShapes,
  kMemory,
  kRerecord,
  kAutograd,
  kArguments,
  kDevice,
  kRecordFunctionOff,
  kOtherThread,
  kCaptureElsewhere,
  kFailure,
};
const char* reasonKindName(ReasonKind kind);
ReasonKind treeReasonKind(const std::string& reason);

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

  // One call ran as `kind`; `reason`, `why`: why and what kind of reason, for an eager run.
  void note(RunKind kind, const std::string& reason, ReasonKind why) {
    counts_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
    if (kind == RunKind::kEager) noteReason(reason, why);
  }
  int64_t count(RunKind kind) const {
    return counts_[static_cast<int>(kind)].load(std::memory_order_relaxed);
  }
  // (reason, its kind's name) -> eager runs.
  std::map<std::pair<std::string, std::string>, int64_t> reasons() const;
  // The function record of one of its signatures (GraphedCallable::signatureFor()).
  void addSignature(int64_t function_id);
  std::vector<int64_t> signatures() const;
  const std::string& name() const { return name_; }
  int64_t callableId() const { return callable_id_; }

 private:
  void noteReason(const std::string& reason, ReasonKind why);
  void zero();
  bool counted() const;

  const std::string name_;
  const int64_t callable_id_;
  std::atomic<int64_t> counts_[4] = {};  // by RunKind
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, std::string>, int64_t> reasons_;
  std::vector<int64_t> signatures_;
};

}  // namespace graphtrees
