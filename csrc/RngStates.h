#pragma once

// Generator states taken now and put back later: a verified replay's eager run (Verifier) and the
// CPU program's completeness proof (cpu/CpuGraph.cpp) start from the RNG a run started from.

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace graphtrees {

class RngStates {
 public:
  RngStates() = default;
  // The states of `generators` now.
  explicit RngStates(const std::vector<at::Generator>& generators);
  // Adds `generator`'s state now.
  void add(const at::Generator& generator);
  bool has(const at::Generator& generator) const;
  // Adds `later`'s states after these (a generator in both gets `later`'s state on restore()).
  void append(const RngStates& later);
  std::vector<at::Generator> generators() const;
  // Sets every generator to its state, in order.
  void restore() const;

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> states_;
};

}  // namespace graphtrees
