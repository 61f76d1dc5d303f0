#include "Logging.h"

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
}  // namespace

void setLogSink(LogSink s) {
  std::lock_guard<std::mutex> lock(sinkMutex());
  sink() = std::move(s);
}

void logMessage(LogLevel level, const std::string& message) {
  LogSink s;
  {
    std::lock_guard<std::mutex> lock(sinkMutex());
    s = sink();
  }
  if (s) s(level, message);
}

}  // namespace graphtrees
