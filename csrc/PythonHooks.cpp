#include "PythonHooks.h"

namespace graphtrees {

// Never destroyed: a thread may run a hook during static destruction.
#define GRAPHTREES_HOOK(name, sig)       \
  Hook<sig>& name() {                    \
    static auto* hook = new Hook<sig>(); \
    return *hook;                        \
  }
GRAPHTREES_HOOK(collectGarbageHook, bool())
GRAPHTREES_HOOK(findStoragesHook, FindStoragesFn)
GRAPHTREES_HOOK(blockingWaitHook, BlockingWaitFn)
GRAPHTREES_HOOK(captureScopeHook, CaptureScopeFn)
GRAPHTREES_HOOK(propagatesHook, PropagatesFn)
#undef GRAPHTREES_HOOK

bool collectGarbage() {
  auto f = collectGarbageHook().get();
  return f ? (*f)() : false;
}

std::vector<c10::Storage> findStorages(const std::vector<void*>& blocks) {
  auto f = findStoragesHook().get();
  return f ? (*f)(blocks) : std::vector<c10::Storage>();
}

void runBlocking(const std::function<void()>& wait) {
  if (auto f = blockingWaitHook().get()) {
    (*f)(wait);
  } else {
    wait();
  }
}

bool propagatesAsIs(const std::exception& error) {
  auto f = propagatesHook().get();
  return f && (*f)(error);
}

}  // namespace graphtrees
