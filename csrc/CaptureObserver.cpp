#include "CaptureObserver.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <utility>

namespace graphtrees {

namespace {

thread_local CaptureObserver* tls_observer = nullptr;

constexpr int kSharedSlot = CaptureObserver::kForkSlots;  // for observers past kForkSlots

// Per slot: whether a forked task of its observer's thread ran (Note [One capture observer]).
std::array<std::atomic<bool>, CaptureObserver::kForkSlots + 1> g_forked{};

std::mutex& slotsMutex() {
  static std::mutex m;
  return m;
}
std::array<bool, CaptureObserver::kForkSlots>& slotsTaken() {
  static std::array<bool, CaptureObserver::kForkSlots> taken{};
  return taken;
}
int g_shared_users = 0;  // observers on kSharedSlot now, under slotsMutex()

int takeSlot() {
  std::lock_guard<std::mutex> lock(slotsMutex());
  auto& taken = slotsTaken();
  for (int s = 0; s < CaptureObserver::kForkSlots; ++s) {
    if (!taken[s]) {
      taken[s] = true;
      g_forked[s].store(false, std::memory_order_relaxed);
      return s;
    }
  }
  // The shared slot's flag says a fork ran under one of the observers sharing it: each of them
  // then refuses its capture (they cannot tell whose it was). It starts clear for the first.
  if (g_shared_users++ == 0) g_forked[kSharedSlot].store(false, std::memory_order_relaxed);
  return kSharedSlot;
}

void giveSlot(int slot) {
  std::lock_guard<std::mutex> lock(slotsMutex());
  if (slot == kSharedSlot) {
    --g_shared_users;
  } else {
    slotsTaken()[slot] = false;
  }
}

}  // namespace

template <int Slot>
std::unique_ptr<at::ObserverContext> CaptureObserver::onStart(const at::RecordFunction& fn) {
  CaptureObserver* o = tls_observer;
  const bool mine = o != nullptr && o->slot_ == Slot;
  if (fn.scope() == at::RecordScope::FUNCTION) {
    if (mine) o->start(fn);
  } else if (!mine && fn.scope() == at::RecordScope::TORCHSCRIPT_FUNCTION) {
    // This callback was carried to a thread it does not observe: a forked TorchScript task.
    g_forked[Slot].store(true, std::memory_order_relaxed);
  }
  return nullptr;
}

template <int Slot>
void CaptureObserver::onEnd(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  CaptureObserver* o = tls_observer;
  if (o != nullptr && o->slot_ == Slot && fn.scope() == at::RecordScope::FUNCTION) o->end(fn);
}

namespace {
using StartFn = std::unique_ptr<at::ObserverContext> (*)(const at::RecordFunction&);
using EndFn = void (*)(const at::RecordFunction&, at::ObserverContext*);
}  // namespace

// The callbacks of each slot, kSharedSlot's last.
struct SlotCallbacks {
  template <size_t... S>
  static std::array<std::pair<StartFn, EndFn>, sizeof...(S)> make(std::index_sequence<S...>) {
    return {{{&CaptureObserver::onStart<static_cast<int>(S)>,
              &CaptureObserver::onEnd<static_cast<int>(S)>}...}};
  }
};

CaptureObserver::CaptureObserver(bool watch_forks)
    : slot_(takeSlot()), watch_forks_(watch_forks), prev_(tls_observer) {
  frames_.reserve(32);
  tls_observer = this;
  if (watch_forks_) registerCallback(registered_);
}

CaptureObserver::~CaptureObserver() {
  for (CaptureWatcher* w : watchers_) {
    if (w != nullptr) detach(w);
  }
  if (handle_) at::removeCallback(*handle_);
  tls_observer = prev_;
  giveSlot(slot_);
}

CaptureObserver* CaptureObserver::current() {
  return tls_observer;
}

bool CaptureObserver::blind() {
  return !at::isRecordFunctionEnabled();
}

std::string CaptureObserver::blindReason() {
  if (!blind()) return std::string();
  return "RecordFunction is switched off on this thread "
         "(torch._C._autograd._enable_record_function(False) or at::enableRecordFunction(false)), "
         "and graphtrees sees the ops a function dispatches through it while the function warms "
         "up and is recorded (Note [One capture observer]); graphtrees does not switch it on, and "
         "runs the function eagerly while it is off";
}

bool CaptureObserver::forked() const {
  return g_forked[slot_].load(std::memory_order_relaxed);
}

std::string CaptureObserver::refusal() const {
  if (!refusal_.empty()) return refusal_;
  if (!forked()) return blindReason();
  return "it forks work onto another thread (torch.jit.fork in TorchScript code), whose ops a "
         "recording does not see: a replay would not run them, and the values they wrote would "
         "stay the recording's (Note [One capture observer]). Call the TorchScript function "
         "outside the graphed function, or do the work without torch.jit.fork";
}

bool CaptureObserver::refuseCurrent(const std::string& why) {
  CaptureObserver* o = current();
  if (o == nullptr) return false;
  o->refuse(why);
  return true;
}

void CaptureObserver::registerCallback(CaptureWatcher::Needs needs) {
  static const auto callbacks =
      SlotCallbacks::make(std::make_index_sequence<CaptureObserver::kForkSlots + 1>());
  if (handle_) at::removeCallback(*handle_);
  const auto& [start_fn, end_fn] = callbacks[slot_];
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(start_fn, end_fn)
          .needsInputs(needs.inputs)
          .needsOutputs(needs.outputs)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::TORCHSCRIPT_FUNCTION}));
  registered_ = needs;
}

