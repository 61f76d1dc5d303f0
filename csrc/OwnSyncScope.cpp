#include "OwnSyncScope.h"

#ifdef GRAPHTREES_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include <mutex>
#endif

namespace graphtrees {

// Note [Syncs of graphtrees' own]
// torch.cuda.set_sync_debug_mode("warn" or "error") is the user's check of the user's code, and
// graphtrees must not trip it with the waits its own bookkeeping needs: under "error" they raised
// (a recording then ran eagerly, "it raised while it was being recorded"). The CUDA backend's
// waits call the runtime directly, past c10's check (Note [Streams of the pool] in
// cuda/PoolStreams.cpp); a wait that goes through ATen -- the write-back's byte comparison copies
// to the host -- runs under an OwnSyncScope, which turns the mode off meanwhile. c10 keeps the
// mode in one process-wide object (c10::cuda::warning_state(), an inline function's static that
// libc10_cuda exports as a unique symbol, so this extension reads and writes the same one), the
// same in torch 2.11 and 2.14: nothing depends on the version. Being process-wide, the mode is
// off for every thread while a scope lives; scopes of several threads nest through a count, so
// the user's mode comes back when the last one ends -- unless someone set a mode meanwhile (the
// user, on another thread): theirs is the newer word and stays. ("default", the mode off, cannot
// be told from graphtrees' own pause, which c10 does not count: set meanwhile, it is overwritten.)
// A synchronising call of another thread in that window goes unreported, which a debugging aid can
// afford.
#ifdef GRAPHTREES_WITH_CUDA
namespace {

struct Paused {
  std::mutex mutex;
  int scopes = 0;
  c10::cuda::SyncDebugMode saved = c10::cuda::SyncDebugMode::L_DISABLED;
};

Paused& paused() {
  static auto* p = new Paused();  // leaked: a scope may end during exit
  return *p;
}

}  // namespace

OwnSyncScope::OwnSyncScope() {
  Paused& p = paused();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (p.scopes++ == 0) {
    auto& state = c10::cuda::warning_state();
    p.saved = state.get_sync_debug_mode();
    state.set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
}

OwnSyncScope::~OwnSyncScope() {
  Paused& p = paused();
  std::lock_guard<std::mutex> lock(p.mutex);
  if (--p.scopes != 0) return;
  auto& state = c10::cuda::warning_state();
  if (state.get_sync_debug_mode() == c10::cuda::SyncDebugMode::L_DISABLED) {
    state.set_sync_debug_mode(p.saved);
  }
}
#else
OwnSyncScope::OwnSyncScope() = default;
OwnSyncScope::~OwnSyncScope() = default;
#endif

}  // namespace graphtrees
