#pragma once

// The one RecordFunction observer of a warmup, a capture or a re-run (Note [One capture
// observer]), and its plug-ins, the watchers: what a watcher is shown of each op, and what it asks
// of the ops that op calls. One concept, one room.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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

// Note [One capture observer]
// What graphtrees must know of the ops a function dispatches while it warms up or is recorded is
// known through RecordFunction, by watchers (CaptureWatcher, above): InputMutationCheck (writes to
// inputs), PlaceholderViewCheck (views beyond a copied input), DrawnGenerators (generators a
// warmup drew from), and on the CPU backend HostSyncWatch (host reads) and ProgramRecorder (the
// op program); CollectiveBuffers watches a CPU Python replay. One CaptureObserver per thread
// holds the thread's one RecordFunction callback for all of them: an op is boxed once and counted
// once, and each watcher it concerns is handed it in turn.
//   - The callback is registered when the first watcher attaches, asking for inputs and outputs
//     only where an attached watcher needs them (re-registered when a later one needs more), and
//     removed when the last one leaves: nothing is observed where nothing watches. A warmup's and
//     a capture's observer watch for forks (below) from the start, and keep their callback.
//   - One depth rule. The observer keeps a frame per open op. A watcher is shown an op when it
//     was shown every op around it and asked, of each, to be shown the ops it calls
//     (Descend::kNested or kSeeThrough); its level is the number of those it asked kNested of.
//     So ProgramRecorder is shown every op, records those at level 0 and sees through composite
//     ops (Note [Composite ops are recorded decomposed]); PlaceholderViewCheck is shown the
//     top-level ops and the ops a library op (not aten::) calls, not those of ATen's kernels
//     (Note [Views beyond a copied input]); HostSyncWatch is not shown what _assert_async calls;
//     the others are shown everything. A watcher attached while ops are open is shown the ops
//     that start after it, those the innermost open op calls included (at level 0; not that
//     op's end).
//   - RecordFunction switched off on the thread (torch._C._autograd._enable_record_function(
//     False), at::enableRecordFunction(false)) is the user's choice, never overridden. Nothing is
//     then observed, so a function is neither warmed up nor recorded while it is off: the call
//     runs eagerly with blindReason(), and once it is on again the function is warmed up and
//     recorded as usual (a replay needs no observer). A function that switches it off itself is
//     found off after its warmup or capture (refusal()): it runs eagerly from then on. A CPU Python
//     replay of a function with collectives needs it on to tell their buffers (Note [Collective
//     buffers]) and says so.
//   - Work forked onto another thread (torch.jit.fork in TorchScript, run on an interop thread)
//     is seen by no watcher: a recording would replay without it, and the values it wrote would
//     be the recording's ever after. at::launch carries the thread's RecordFunction callbacks to
//     the forked task, so the observer's callback runs there, on a thread where it is not the
//     observer: a TorchScript frame starting there marks the observer forked(), and the tree
//     refuses to record the function (it runs eagerly, with forkedReason()). To tell which
//     observer the callback belongs to, each observer registers one of kForkSlots callbacks of
//     its own (the slot's number is in the function); observers past kForkSlots share one more,
//     and a fork under any of them marks them all. A forked task still running after its
//     observer ended marks the next observer of its slot: that recording is refused too.
struct SlotCallbacks;

class CaptureObserver {
 public:
  // This thread's observer until it is destroyed (the previous one, if any, comes back then).
  // `watch_forks`: its callback is registered from the start, watchers or not, so that forked()
  // can tell (a warmup, a capture).
  explicit CaptureObserver(bool watch_forks = false);
  ~CaptureObserver();
  CaptureObserver(const CaptureObserver&) = delete;
  CaptureObserver& operator=(const CaptureObserver&) = delete;

  // The observer open on this thread, or nullptr.
  static CaptureObserver* current();
  // Whether RecordFunction is switched off on this thread: no watcher would see anything.
  static bool blind();
  // Why a function is not warmed up or recorded now (blind()), or empty.
  static std::string blindReason();
  // Whether work of this observer's thread ran forked onto another thread while it lived.
  bool forked() const;
  // Why what this observer saw cannot be recorded: the first refusal a watcher reported
  // (PlaceholderViewCheck's), forked(), or blind() now (the function switched RecordFunction off),
  // or empty.
  std::string refusal() const;
  // Refuses what this thread's observer, if any, is watching: what the Python layer finds that no
  // op shows (torch.cond on a backend without its control steps). False without an observer.
  static bool refuseCurrent(const std::string& why);

  static constexpr int kMaxWatchers = 8;
  static constexpr int kForkSlots = 32;

 private:
  friend class CaptureWatcher;
  friend struct SlotCallbacks;  // the callbacks of each slot
  void attach(CaptureWatcher* w);
  void detach(CaptureWatcher* w);
  void registerCallback(CaptureWatcher::Needs needs);
  void refuse(const std::string& why) {
    if (refusal_.empty()) refusal_ = why;
  }
  void start(const at::RecordFunction& fn);
  void end(const at::RecordFunction& fn);
  template <int Slot>
  static std::unique_ptr<at::ObserverContext> onStart(const at::RecordFunction& fn);
  template <int Slot>
  static void onEnd(const at::RecordFunction& fn, at::ObserverContext* ctx);

  struct Frame {
    uint8_t shown = 0;        // the watchers shown this op (bit per watcher index)
    uint8_t descend = 0;      // those shown the ops it calls
    uint8_t see_through = 0;  // those of `descend` that asked kSeeThrough
    std::array<int32_t, kMaxWatchers> level{};  // per watcher: the level of the ops it calls
  };
  std::array<CaptureWatcher*, kMaxWatchers> watchers_{};
  uint8_t attached_ = 0;
  std::vector<Frame> frames_;
  int slot_;
  bool watch_forks_;
  std::optional<at::CallbackHandle> handle_;
  CaptureWatcher::Needs registered_;
  std::string refusal_;
  CaptureObserver* prev_;
};

}  // namespace graphtrees
