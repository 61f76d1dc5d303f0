#include "cpu/ControlFlowCapture.h"

#include "CaptureObserver.h"
#include "DrawnGenerators.h"
#include "RngStates.h"
#include "cpu/OpProgram.h"
#include "cpu/ProgramRecorder.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <memory>

namespace graphtrees {

namespace {

struct Paused {
  RouteSuspended route;  // a loop's later iterations allocate outside the pool
  ProgramRecorder* recorder;
};
thread_local std::vector<std::unique_ptr<Paused>> tls_paused;

// Note [Generators an untaken arm draws from]
// An untaken arm's draws must not count (Note [Control flow in a recording]): the device's
// default generator is put back after it, and so is any generator one of its ops takes as an
// argument (a torch.Generator of the user's, reached through a closure), whose state is taken
// when an op first takes it, before it draws (review of issue 48).
class HeldGenerators : public CaptureWatcher {
 public:
  explicit HeldGenerators(const at::Generator& default_generator)
      : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/false}) {
    hold(default_generator);
    startWatching();
  }
  ~HeldGenerators() override { stopWatching(); }
  HeldGenerators(const HeldGenerators&) = delete;
  HeldGenerators& operator=(const HeldGenerators&) = delete;
  void restore() {
    stopWatching();
    states_.restore();
  }

 private:
  Descend onStart(const ObservedOp& op, int /*level*/) override {
    for (const c10::IValue& v : op.fn.inputs()) {
      if (v.isGenerator()) hold(v.toGenerator());
    }
    return Descend::kNested;
  }
  void hold(const at::Generator& gen) {
    if (!gen.defined() || states_.has(gen)) return;
    RouteSuspended outside_the_pool;  // graphtrees' copy of the state
    states_.add(gen);
  }
  RngStates states_;
};
thread_local std::vector<std::unique_ptr<HeldGenerators>> tls_rng;

// Whether an arm's ops took a generator of their own as an argument (a CUDA conditional body
// cannot hold its draws: torch >= 2.12 refuses them, and graphtrees' own capture on 2.11 would
// advance it on every replay, whichever branch ran). Draws from the default generator pass none:
// graphtrees._control_flow._Draws reads its offset.
struct TakenGenerators {
  std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>> taken;
  DrawnGenerators watch{std::nullopt, &taken};  // generators of any device
};
thread_local std::vector<std::unique_ptr<TakenGenerators>> tls_taken;

at::Generator defaultGenerator(const at::Tensor& on) {
  if (on.device().is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(on.device());
}

}  // namespace

bool cpuControlFlowEvent(const std::string& event, const std::vector<at::Tensor>& first,
                         const std::vector<at::Tensor>& second) {
  ProgramRecorder* r = ProgramRecorder::current();
  if (event == "pause") {
    tls_paused.push_back(std::make_unique<Paused>());
    tls_paused.back()->recorder = r;
    if (r != nullptr) r->pause(true);
    return r != nullptr;
  }
  if (event == "resume") {
    TORCH_INTERNAL_ASSERT(!tls_paused.empty(), "graphtrees: a resume without a pause");
    if (tls_paused.back()->recorder != nullptr) tls_paused.back()->recorder->pause(false);
    tls_paused.pop_back();
    return r != nullptr;
  }
  if (event == "hold_rng") {  // Note [Generators an untaken arm draws from]
    TORCH_INTERNAL_ASSERT(first.size() == 1);
    tls_rng.push_back(std::make_unique<HeldGenerators>(defaultGenerator(first[0])));
    return r != nullptr;
  }
  if (event == "restore_rng") {
    TORCH_INTERNAL_ASSERT(!tls_rng.empty(), "graphtrees: an RNG restore without a hold");
    tls_rng.back()->restore();
    tls_rng.pop_back();
    return r != nullptr;
  }
  if (event == "watch_generators") {
    tls_taken.push_back(std::make_unique<TakenGenerators>());
    return r != nullptr;
  }
  if (event == "generators_taken") {
    TORCH_INTERNAL_ASSERT(!tls_taken.empty(), "graphtrees: generators_taken without a watch");
    const bool taken = !tls_taken.back()->taken.empty();
    tls_taken.pop_back();
    return taken;
  }
  // A cond inside a loop's later iterations is not recorded either.
  if (r == nullptr || r->paused()) return false;
  if (event == "begin_cond") {
    TORCH_INTERNAL_ASSERT(first.size() == 1);
    r->beginCond(first[0]);
  } else if (event == "begin_while_loop") {
    r->beginWhileLoop(first);
  } else if (event == "next_arm") {
    r->nextArm();
  } else if (event == "end_cond") {
    r->endCond(first, second);
  } else if (event == "end_while_loop") {
    TORCH_INTERNAL_ASSERT(first.size() == 1);
    r->endWhileLoop(first[0], second);
  } else {
    TORCH_CHECK(false, "graphtrees: unknown control-flow event '", event, "'");
  }
  return true;
}

bool cpuControlFlowPredicate(const at::Tensor& pred) {
  return readPredicate(pred);
}

}  // namespace graphtrees
