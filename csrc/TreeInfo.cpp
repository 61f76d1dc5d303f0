#include "TreeInfo.h"

#include <sstream>

namespace graphtrees {

std::string bytesString(int64_t n) {
  std::ostringstream os;
  if (n >= (1 << 20)) {
    os.precision(1);
    os << std::fixed << static_cast<double>(n) / (1 << 20) << " MiB";
  } else if (n >= 1024) {
    os.precision(1);
    os << std::fixed << static_cast<double>(n) / 1024 << " KiB";
  } else {
    os << n << " B";
  }
  return os.str();
}

std::string toDot(const TreeInfo& t) {
  auto escape = [](const std::string& s) {
    std::string r;
    for (char ch : s) {
      if (ch == '"' || ch == '\\') r += '\\';
      r += ch;
    }
    return r;
  };
  std::ostringstream os;
  os << "digraph graphtrees {\n";
  os << "  label=\"graphtrees tree on " << escape(t.device) << " (pool reserved "
     << bytesString(t.pool.reserved_bytes) << ")\";\n";
  os << "  node [shape=box, fontname=\"monospace\"];\n";
  for (const auto& n : t.nodes) {
    os << "  n" << n.id << " [label=\"#" << n.id << " " << escape(n.function) << "\\n"
       << bytesString(n.pool_bytes) << " written";
    if (n.live_outputs > 0) os << "\\nlive outputs: " << n.live_outputs;
    os << "\"";
    if (n.live_outputs > 0) os << ", style=filled, fillcolor=\"#c6efce\"";
    if (n.on_current_path) os << ", penwidth=2";
    os << "];\n";
  }
  for (const auto& n : t.nodes) {
    if (n.parent >= 0) os << "  n" << n.parent << " -> n" << n.id << ";\n";
  }
  os << "}\n";
  return os.str();
}

}  // namespace graphtrees
