#pragma once

// When a tree's current path ends: steps (mark_step_begin), generations, forwards waiting for
// their backward, and the chain limit of a function fed its own outputs. The tree manager asks
// before each call and tells it what ran; ending the path (invalidating the step's outputs) stays
// the tree's. Notes [Ending a path] and [Pending backward].

#include "FunctionRecord.h"
#include "ThreadState.h"

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace graphtrees {

// Why a path ends, put into words only when a message needs them: a call that ends the path is
// every call of a training loop or a server (Note [Ending a path]), and the words cost
// allocations that its replay would otherwise not make (issue 50: the host cost).
struct PathEnd {
  enum class Kind { kText, kNewTrainingStep, kCalledAgain, kChainLimit };
  // A fixed reason (a string literal: it is not copied).
  PathEnd(const char* text) : text_(text) {}  // NOLINT(google-explicit-constructor)
  PathEnd(Kind kind, const FunctionRecord& fn, int limit = 0)
      : kind_(kind), fn_(&fn), limit_(limit) {}
  // The reason, for a log line or an invalidated output's error. Only while `fn` lives.
  std::string text() const;

 private:
  Kind kind_ = Kind::kText;
  const char* text_ = nullptr;
  const FunctionRecord* fn_ = nullptr;
  int limit_ = 0;
};

class PathPolicy {
 public:
  // `steps`: the owning thread's step counter (Note [Steps, generations and threads]).
  explicit PathPolicy(StepCounter steps) : steps_(std::move(steps)), seen_step_(steps_->load()) {}

  const StepCounter& steps() const { return steps_; }
  // The index of the current path; outputs carry the generation they were made in.
  int64_t generation() const { return generation_; }
  bool pendingBackward() const { return pending_forwards_ > 0; }
  // This tree's state of callable `callable_id` (entries are never erased).
  CallableState& callableState(int64_t callable_id) { return callables_[callable_id]; }

  // Why the path ends before this call because the thread began a new step since the last call,
  // if it did.
  std::optional<PathEnd> stepBegan();
  // Why the path ends before this call of `fn`, if it must (Note [Ending a path]): it already ran
  // in this generation and is called on fresh inputs, or it reached its chain_limit, or a forward
  // ran too often while its backward was pending; or it is a forward on fresh inputs after the
  // step's backwards finished (Note [Pending backward]). `consumes_generation_output`: an input
  // is an output of this generation.
  std::optional<PathEnd> calledAgain(const FunctionRecord& fn, bool consumes_generation_output);

  // `fn` ran in the current generation (warmup, recording or replay).
  void noteRun(const FunctionRecord& fn);
  // A call of `fn` finished as `kind` (Note [Pending backward]).
  void noteFinished(const FunctionRecord& fn, RunKind kind);
  // The tree ended its path: a new generation begins.
  void pathEnded();

 private:
  const StepCounter steps_;
  int64_t seen_step_;
  int64_t generation_ = 0;
  // A forward ran and its backward has not run yet: no new generation starts on its own.
  int64_t pending_forwards_ = 0;
  // Backwards closed every pending forward of this generation: the training step is over.
  bool backwards_done_ = false;
  std::unordered_map<int64_t, CallableState> callables_;  // by callable id; never erased
  std::unordered_set<std::string> warned_;                // once-logged warnings
};

}  // namespace graphtrees
