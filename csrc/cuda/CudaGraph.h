#pragma once

// A graph the CUDA backend recorded: at::cuda::CUDAGraph with the generators it must advance
// (TreeGraph), behind the backend interface's Graph (CudaGraph).

#include "Backend.h"

#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

namespace graphtrees {

// at::cuda::CUDAGraph, with what graphtrees needs of its protected state (Note [Generators and
// captures] in CudaGraph.cpp).
struct TreeGraph : at::cuda::CUDAGraph {
  TreeGraph() = default;
  // Takes out of the graph's generator map the states that never registered the graph (torch
  // 2.11 only; Note [Generators and captures]), so that ~CUDAGraph cannot terminate the process.
  ~TreeGraph();
  // Registers the generators among `generators` that live on `device`, and the device's default
  // generator; before capture_begin(), and before a memory budget lowers the fraction.
  void registerGenerators(const std::vector<at::Generator>& generators, c10::DeviceIndex device);
  // Takes the generators this graph registered out of capture mode, after a failed capture.
  void leaveGeneratorCaptures();
  // Whether capture_end() got far enough to mark the capture ended (torch 2.11 marks it before
  // it instantiates, so a graph whose instantiation failed is "ended" and resets both pools).
  bool captureEnded() const { return capture_ended_; }
  // Whether a replay advances a generator (its replay then reads the generator's state).
  bool drawsRandomNumbers() const;
};

class CudaGraph final : public Graph {
 public:
  // `conditionals`: the torch.cond / torch.while_loop it holds as conditional nodes (Note
  // [Conditional nodes on CUDA] in ConditionalNodes.cpp). `pool_refs`: the references to `pool`
  // its capture took (1, and more where torch's conditional-node capture kept some).
  CudaGraph(std::unique_ptr<TreeGraph> graph, std::vector<Interval> footprint,
            c10::DeviceIndex device, std::vector<std::string> conditionals,
            c10::cuda::MempoolId_t pool, int pool_refs)
      : graph_(std::move(graph)),
        footprint_(std::move(footprint)),
        device_(device),
        draws_random_numbers_(graph_->drawsRandomNumbers()),
        conditionals_(std::move(conditionals)),
        pool_(pool),
        pool_refs_(pool_refs) {}
  // Destroys the graph under the device's allocation lock: ~CUDAGraph unregisters it from the
  // generators' states, which torch 2.11 does not synchronise (review 4, #11).
  ~CudaGraph() override;

  // The addresses are baked into the graph: no Python runs, inputs are already in place. On the
  // caller's current stream of the graph's device, which the call ordered after the pool's other
  // users (Note [Streams of the pool] in PoolStreams.cpp).
  void replay(const RunFn& run, const std::vector<at::Tensor>& inputs,
              const std::vector<int64_t>& copied,
              const std::vector<at::Tensor>& placeholders) override;
  const std::vector<Interval>& footprint() const override { return footprint_; }
  std::vector<std::string> conditionals() const override {
    std::vector<std::string> out;
    for (const auto& k : conditionals_) out.push_back(k + ":conditional-node");
    return out;
  }

 private:
  std::unique_ptr<TreeGraph> graph_;
  std::vector<Interval> footprint_;
  c10::DeviceIndex device_;
  bool draws_random_numbers_;
  std::vector<std::string> conditionals_;
  c10::cuda::MempoolId_t pool_;
  int pool_refs_;
};

// Destroys `graph` (under the device's allocation lock, held by the caller) and gives back the
// references to `pool` that its capture took (`capture_refs`) and its reset does not: torch 2.14's
// conditional-node capture keeps two per body, which would keep the pool from ever being freed
// (Note [Conditional nodes on CUDA]).
void destroyGraph(std::unique_ptr<TreeGraph> graph, c10::DeviceIndex device,
                  c10::cuda::MempoolId_t pool, int capture_refs);

}  // namespace graphtrees
