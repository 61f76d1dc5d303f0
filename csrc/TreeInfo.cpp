#include "TreeInfo.h"

#include "Logging.h"
#include "TreeManager.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace graphtrees {

void appendNodeInfos(const TreeNode& root, const std::vector<const TreeNode*>& path,
                     const std::unordered_map<int64_t, int64_t>& live_per_node,
                     std::vector<NodeInfo>* out) {
  forEachNode(root, [&](const TreeNode& n) {
    NodeInfo ni;
    ni.id = n.id();
    ni.parent = n.parent() ? n.parent()->id() : -1;
    ni.function_id = n.functionId();
    ni.function = n.functionName();
    for (const auto& c : n.ownedChildren()) ni.children.push_back(c->id());
    ni.pool_bytes = n.poolBytes();
    ni.num_outputs = n.numOutputs();
    for (InputKind k : n.inputKinds()) {
      ni.input_kinds += k == InputKind::kStatic ? 'S' : (k == InputKind::kManaged ? 'M' : 'C');
    }
    auto live = live_per_node.find(n.id());
    ni.live_outputs = live == live_per_node.end() ? 0 : live->second;
    ni.replays = n.replays();
    ni.on_current_path = std::find(path.begin(), path.end(), &n) != path.end();
    if (const char* how = n.graph().cpuReplay()) ni.cpu_replay = how;
    ni.kind = nodeKind(ni.function);
    ni.conditionals = n.graph().conditionals();
    if (!ni.conditionals.empty()) ni.kind = "conditional";
    out->push_back(std::move(ni));
    return true;
  });
}

// A tree describes itself here, beside what it describes itself with.
TreeInfo TreeManager::snapshot() {
  // Another thread's call in flight may be paused in the middle of the tree's bookkeeping (a wait
  // for the device lock lends the tree lock out): read, change nothing.
  if (!lock_.callInFlightElsewhere()) live_.pruneGone();
  TreeInfo t;
  t.device = backend_->device().str();
  t.thread = owner_;
  t.backend = backend_->name();
  static const char* const kStates[] = {"none", "warmup", "recording", "execution"};
  t.state = kStates[static_cast<int>(state_)];
  t.generation = policy_.generation();
  t.counters = counters_;
  t.num_roots = static_cast<int64_t>(root_.ownedChildren().size());
  t.memory_budget = budget_;
  t.pending_backward = policy_.pendingBackward();
  t.live_outputs = static_cast<int64_t>(live_.size());
  t.current_node = current_ ? current_->id() : -1;
  t.pool = backend_->stats();
  std::vector<const TreeNode*> on_path(path_.begin(), path_.end());
  appendNodeInfos(root_, on_path, live_.liveCountPerNode(), &t.nodes);
  return t;
}

std::string nodeKind(const std::string& name) {
  // "...[k/n]": a piece (Note [Node kinds]), and "...[k/n]#s" its signature s > 0
  // (GraphedCallable's second and later signatures append "#s").
  std::string function = name;
  if (const size_t hash = name.rfind('#');
      hash != std::string::npos && hash + 1 < name.size() &&
      std::all_of(name.begin() + hash + 1, name.end(),
                  [](char c) { return c >= '0' && c <= '9'; })) {
    function.resize(hash);
  }
  const size_t open = function.rfind('[');
  if (open == std::string::npos || function.empty() || function.back() != ']') return "graph";
  const std::string inner = function.substr(open + 1, function.size() - open - 2);
  const size_t slash = inner.find('/');
  const auto digits = [](const std::string& d) {
    return !d.empty() &&
           std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (slash == std::string::npos || !digits(inner.substr(0, slash)) ||
      !digits(inner.substr(slash + 1))) {
    return "graph";
  }
  return "piece";
}

namespace {
// How a node of `kind` is drawn (Note [Node kinds]): its shape, style and outline colour.
struct KindStyle {
  const char* shape;
  std::string style;
  const char* color;
  int peripheries = 1;
};
KindStyle kindStyle(const std::string& kind) {
  if (kind == "piece") return {"box", "rounded,dashed", "#1f5fbf"};
  // Its replay decides a branch or a loop (Note [Control steps of a program]): a double outline.
  if (kind == "conditional") return {"box", "solid", "#7030a0", 2};
  return {"box", "solid", "black"};
}
}  // namespace

std::string toDot(const TreeInfo& t) {
  auto escape = [](const std::string& s) {
    std::string r;
    for (char ch : s) {
      if (ch == '&') {  // Graphviz decodes HTML entities in a label: "&amp;" shows "&"
        r += "&amp;";
        continue;
      }
      if (ch == '"' || ch == '\\') r += '\\';
      r += ch;
    }
    return r;
  };
  std::ostringstream os;
  os << "digraph graphtrees {\n";
  os << "  label=\"graphtrees tree on " << escape(t.device) << " (pool reserved "
     << bytesString(t.pool.reserved_bytes)
     << "; red: the current path, green: live outputs, dashed: pieces of a split graph, double: "
        "conditional)\";\n";
  os << "  labelloc=t;\n  node [fontname=\"monospace\"];\n";
  for (const auto& n : t.nodes) {
    KindStyle k = kindStyle(n.kind);
    if (n.live_outputs > 0) k.style += ",filled";
    os << "  n" << n.id << " [shape=" << k.shape << ", style=\"" << k.style << "\", color=\""
       << (n.on_current_path ? "#c00000" : k.color) << "\"";
    if (n.on_current_path) os << ", penwidth=3";
    if (n.live_outputs > 0) os << ", fillcolor=\"#c6efce\"";
    os << ", label=\"#" << n.id << " " << escape(n.function) << "\\nreplays: " << n.replays
       << "\\npool: " << bytesString(n.pool_bytes);
    if (n.kind != "graph") os << "\\n(" << escape(n.kind) << ")";
    if (n.live_outputs > 0) os << "\\nlive outputs: " << n.live_outputs;
    for (const auto& c : n.conditionals) {  // "kind:form" (Graph::conditionals())
      const auto colon = c.find(':');
      os << "\\n" << escape(c.substr(0, colon));
      if (colon != std::string::npos) os << " (" << escape(c.substr(colon + 1)) << ")";
    }
    os << "\"";
    if (k.peripheries > 1) os << ", peripheries=" << k.peripheries;
    os << "];\n";
  }
  for (const auto& n : t.nodes) {
    if (n.parent >= 0) os << "  n" << n.parent << " -> n" << n.id << ";\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace graphtrees
