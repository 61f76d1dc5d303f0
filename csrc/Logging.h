#pragma once

// Log messages from the C++ core reach Python's `graphtrees` logger through one sink that the
// bindings install at import. Only rare events are logged (warmup, recording, restores, fallbacks,
// invalidations): never anything on the replay fast path.

#include <functional>
#include <string>

namespace graphtrees {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30 };

using LogSink = std::function<void(LogLevel, const std::string&)>;

void setLogSink(LogSink sink);
void logMessage(LogLevel level, const std::string& message);

}  // namespace graphtrees
