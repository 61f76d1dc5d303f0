#include "cpu/ControlFlowCapture.h"

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
thread_local std::vector<RngStates> tls_rng;

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
  if (event == "hold_rng") {
    TORCH_INTERNAL_ASSERT(first.size() == 1);
    RouteSuspended outside_the_pool;  // graphtrees' copy of the state
    tls_rng.emplace_back(std::vector<at::Generator>{defaultGenerator(first[0])});
    return r != nullptr;
  }
  if (event == "restore_rng") {
    TORCH_INTERNAL_ASSERT(!tls_rng.empty(), "graphtrees: an RNG restore without a hold");
    tls_rng.back().restore();
    tls_rng.pop_back();
    return r != nullptr;
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
