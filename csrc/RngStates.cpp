#include "RngStates.h"

#include <mutex>

namespace graphtrees {

RngStates::RngStates(const std::vector<at::Generator>& generators) {
  for (const auto& g : generators) add(g);
}

void RngStates::add(const at::Generator& generator) {
  at::Generator g = generator;  // a handle: the copy reads the same generator
  std::lock_guard<std::mutex> lock(g.mutex());
  states_.emplace_back(g, g.get_state());
}

bool RngStates::has(const at::Generator& generator) const {
  for (const auto& s : states_) {
    if (s.first == generator) return true;
  }
  return false;
}

void RngStates::append(const RngStates& later) {
  states_.insert(states_.end(), later.states_.begin(), later.states_.end());
}

std::vector<at::Generator> RngStates::generators() const {
  std::vector<at::Generator> out;
  out.reserve(states_.size());
  for (const auto& s : states_) out.push_back(s.first);
  return out;
}

void RngStates::restore() const {
  for (auto s : states_) {  // a Generator is a handle: the copy sets the generator's state
    std::lock_guard<std::mutex> lock(s.first.mutex());
    s.first.set_state(s.second);
  }
}

}  // namespace graphtrees