void CaptureObserver::attach(CaptureWatcher* w) {
  int index = 0;
  while (index < kMaxWatchers && watchers_[index] != nullptr) ++index;
  TORCH_INTERNAL_ASSERT(index < kMaxWatchers, "more than ", kMaxWatchers,
                        " watchers on one capture observer");
  watchers_[index] = w;
  attached_ |= static_cast<uint8_t>(1u << index);
  w->observer_ = this;
  w->index_ = index;
  // Attached inside an op (graphtrees/_control_flow.py watches an arm of a torch.cond for host
  // reads): shown the ops that op calls from now on, as if they were top-level; not its end.
  if (!frames_.empty()) {
    frames_.back().descend |= static_cast<uint8_t>(1u << index);
    frames_.back().level[index] = 0;
  }
  const CaptureWatcher::Needs needs{registered_.inputs || w->needs_.inputs,
                                    registered_.outputs || w->needs_.outputs};
  if (!handle_ || needs.inputs != registered_.inputs || needs.outputs != registered_.outputs) {
    registerCallback(needs);
  }
}

void CaptureObserver::detach(CaptureWatcher* w) {
  TORCH_INTERNAL_ASSERT(w->observer_ == this && watchers_[w->index_] == w);
  const auto keep = static_cast<uint8_t>(~(1u << w->index_));
  watchers_[w->index_] = nullptr;
  attached_ &= keep;
  for (Frame& f : frames_) {  // a later watcher in its place is not shown their ends
    f.shown &= keep;
    f.descend &= keep;
    f.see_through &= keep;
  }
  w->observer_ = nullptr;
  w->index_ = -1;
  if (attached_ == 0 && handle_ && !watch_forks_) {
    at::removeCallback(*handle_);
    handle_.reset();
    registered_ = {};
  }
}

void CaptureObserver::start(const at::RecordFunction& fn) {
  Frame parent;  // a copy: an op a watcher dispatches is observed too, and frames_ may move
  const bool top = frames_.empty();
  if (!top) parent = frames_.back();
  const uint8_t shown = top ? attached_ : parent.descend;
  const size_t at = frames_.size();
  frames_.emplace_back().shown = shown;  // first: a watcher that throws leaves the frames matched
  if (shown == 0) return;
  ObservedOp op(fn);
  for (int k = 0; k < kMaxWatchers; ++k) {
    const auto bit = static_cast<uint8_t>(1u << k);
    if ((shown & bit) == 0 || watchers_[k] == nullptr) continue;
    const int level = top ? 0 : parent.level[k];
    const Descend d = watchers_[k]->onStart(op, level);
    if (d == Descend::kNo) continue;
    Frame& mine = frames_[at];
    mine.descend |= bit;
    if (d == Descend::kSeeThrough) mine.see_through |= bit;
    mine.level[k] = d == Descend::kNested ? level + 1 : level;
  }
}

void CaptureObserver::end(const at::RecordFunction& fn) {
  if (frames_.empty()) return;  // it started before this observer's callback was registered
  const Frame f = frames_.back();
  frames_.pop_back();
  if (f.shown == 0) return;
  const Frame* parent = frames_.empty() ? nullptr : &frames_.back();
  ObservedOp op(fn);
  for (int k = 0; k < kMaxWatchers; ++k) {
    const auto bit = static_cast<uint8_t>(1u << k);
    if ((f.shown & bit) == 0 || watchers_[k] == nullptr) continue;
    const Descend chosen = (f.descend & bit) == 0       ? Descend::kNo
                           : (f.see_through & bit) != 0 ? Descend::kSeeThrough
                                                        : Descend::kNested;
    watchers_[k]->onEnd(op, parent != nullptr ? parent->level[k] : 0, chosen);
  }
}

// --- CaptureWatcher and ObservedOp ---
const std::optional<c10::OperatorHandle>& ObservedOp::handle() const {
  if (!looked_up_) {
    looked_up_ = true;
    if (const auto name = fn.operator_name()) {
      named_ = true;
      handle_ = c10::Dispatcher::singleton().findOp(*name);
    }
  }
  return handle_;
}

bool ObservedOp::named() const {
  handle();
  return named_;
}

CaptureWatcher::CaptureWatcher(Needs needs) : needs_(needs) {}

CaptureWatcher::~CaptureWatcher() {
  stopWatching();
}

void CaptureWatcher::startWatching() {
  if (observer_ != nullptr) return;
  CaptureObserver* o = CaptureObserver::current();
  if (o == nullptr) {
    own_ = std::make_unique<CaptureObserver>();
    o = own_.get();
  }
  o->attach(this);
}

void CaptureWatcher::refuseRecording(const std::string& why) {
  if (observer_ != nullptr) observer_->refuse(why);
}

void CaptureWatcher::stopWatching() {
  if (observer_ != nullptr) observer_->detach(this);
  own_.reset();
}

}  // namespace graphtrees
