// NVRTC (libnvrtc.so.13): programs compile to an image the stand-in's driver accepts unread.

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

// Note [Stand-in NVRTC]
// torch compiles some CUDA kernels at run time with NVRTC: the jiterator (most complex-number
// and special-function kernels), and resolving a complex negative view. The real libnvrtc reads
// the device it compiles for through the driver behind the stand-in's back and crashes, so it is
// replaced too (same SONAME, preloaded). A program keeps its name expressions; compiling it always
// succeeds and yields a small image that names the program; the stand-in driver's
// cuModuleLoadData accepts it unread and cuModuleGetFunction hands out a function by name, whose
// launches are recorded like every other kernel (kernels.cpp), never run. A lowered name is the
// name expression itself. The ABI types are declared here (nvrtc.h is not in every toolkit).

namespace {

using Result = int;
constexpr Result kSuccess = 0;
constexpr Result kInvalidInput = 3;
constexpr Result kInvalidProgram = 4;
constexpr Result kNoNameExpressions = 9;

struct Program {
  std::string name;
  std::vector<std::string> names;  // nvrtcAddNameExpression, in order
  std::string image;
  uint32_t magic = 0x4E565254;
};

Program* valid(void* p) {
  auto* program = static_cast<Program*>(p);
  return program != nullptr && program->magic == 0x4E565254 ? program : nullptr;
}

// The architectures torch may ask for (sm_75 to sm_121, as NVRTC 13 lists them).
constexpr int kArchs[] = {75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121};

Result copyOut(const std::string& bytes, char* out) {
  if (out == nullptr) return kInvalidInput;
  std::memcpy(out, bytes.data(), bytes.size());
  return kSuccess;
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

EXPORT const char* nvrtcGetErrorString(Result result) {
  switch (result) {
    case kSuccess:
      return "NVRTC_SUCCESS";
    case kInvalidInput:
      return "NVRTC_ERROR_INVALID_INPUT";
    case kInvalidProgram:
      return "NVRTC_ERROR_INVALID_PROGRAM";
    case kNoNameExpressions:
      return "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION";
    default:
      return "NVRTC_ERROR (cuda stand-in)";
  }
}

EXPORT Result nvrtcVersion(int* major, int* minor) {
  if (major == nullptr || minor == nullptr) return kInvalidInput;
  *major = 13;
  *minor = 0;
  return kSuccess;
}

EXPORT Result nvrtcGetNumSupportedArchs(int* count) {
  if (count == nullptr) return kInvalidInput;
  *count = static_cast<int>(sizeof(kArchs) / sizeof(kArchs[0]));
  return kSuccess;
}

EXPORT Result nvrtcGetSupportedArchs(int* archs) {
  if (archs == nullptr) return kInvalidInput;
  std::memcpy(archs, kArchs, sizeof(kArchs));
  return kSuccess;
}

EXPORT Result nvrtcCreateProgram(void** program, const char* source, const char* name,
                                 int /*num_headers*/, const char* const* /*headers*/,
                                 const char* const* /*include_names*/) {
  if (program == nullptr || source == nullptr) return kInvalidInput;
  auto* p = new Program;
  p->name = name != nullptr ? name : "default_program";
  *program = p;
  return kSuccess;
}

EXPORT Result nvrtcDestroyProgram(void** program) {
  if (program == nullptr || valid(*program) == nullptr) return kInvalidProgram;
  auto* p = valid(*program);
  p->magic = 0;
  delete p;
  *program = nullptr;
  return kSuccess;
}

EXPORT Result nvrtcAddNameExpression(void* program, const char* name) {
  Program* p = valid(program);
  if (p == nullptr) return kInvalidProgram;
  if (name == nullptr) return kInvalidInput;
  p->names.emplace_back(name);
  return kSuccess;
}

EXPORT Result nvrtcCompileProgram(void* program, int /*num_options*/,
                                  const char* const* /*options*/) {
  Program* p = valid(program);
  if (p == nullptr) return kInvalidProgram;
  p->image = "// cuda stand-in: " + p->name + " (NVRTC output, never run)\n";
  p->image.push_back('\0');
  return kSuccess;
}

EXPORT Result nvrtcGetLoweredName(void* program, const char* name, const char** lowered) {
  Program* p = valid(program);
  if (p == nullptr) return kInvalidProgram;
  if (name == nullptr || lowered == nullptr) return kInvalidInput;
  for (const std::string& n : p->names) {
    if (n == name) {
      *lowered = n.c_str();
      return kSuccess;
    }
  }
  return kNoNameExpressions;
}

EXPORT Result nvrtcGetProgramLogSize(void* program, size_t* size) {
  if (valid(program) == nullptr) return kInvalidProgram;
  if (size == nullptr) return kInvalidInput;
  *size = 1;
  return kSuccess;
}

EXPORT Result nvrtcGetProgramLog(void* program, char* log) {
  if (valid(program) == nullptr) return kInvalidProgram;
  return copyOut(std::string(1, '\0'), log);
}

#define IMAGE_GETTERS(Kind)                                         \
  EXPORT Result nvrtcGet##Kind##Size(void* program, size_t* size) { \
    Program* p = valid(program);                                    \
    if (p == nullptr) return kInvalidProgram;                       \
    if (size == nullptr) return kInvalidInput;                      \
    *size = p->image.size();                                        \
    return kSuccess;                                                \
  }                                                                 \
  EXPORT Result nvrtcGet##Kind(void* program, char* out) {          \
    Program* p = valid(program);                                    \
    if (p == nullptr) return kInvalidProgram;                       \
    return copyOut(p->image, out);                                  \
  }

IMAGE_GETTERS(PTX)
IMAGE_GETTERS(CUBIN)
IMAGE_GETTERS(LTOIR)
