#include "CallStats.h"

#include <algorithm>

namespace graphtrees {

namespace {
std::mutex& listMutex() {
  static std::mutex m;
  return m;
}
std::vector<std::shared_ptr<CallStats>>& list() {
  static auto* l = new std::vector<std::shared_ptr<CallStats>>();  // outlives every callable
  return *l;
}
}  // namespace

std::shared_ptr<CallStats> CallStats::create(const std::string& name, int64_t callable_id) {
  auto stats = std::make_shared<CallStats>(name, callable_id);
  std::lock_guard<std::mutex> lock(listMutex());
  list().push_back(stats);
  return stats;
}

std::vector<std::shared_ptr<CallStats>> CallStats::all() {
  std::lock_guard<std::mutex> lock(listMutex());
  return list();
}

void CallStats::resetAll() {
  std::lock_guard<std::mutex> lock(listMutex());
  auto& l = list();
  l.erase(std::remove_if(l.begin(), l.end(), [](const auto& s) { return s.use_count() == 1; }),
          l.end());
  for (const auto& s : l) s->zero();
}

std::map<std::string, int64_t> CallStats::reasons() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reasons_;
}

void CallStats::noteReason(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  reasons_[reason.empty() ? std::string("(no reason given)") : reason]++;
}

void CallStats::zero() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  reasons_.clear();
}

}  // namespace graphtrees
