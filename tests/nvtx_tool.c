/* A minimal NVTX tool for tests/test_observability.py: NVTX loads it from NVTX_INJECTION64_PATH
 * (as it loads Nsight Systems' injection library) and it writes every range pushed and popped
 * through the core NVTX API to the file named by GRAPHTREES_NVTX_LOG, one line each. */
#include <nvtx3/nvToolsExt.h>
#include <stdio.h>
#include <stdlib.h>

static FILE* out;

static int push(const char* message) {
  fprintf(out, "push %s\n", message);
  fflush(out);
  return 0;
}

static int pop(void) {
  fprintf(out, "pop\n");
  fflush(out);
  return 0;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
  const NvtxExportTableCallbacks* callbacks =
      (const NvtxExportTableCallbacks*)get_export_table(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable table = 0;
  unsigned int size = 0;
  const char* path = getenv("GRAPHTREES_NVTX_LOG");
  if (callbacks == 0 || path == 0 ||
      !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size)) {
    return 0;
  }
  out = fopen(path, "a");
  if (out == 0) return 0;
  *table[NVTX_CBID_CORE_RangePushA] = (NvtxFunctionPointer)push;
  *table[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)pop;
  return 1;
}
