#include "GraphOptions.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace graphtrees {

namespace {
// An int option (not a bool) with a lower bound, or ValueError naming `who` and the option.
int64_t intOption(const std::string& who, const char* name, const py::handle& value, int64_t min) {
  const bool ok =
      PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()) && value.cast<int64_t>() >= min;
  TORCH_CHECK_VALUE(ok, who, ": ", name, " must be an int >= ", min, ", got ",
                    py::repr(value).cast<std::string>());
  return value.cast<int64_t>();
}
// verify=True/False/"warn"; None (not given) takes GRAPHTREES_VERIFY (1/true/yes/on, warn;
// 0/false/no/off or unset: off).
Verify verifyOption(const std::string& who, const py::object& value) {
  if (value.is_none()) {
    const char* env = std::getenv("GRAPHTREES_VERIFY");
    std::string e = env ? env : "";
    for (char& c : e) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool on = e == "1" || e == "true" || e == "yes" || e == "on";
    const bool off = e.empty() || e == "0" || e == "false" || e == "no" || e == "off";
    TORCH_CHECK_VALUE(on || off || e == "warn",
                      "GRAPHTREES_VERIFY must be 1 (or true, yes, on), warn, or 0 (or false, no, "
                      "off), got '",
                      env ? env : "", "'");
    return on ? Verify::kRaise : (off ? Verify::kOff : Verify::kWarn);
  }
  if (PyBool_Check(value.ptr())) return value.cast<bool>() ? Verify::kRaise : Verify::kOff;
  const bool warn = py::isinstance<py::str>(value) && value.cast<std::string>() == "warn";
  TORCH_CHECK_VALUE(warn, who, ": verify must be True, False or 'warn', got ",
                    py::repr(value).cast<std::string>());
  return Verify::kWarn;
}

// A str option that is `first` or `second`: whether it is `second`, or ValueError naming `who`
// and the option.
bool isSecondChoice(const std::string& who, const char* name, const py::object& value,
                    const char* first, const char* second) {
  const std::string s = py::isinstance<py::str>(value) ? value.cast<std::string>() : "";
  TORCH_CHECK_VALUE(s == first || s == second, who, ": ", name, " must be '", first, "' or '",
                    second, "', got ", py::repr(value).cast<std::string>());
  return s == second;
}

}  // namespace

const std::vector<std::string>& graphOptionNames() {
  static const std::vector<std::string> names = {
      "static_argnums",      "warmup_iters", "rerecord_limit", "on_overwrite",
      "max_recorded_shapes", "chain_limit",  "buckets",        "bucket_dim",
      "cpu_replay",          "verify",       "cond_form"};
  return names;
}

GraphOptions validateOptions(const std::string& who, const py::dict& options,
                             int64_t min_recorded_shapes) {
  const auto& known_names = graphOptionNames();
  for (auto item : options) {
    const std::string key = py::str(item.first).cast<std::string>();
    const bool known = std::find(known_names.begin(), known_names.end(), key) != known_names.end();
    TORCH_CHECK_TYPE(known, who, ": unexpected option '", key, "'");
  }
  auto get = [&](const char* name, py::object fallback) -> py::object {
    return options.contains(name) ? py::reinterpret_borrow<py::object>(options[name]) : fallback;
  };
  GraphOptions o;
  const py::object static_argnums = get("static_argnums", py::tuple());
  std::vector<py::handle> positions;
  if (PyLong_Check(static_argnums.ptr())) {
    positions.push_back(static_argnums);
  } else {
    for (py::handle h : static_argnums) positions.push_back(h);
  }
  for (py::handle h : positions) {
    const bool ok = PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr()) && h.cast<int64_t>() >= 0;
    TORCH_CHECK_VALUE(ok, who,
                      ": static_argnums must be non-negative ints (positions of positional "
                      "arguments), got ",
                      py::repr(h).cast<std::string>());
    o.static_argnums.push_back(h.cast<int64_t>());
  }
  o.warmup_iters =
      static_cast<int>(intOption(who, "warmup_iters", get("warmup_iters", py::int_(1)), 1));
  o.rerecord_limit =
      static_cast<int>(intOption(who, "rerecord_limit", get("rerecord_limit", py::int_(8)), 0));
  o.max_recorded_shapes = static_cast<int>(intOption(
      who, "max_recorded_shapes", get("max_recorded_shapes", py::int_(0)), min_recorded_shapes));
  o.chain_limit =
      static_cast<int>(intOption(who, "chain_limit", get("chain_limit", py::int_(16)), 1));
  o.on_overwrite =
      isSecondChoice(who, "on_overwrite", get("on_overwrite", py::str("raise")), "raise", "copy")
          ? OnOverwrite::kCopy
          : OnOverwrite::kRaise;
  const py::object buckets = get("buckets", py::none());
  if (!buckets.is_none()) {
    bool ok = py::isinstance<py::iterable>(buckets) && !py::isinstance<py::str>(buckets);
    if (ok) {
      for (py::handle h : buckets) {
        ok = ok && PyLong_Check(h.ptr()) && !PyBool_Check(h.ptr()) && h.cast<int64_t>() >= 1;
        if (ok) o.buckets.push_back(h.cast<int64_t>());
      }
    }
    TORCH_CHECK_VALUE(ok && !o.buckets.empty(), who,
                      ": buckets must be a non-empty sequence of ints >= 1, got ",
                      py::repr(buckets).cast<std::string>());
    std::sort(o.buckets.begin(), o.buckets.end());
    o.buckets.erase(std::unique(o.buckets.begin(), o.buckets.end()), o.buckets.end());
  }
  o.bucket_dim = intOption(who, "bucket_dim", get("bucket_dim", py::int_(0)), 0);
  o.cpu_replay =
      isSecondChoice(who, "cpu_replay", get("cpu_replay", py::str("program")), "program", "python")
          ? CpuReplay::kPython
          : CpuReplay::kProgram;
  o.verify = verifyOption(who, options.contains("verify") ? get("verify", py::none()) : py::none());
  o.cond_form =
      isSecondChoice(who, "cond_form", get("cond_form", py::str("auto")), "auto", "tree-branch")
          ? CondForm::kTreeBranch
          : CondForm::kAuto;
  return o;
}

py::dict toDict(const GraphOptions& o) {
  py::dict d;
  d["static_argnums"] = py::tuple(py::cast(o.static_argnums));
  d["warmup_iters"] = o.warmup_iters;
  d["rerecord_limit"] = o.rerecord_limit;
  d["on_overwrite"] = o.on_overwrite == OnOverwrite::kCopy ? "copy" : "raise";
  d["max_recorded_shapes"] = o.max_recorded_shapes;
  d["chain_limit"] = o.chain_limit;
  d["buckets"] =
      o.buckets.empty() ? py::object(py::none()) : py::object(py::tuple(py::cast(o.buckets)));
  d["bucket_dim"] = o.bucket_dim;
  d["cpu_replay"] = o.cpu_replay == CpuReplay::kPython ? "python" : "program";
  d["verify"] = o.verify == Verify::kWarn ? py::object(py::str("warn"))
                                          : py::object(py::bool_(o.verify == Verify::kRaise));
  d["cond_form"] = o.cond_form == CondForm::kTreeBranch ? "tree-branch" : "auto";
  return d;
}

}  // namespace graphtrees
