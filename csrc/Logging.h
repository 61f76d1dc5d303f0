#pragma once

// Log messages from the C++ core reach Python's `graphtrees` logger through one sink that the
// bindings install at import. The logger's threshold (the lowest level it would emit) is pushed
// by Python whenever a logger's level changes (logging's cache clearing), so a message below it
// costs one load and no Python: a compiled replay path ends at every call, and its DEBUG line
// must not cost a call into Python (found by the CUDA stand-in's benchmark).
//
// Note [No formatting nobody reads]
// Every message is logged through GRAPHTREES_LOG, which builds its text only when the threshold
// lets it through: a recording or a replay formats nothing while the logger is quiet (the
// default). Formatting on every recording is what crashed the first GPU run: an extension that
// carried a private copy of libstdc++'s locale code read a wrong facet at the first number
// formatted after a capture (../shared/reference/gpu-run-2026-12-04.md). That is fixed where it
// came from (the build and the import check, setup.py and graphtrees/_ext.py); this keeps text
// nobody reads off the hot path. messagesBuilt() counts the messages built, for the tests.

// Note [Logs outside the locks]
// A log line reaches the user's handlers (Python's logging), which may do anything: wait for
// another thread, call graphtrees. A thread that holds one of the locks around a tree (a tree
// lock, a device lock: Note [Locks around user code] in cuda/DeviceLock.h) does not emit: its
// lines wait in a queue of the thread's own and are emitted, in order, once it holds none of them
// (it lets go of the last, or lends it out around the user's code) -- as the registry emits its
// lines outside its mutex (TreeRegistry.cpp). The locks count themselves with holdLogs() and
// releaseLogs(), once per lock the thread comes to hold and lets go of.

#include <cstdint>
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
// Emits `message` (already built): call it through GRAPHTREES_LOG, never directly.
void logMessage(LogLevel level, const std::string& message);
// The calling thread comes to hold / lets go of a lock around a tree (Note [Logs outside the
// locks]); the last releaseLogs() emits the lines held back.
void holdLogs();
void releaseLogs();
// How many messages GRAPHTREES_LOG has built since the process started.
int64_t messagesBuilt();

// "1.5 MiB", "12.0 KiB", "512 B", for messages.
std::string bytesString(int64_t n);

#define GRAPHTREES_LOG(level, message)              \
  do {                                              \
    if (::graphtrees::logEnabled(level)) {          \
      ::graphtrees::logMessage((level), (message)); \
    }                                               \
  } while (0)

}  // namespace graphtrees
