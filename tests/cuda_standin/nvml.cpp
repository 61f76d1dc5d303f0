// NVML (libnvidia-ml.so.1): the few calls c10 makes to learn a device's fabric and peers.

#include <cstring>

// c10's DriverAPI dlopens NVML and, with expandable segments, asks whether the device has fabric
// (multi-node NVLink) memory before it maps a segment. The stand-in's one device has neither
// NVLink peers nor fabric: those queries are NVML_ERROR_NOT_SUPPORTED, as on a PCIe card, and
// no process runs on it. The types are NVML's ABI (an int status, opaque device handles),
// declared here because the CUDA toolkit does not ship nvml.h.

namespace {
using nvmlReturn_t = int;
constexpr nvmlReturn_t kSuccess = 0;
constexpr nvmlReturn_t kInvalidArgument = 2;
constexpr nvmlReturn_t kNotSupported = 3;
struct nvmlDevice_st {
  int index = 0;
};
nvmlDevice_st the_device;
}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT nvmlReturn_t nvmlInit_v2(void) {
  return kSuccess;
}
EXPORT nvmlReturn_t nvmlInit(void) {
  return kSuccess;
}
EXPORT nvmlReturn_t nvmlShutdown(void) {
  return kSuccess;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (count == nullptr) return kInvalidArgument;
  *count = 1;
  return kSuccess;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_st** device) {
  if (device == nullptr || index != 0) return kInvalidArgument;
  *device = &the_device;
  return kSuccess;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* /*pciBusId*/,
                                                     nvmlDevice_st** device) {
  if (device == nullptr) return kInvalidArgument;
  *device = &the_device;
  return kSuccess;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_st*, unsigned int, int*) {
  return kNotSupported;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_st*, unsigned int, void*) {
  return kNotSupported;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_st*, unsigned int* infoCount,
                                                         void* /*infos*/) {
  if (infoCount == nullptr) return kInvalidArgument;
  *infoCount = 0;
  return kSuccess;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_st* d, unsigned int* n,
                                                            void* infos) {
  return nvmlDeviceGetComputeRunningProcesses(d, n, infos);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* version) {
  if (version == nullptr) return kInvalidArgument;
  *version = 13000;
  return kSuccess;
}

// The structure's size is in the low 24 bits of its version field; after the version, all zeros
// say: status NVML_SUCCESS, state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED.
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_st*, void* info) {
  if (info == nullptr) return kInvalidArgument;
  unsigned int version = 0;
  std::memcpy(&version, info, sizeof(version));
  const unsigned int size = version & 0xFFFFFFu;
  if (size < sizeof(version) || size > 4096) return kInvalidArgument;
  std::memset(static_cast<char*>(info) + sizeof(version), 0, size - sizeof(version));
  return kSuccess;
}

EXPORT const char* nvmlErrorString(nvmlReturn_t r) {
  return r == kSuccess ? "Success" : r == kNotSupported ? "Not Supported" : "Invalid Argument";
}
