#include "Logging.h"

#include <atomic>
#include <cstdio>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

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

// Note [Logs outside the locks]: the locks the thread holds, and the lines held back meanwhile.
thread_local int t_locks_held = 0;
thread_local std::vector<std::pair<LogLevel, std::string>> t_held_lines;

void emit(LogLevel level, const std::string& message) {
  LogSink s;
  {
    std::lock_guard<std::mutex> lock(sinkMutex());
    s = sink();
  }
  if (s) s(level, message);
}
}  // namespace

void holdLogs() {
  t_locks_held++;
}

void releaseLogs() {
  if (t_locks_held > 0) t_locks_held--;
  if (t_locks_held > 0 || t_held_lines.empty()) return;
  std::vector<std::pair<LogLevel, std::string>> lines;
  lines.swap(t_held_lines);
  for (const auto& [level, message] : lines) {
    try {  // called where a lock is let go of, destructors included: nothing may escape
      if (logEnabled(level)) emit(level, message);
    } catch (const std::exception&) {
    }
  }
}

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
  if (t_locks_held > 0) {
    t_held_lines.emplace_back(level, message);
    return;
  }
  emit(level, message);
}

std::string bytesString(int64_t n) {
  // snprintf, not a stream: no locale is involved (Note [No formatting nobody reads]).
  char buf[48];
  if (n >= (1 << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(n) / (1 << 20));
  } else if (n >= 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", static_cast<double>(n) / 1024);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(n));
  }
  return buf;
}

}  // namespace graphtrees
