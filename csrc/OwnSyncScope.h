#pragma once

// Waits for the device that graphtrees makes for its own bookkeeping, hidden from the user's
// torch.cuda.set_sync_debug_mode() (Note [Syncs of graphtrees' own] in OwnSyncScope.cpp).

namespace graphtrees {

// While one is alive (on any thread), c10's sync debug mode is off; the first one in saves the
// user's mode and the last one out puts it back. Nothing on a build without CUDA.
class OwnSyncScope {
 public:
  OwnSyncScope();
  ~OwnSyncScope();
  OwnSyncScope(const OwnSyncScope&) = delete;
  OwnSyncScope& operator=(const OwnSyncScope&) = delete;
};

}  // namespace graphtrees
