#include "DrawnGenerators.h"

#include <ATen/core/ivalue.h>

#include <algorithm>

namespace graphtrees {

// Note [Generators a function reaches itself]
// A replay advances the generators its graph registered before the capture (Note [Generators and
// captures] in cuda/CudaGraph.cpp). Those passed as arguments are known from the call; one the
// function reaches itself (a closure, a module attribute: `torch.rand(n, generator=self.gen)`)
// is not. torch >= 2.12 registers such a generator with the capturing graph at its first draw;
// torch 2.11 refuses the draw ("Attempt to increase offset for a CUDA generator not in capture
// mode"), so the function ran eagerly there. Every recording follows a warmup on the same
// thread, and random ops take their generator as an argument (`Generator? generator`), so the
// warmup notes the generators its ops drew from and the recording registers them too. A
// generator first reached during the capture itself is still refused on 2.11 (the function
// runs eagerly, with that reason). Weak references: a noted generator is not kept alive.
DrawnGenerators::DrawnGenerators(std::optional<c10::DeviceType> type,
                                 std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>>* seen)
    : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/false}), type_(type), seen_(seen) {
  startWatching();
}

DrawnGenerators::~DrawnGenerators() {
  stopWatching();
}

Descend DrawnGenerators::onStart(const ObservedOp& op, int /*level*/) {
  for (const c10::IValue& v : op.fn.inputs()) {
    if (!v.isGenerator()) continue;
    at::Generator gen = v.toGenerator();
    if (!gen.defined() || (type_ && gen.device().type() != *type_)) continue;
    c10::GeneratorImpl* impl = gen.unsafeGetGeneratorImpl();
    const bool known = std::any_of(seen_->begin(), seen_->end(), [&](const auto& weak) {
      return weak._unsafe_get_target() == impl && !weak.expired();
    });
    if (!known) seen_->emplace_back(gen.getIntrusivePtr());
  }
  return Descend::kNested;
}

std::vector<at::Generator> DrawnGenerators::alive(
    const std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>>& seen) {
  std::vector<at::Generator> out;
  for (const auto& weak : seen) {
    if (auto strong = weak.lock()) out.emplace_back(std::move(strong));
  }
  return out;
}

}  // namespace graphtrees
