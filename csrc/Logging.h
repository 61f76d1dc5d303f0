#pragma once

// Log messages from the C++ core reach Python's `graphtrees` logger through one sink that the
// bindings install at import. The logger's threshold (the lowest level it would emit) is pushed
// by Python whenever a logger's level changes (logging's cache clearing), so a message below it
// costs one load and no Python: a compiled replay path ends at every call, and its DEBUG line
// must not cost a call into Python (found by the CUDA stand-in's benchmark).

#include <functional>
#include <string>

namespace graphtrees {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30 };

using LogSink = std::function<void(LogLevel, const std::string&)>;

void setLogSink(LogSink sink);
// The lowest level Python's logger emits now (set by the Python layer; 0: all).
void setLogThreshold(int level);
// Whether a message at `level` would be emitted: build it only then.
bool logEnabled(LogLevel level);
void logMessage(LogLevel level, const std::string& message);

}  // namespace graphtrees
