#pragma once

// Introspection: a snapshot of one tree (TreeManager::snapshot(), defined in TreeInfo.cpp: this
// room reads the tree, and the tree does not include this room) and what is rendered from it.
// Everything else here is a pure function of the snapshot.

#include "Backend.h"
#include "TreeCounters.h"
#include "TreeNode.h"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace graphtrees {

struct NodeInfo {
  int64_t id = 0;
  int64_t parent = -1;
  int64_t function_id = 0;
  std::string function;
  std::vector<int64_t> children;
  int64_t pool_bytes = 0;
  int64_t num_outputs = 0;
  std::string input_kinds;  // one letter per flat input: S(tatic), M(anaged), C(opied)
  int64_t live_outputs = 0;
  int64_t replays = 0;
  bool on_current_path = false;
  std::string cpu_replay;  // "program" or "python" (Note [CPU graphs]); empty on a device
  // The control steps its replay decides (Graph::conditionals()): "kind:form", e.g.
  // "cond:program-branch", "while_loop:conditional-node".
  std::vector<std::string> conditionals;
  std::string kind = "graph";  // Note [Node kinds]
};

// Note [Node kinds]
// What a node records, for the reader of tree_info() and the picture (toDot()): "graph", a whole
// function; "piece", one piece of a graph that graphtrees split around what it cannot record
// (Note [Piecewise graphs]: its function is named "<graph>[k/n]", graphtrees/_piecewise.py's
// label(), or "<graph>[k/n]#s" for the piece's signature s > 0); "conditional", a recording whose
// replay decides a branch or a loop (its `conditionals`: a CPU program's steps, Note [Control
// steps of a program] in cpu/OpProgram.h, or CUDA conditional nodes, Note [Conditional nodes on
// CUDA] in cuda/ConditionalNodes.cpp). A new kind of node adds its name here (nodeKind(), or where
// the node is described) and its style to kindStyle() in TreeInfo.cpp; an unknown kind is drawn as
// a plain graph.
std::string nodeKind(const std::string& function);

struct TreeInfo {
  std::string device;
  std::string backend;
  int64_t thread = 0;  // graphtrees' number of the thread the tree belongs to
  std::string state = "none";
  int64_t generation = 0;
  TreeCounters counters;
  int64_t num_roots = 0;
  int64_t memory_budget = -1;  // graphtrees.set_memory_budget; -1: none
  int64_t retired_trees = 0;   // filled by the registry: trees retired after a failed restore
  int64_t leaked_bytes = 0;    // filled by the registry: bytes a half-done restore left behind
  bool pending_backward = false;
  int64_t live_outputs = 0;
  int64_t current_node = -1;
  PoolStats pool;
  std::vector<NodeInfo> nodes;  // depth first, children in recording order
};

// Appends one NodeInfo per node below `root` (depth first, children in recording order).
// `live_per_node`: live outputs by node id.
void appendNodeInfos(const TreeNode& root, const std::vector<const TreeNode*>& path,
                     const std::unordered_map<int64_t, int64_t>& live_per_node,
                     std::vector<NodeInfo>* out);

// Graphviz DOT: nodes labelled with their id, function, replays, the pool bytes they write and
// their live outputs; nodes with live outputs are filled; the current path is bold and red; a
// node's kind (Note [Node kinds]) sets its shape.
std::string toDot(const TreeInfo& info);

}  // namespace graphtrees
