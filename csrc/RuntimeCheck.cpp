#include "RuntimeCheck.h"

#include <dlfcn.h>

#include <locale>

extern "C" int graphtrees_private_cxx_runtime() {
  Dl_info self{};
  Dl_info runtime{};
  if (dladdr(reinterpret_cast<void*>(&graphtrees_private_cxx_runtime), &self) == 0) return -1;
  const auto classic = static_cast<const std::locale& (*)()>(&std::locale::classic);
  if (dladdr(reinterpret_cast<void*>(classic), &runtime) == 0) return -1;
  return self.dli_fbase == runtime.dli_fbase ? 1 : 0;
}
