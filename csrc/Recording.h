#pragma once

// What a capture produces, before it becomes a node (TreeNode::fromRecording()), and the product
// types a node keeps of it: where each output lives and the pool blocks that hold them.

#include "Backend.h"
#include "InputPlan.h"
#include "TensorMeta.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

enum class OutputKind : uint8_t {
  kPool,        // lives in a block this node's recording allocated (slot `index`)
  kInputAlias,  // a view of flat input `index`, `byte_delta` bytes from that input's data
  kEmpty,       // no storage bytes: rebuilt as an empty tensor
  kConstant,    // a view of a tensor that lives outside the pool (closure, unregistered attr)
};

struct OutputInfo {
  OutputKind kind = OutputKind::kPool;
  int64_t index = 0;
  int64_t byte_delta = 0;
  TensorMeta meta;
};

// A block of pool memory that holds output storage: the same address on every replay.
struct Slot {
  int64_t id = 0;
  uintptr_t ptr = 0;
  size_t nbytes = 0;
};

struct Recording {
  int64_t function_id = 0;
  std::string function_name;
  std::vector<InputKind> input_kinds;
  std::vector<uintptr_t> key_ptrs;  // Note [Matching a child] in TreeNode.h
  uint64_t key_hash = 0;
  // The copied inputs' placeholders and what the capture did to them (Note [A call's inputs] in
  // InputPlan.h).
  InputPlan plan;
  std::vector<at::Tensor> inputs;   // what the capture ran on (placeholders at copied positions)
  std::vector<at::Tensor> outputs;  // what the capture returned
  std::unique_ptr<Graph> graph;
  c10::Device graph_device = c10::Device(c10::DeviceType::CPU);
};

}  // namespace graphtrees
