#include "PathPolicy.h"

#include "Logging.h"

#include <algorithm>

namespace graphtrees {

namespace {

// While a backward is pending, how often one callable may run on fresh inputs in one step (e.g.
// micro-batches before their backward) before a new step is forced.
constexpr int kMaxPendingRuns = 64;

}  // namespace

std::string PathEnd::text() const {
  switch (kind_) {
    case Kind::kText:
      return text_;
    case Kind::kNewTrainingStep:
      return "'" + fn_->name + "' began a new training step (the last one's backward finished)";
    case Kind::kCalledAgain:
      return "'" + fn_->name + "' was called again";
    case Kind::kChainLimit:
      return "'" + fn_->name + "' was called again on an output of its own step more than " +
             "chain_limit=" + std::to_string(limit_) +
             " times (raise chain_limit, or keep the outputs with on_overwrite='copy' or "
             ".clone())";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PathEnd kind");
}

std::optional<PathEnd> PathPolicy::stepBegan() {
  const int64_t step = steps_->load();
  if (C10_LIKELY(step == seen_step_)) return std::nullopt;
  seen_step_ = step;
  return PathEnd("graphtrees.mark_step_begin() was called");
}

// Note [Ending a path]
// A path ends when a new step begins (mark_step_begin(), or a function that already ran in this
// generation is called again on inputs that do not come from this generation), or when every
// output of the path is dead. Outputs of the ending generation that own pool blocks (outputs of
// warmups and recordings, and outputs that a restore gave ownership) are freed then, so that the
// next step can reuse their memory, and invalidated: as in PyTorch's trees, the previous step's
// pool outputs are the next step's scratch memory. The current call's own inputs are spared.
// Replayed outputs own nothing; they stay valid until a later replay or restore really reuses
// their memory (TreeManager::replay() and PoolBookkeeping). A function called again on an output
// of its own step extends the path (an unrolled loop); after chain_limit runs the path restarts
// instead, so that a feedback loop `h = f(h)` reuses a bounded chain of recordings rather than
// recording forever.
//
// Note [Pending backward]
// In training, a forward function's outputs include the activations its backward will read. While
// a forward has run and its backward has not, no new generation starts on its own (a new step
// would free those activations): calling the forward again extends the path, which is how several
// micro-batches' forwards run before their backwards. A backward clears the state.
// mark_step_begin() still starts a new step. A forward whose backward never runs (evaluation
// under grad mode, say) extends the path at most kMaxPendingRuns times; then a warning says
// what to do and a new step starts anyway. A graph split into pieces (Note [Piecewise graphs] in
// graphtrees/_piecewise.py) counts once: its first recorded forward piece opens the pending
// backward and its last recorded backward piece closes it (the others have counts_pending off).
// When the backwards have closed every pending forward, the training step is over: the next
// forward called on fresh inputs starts a new generation, as PyTorch's trees do, so that each
// step replays the same path (forward, backward) rather than the next forward extending the path
// under the backward whose gradients are still alive.
std::optional<PathEnd> PathPolicy::calledAgain(const FunctionRecord& fn,
                                               bool consumes_generation_output) {
  if (backwards_done_ && fn.mode == FunctionMode::kForward && fn.counts_pending &&
      !consumes_generation_output) {
    return PathEnd(PathEnd::Kind::kNewTrainingStep, fn);
  }
  const CallableState& callable = callableState(fn.callable_id);
  if (callable.last_generation != generation_) return std::nullopt;
  const bool fresh = !consumes_generation_output;
  const PathEnd again(PathEnd::Kind::kCalledAgain, fn);
  if (pending_forwards_ > 0) {
    if (!fresh || callable.runs_in_generation < kMaxPendingRuns) return std::nullopt;
    if (warned_.insert("pending\n" + fn.name).second) {
      GRAPHTREES_LOG(
          LogLevel::kWarning,
          "'" + fn.name + "' ran " + std::to_string(callable.runs_in_generation) +
              " times in one step while a forward's backward was pending; starting a new "
              "step anyway, which frees the pending forwards' activations. Call "
              "backward() before running forwards that many times, run evaluation under "
              "torch.no_grad(), or call graphtrees.mark_step_begin() at the start of each "
              "step.");
    }
    return again;
  }
  if (fresh) return again;
  const int limit = fn.options->chain_limit;
  if (callable.runs_in_generation < limit) return std::nullopt;
  if (warned_.insert("chain\n" + fn.name).second) {
    GRAPHTREES_LOG(
        LogLevel::kInfo,
        "'" + fn.name + "' consumed its own outputs " +
            std::to_string(callable.runs_in_generation) +
            " times in one step, as a decode loop does; this is expected: from now on a new "
            "step starts every chain_limit=" +
            std::to_string(limit) +
            " such calls, which keeps the tree's depth and memory bounded and releases the "
            "older outputs of the chain (raise chain_limit to keep more, or use "
            "on_overwrite='copy' to keep them valid)");
  }
  return PathEnd(PathEnd::Kind::kChainLimit, fn, limit);
}

void PathPolicy::noteRun(const FunctionRecord& fn) {
  CallableState& c = callableState(fn.callable_id);
  if (c.last_generation != generation_) {
    c.last_generation = generation_;
    c.runs_in_generation = 0;
  }
  c.runs_in_generation++;
}

void PathPolicy::noteFinished(const FunctionRecord& fn, RunKind kind) {
  if (!fn.counts_pending) return;  // a piece of a split graph that another piece speaks for
  // A forward that ran eagerly saved nothing in the pool: no backward waits on this path.
  if (fn.mode == FunctionMode::kForward && kind != RunKind::kEager) {
    pending_forwards_++;
    backwards_done_ = false;
  } else if (fn.mode == FunctionMode::kBackward) {
    // Its forward may be on an earlier path (the path ended when the forward's outputs died).
    pending_forwards_ = std::max<int64_t>(0, pending_forwards_ - 1);
    backwards_done_ = pending_forwards_ == 0;
  }
}

void PathPolicy::pathEnded() {
  pending_forwards_ = 0;
  backwards_done_ = false;
  generation_++;
}

}  // namespace graphtrees
