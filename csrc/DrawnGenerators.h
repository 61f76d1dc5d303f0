#pragma once

// The generators of one device type that a function's ops draw from while it runs, on the
// calling thread: noted during a warmup, so that its recording registers them with the graph
// (Note [Generators a function reaches itself]).

#include "CaptureObserver.h"

#include <ATen/core/Generator.h>
#include <c10/core/DeviceType.h>
#include <c10/util/intrusive_ptr.h>

#include <optional>
#include <vector>

namespace graphtrees {

// A watcher of the capture observer (Note [One capture observer] in CaptureObserver.h), shown
// every op, nested ones included.
class DrawnGenerators : public CaptureWatcher {
 public:
  // Starts noting the generators on `type` (any device: nullopt) that ops take as an argument,
  // into `seen` (weak references, no duplicates; `seen` may already hold some).
  DrawnGenerators(std::optional<c10::DeviceType> type,
                  std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>>* seen);
  ~DrawnGenerators() override;
  DrawnGenerators(const DrawnGenerators&) = delete;
  DrawnGenerators& operator=(const DrawnGenerators&) = delete;

  // The generators of `seen` that are still alive.
  static std::vector<at::Generator> alive(
      const std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>>& seen);

 private:
  Descend onStart(const ObservedOp& op, int level) override;

  std::optional<c10::DeviceType> type_;
  std::vector<c10::weak_intrusive_ptr<c10::GeneratorImpl>>* seen_;
};

}  // namespace graphtrees
