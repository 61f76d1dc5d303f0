#pragma once

// A plug-in of the capture observer (Note [One capture observer] in CaptureObserver.h): what it
// is shown of each op, and what it asks of the ops that op calls.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <memory>
#include <optional>

namespace graphtrees {

class CaptureObserver;

// One op as the observer hands it to its watchers: the RecordFunction (its inputs boxed once, its
// outputs at its end where a watcher needs them) and its dispatcher entry, looked up at most once
// for all the watchers that ask.
class ObservedOp {
 public:
  explicit ObservedOp(const at::RecordFunction& fn) : fn(fn) {}
  const at::RecordFunction& fn;
  // The op's dispatcher entry (its schema, its kernels), or nullopt for a RecordFunction that
  // names no registered op.
  const std::optional<c10::OperatorHandle>& handle() const;
  // Whether the RecordFunction names an operator (registered or not).
  bool named() const;

 private:
  mutable bool looked_up_ = false;
  mutable bool named_ = false;
  mutable std::optional<c10::OperatorHandle> handle_;
};

// What a watcher asks, when it is shown an op, of the ops that op calls.
enum class Descend : uint8_t {
  kNo,          // not shown to this watcher
  kNested,      // shown, one level below this op
  kSeeThrough,  // shown at this op's own level: its calls stand for it
};

class CaptureWatcher {
 public:
  struct Needs {
    bool inputs = false;   // the ops' arguments (RecordFunction boxes them)
    bool outputs = false;  // the ops' results, at their end
  };
  virtual ~CaptureWatcher();
  CaptureWatcher(const CaptureWatcher&) = delete;
  CaptureWatcher& operator=(const CaptureWatcher&) = delete;

  // An op starts. `level`: the ops around it that this watcher was shown and asked kNested of (0:
  // the watched code called it).
  virtual Descend onStart(const ObservedOp& op, int level) = 0;
  // An op this watcher was shown ends (`chosen`: what its onStart returned).
  virtual void onEnd(const ObservedOp& /*op*/, int /*level*/, Descend /*chosen*/) {}

 protected:
  explicit CaptureWatcher(Needs needs);
  // Starts watching this thread's ops: through the thread's open observer, or one of its own
  // where none is open. A derived class calls stopWatching() first thing in its destructor.
  void startWatching();
  void stopWatching();
  // Reports to the observer why the capture it watches cannot be recorded (the first one counts).
  void refuseRecording(const std::string& why);

 private:
  friend class CaptureObserver;
  Needs needs_;
  CaptureObserver* observer_ = nullptr;  // set while attached
  int index_ = -1;                       // its place among the observer's watchers
  std::unique_ptr<CaptureObserver> own_;
};

}  // namespace graphtrees
