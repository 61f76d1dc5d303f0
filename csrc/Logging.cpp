#include "Logging.h"

#include <atomic>
#include <mutex>

namespace graphtrees {

namespace {
std::mutex& sinkMutex() {
  static std::mutex m;
  return m;
}
LogSink& sink() {
  static auto* s = new LogSink();  // never destroyed: logging may happen at shutdown
  return *s;
}
std::atomic<int> g_threshold{0};
std::atomic<int64_t> g_built{0};
}  // namespace

void setLogThreshold(int level) {
  g_threshold.store(level, std::memory_order_relaxed);
}

bool logEnabled(LogLevel level) {
  return static_cast<int>(level) >= g_threshold.load(std::memory_order_relaxed);
}

void setLogSink(LogSink s) {
  std::lock_guard<std::mutex> lock(sinkMutex());
  sink() = std::move(s);
}

int64_t messagesBuilt() {
  return g_built.load(std::memory_order_relaxed);
}

void logMessage(LogLevel level, const std::string& message) {
  g_built.fetch_add(1, std::memory_order_relaxed);
  if (!logEnabled(level)) return;  // the threshold rose while the message was built
  LogSink s;
  {
    std::lock_guard<std::mutex> lock(sinkMutex());
    s = sink();
  }
  if (s) s(level, message);
}

}  // namespace graphtrees
