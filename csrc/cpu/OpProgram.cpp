#include "cpu/OpProgram.h"

#include "RngStates.h"
#include "cpu/RoutingAllocator.h"

#include <ATen/Dispatch.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cmath>
#include <cstdio>
#include <sstream>

namespace graphtrees {

namespace {

void pushArg(const OpProgram::Arg& a, const std::vector<at::Tensor>& values,
             torch::jit::Stack* stack) {
  using Kind = OpProgram::Arg::Kind;
  switch (a.kind) {
    case Kind::kConstant:
      stack->push_back(a.constant);
      return;
    case Kind::kSlot:
      stack->emplace_back(values[a.slots[0]]);
      return;
    case Kind::kSlotList: {
      c10::List<at::Tensor> list;
      list.reserve(a.slots.size());
      for (int32_t s : a.slots) list.push_back(values[s]);
      stack->emplace_back(std::move(list));
      return;
    }
    case Kind::kOptionalSlotList: {
      c10::List<std::optional<at::Tensor>> list;
      list.reserve(a.slots.size());
      for (int32_t s : a.slots) {
        list.push_back(s < 0 ? std::optional<at::Tensor>() : std::optional<at::Tensor>(values[s]));
      }
      stack->emplace_back(std::move(list));
      return;
    }
  }
}

std::string showDouble(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f", v);
    return buf;
  }
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

std::string showIValue(const c10::IValue& v) {
  if (v.isDouble()) return showDouble(v.toDouble());
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isNone()) return "None";
  if (v.isString()) return "'" + v.toStringRef() + "'";
  std::ostringstream os;
  os << v;
  return os.str();
}

bool sameValue(const c10::IValue& a, const c10::IValue& b) {
  if (a.isDouble() && b.isDouble()) {  // NaN is the same NaN
    const double x = a.toDouble(), y = b.toDouble();
    return x == y || (std::isnan(x) && std::isnan(y));
  }
  return a == b;
}

bool sameConstant(const OpProgram::Arg& a, const OpProgram::Arg& b) {
  if (a.constant.isTensor() || b.constant.isTensor()) {
    // Wrapped numbers compare by value; an undefined tensor (None) by kind.
    return a.shown.isNone() == b.shown.isNone() &&
           (a.shown.isNone() || sameValue(a.shown, b.shown));
  }
  return sameValue(a.constant, b.constant);
}

}  // namespace

std::string OpProgram::opName(const Step& step) {
  if (step.control) {
    return step.control->kind == Control::Kind::kCond ? "torch.cond" : "torch.while_loop";
  }
  const auto& name = step.op->operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

bool readPredicate(const at::Tensor& pred) {
  TORCH_CHECK(pred.defined() && pred.device().is_cpu() && pred.numel() == 1,
              "graphtrees: a predicate of torch.cond or torch.while_loop must be a one-element CPU "
              "tensor here, got ",
              pred.defined() ? pred.toString() : std::string("an undefined tensor"));
  bool value = false;
  // Read in place, not through an op: the read is the control step's own (on a device, a
  // conditional node's kernel), not a host read of the function's.
  AT_DISPATCH_ALL_TYPES_AND3(
      at::kBool, at::kHalf, at::kBFloat16, pred.scalar_type(), "graphtrees_read_predicate", [&] {
        value = *static_cast<const scalar_t*>(pred.const_data_ptr()) != static_cast<scalar_t>(0);
      });
  return value;
}

void OpProgram::run(const std::vector<at::Tensor>& inputs, RouteState* route,
                    const std::string& function_name, Proof* proof) const {
  TORCH_INTERNAL_ASSERT(static_cast<int32_t>(inputs.size()) == num_inputs_);
  // A CUDA graph replays kernels, not autograd: no graph is built, no version counter moves.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  std::vector<at::Tensor> values(num_slots_);
  std::copy(inputs.begin(), inputs.end(), values.begin());
  for (const auto& h : held_) values[h.first] = h.second;
  torch::jit::Stack stack;
  stack.reserve(16);
  runSteps(steps_, values, stack, route, function_name, proof);
}

void OpProgram::runSteps(const std::vector<Step>& steps, std::vector<at::Tensor>& values,
                         torch::jit::Stack& stack, RouteState* route,
                         const std::string& function_name, Proof* proof) const {
  for (size_t k = 0; k < steps.size(); ++k) {
    const Step& step = steps[k];
    if (step.control) {
      runControl(*step.control, values, stack, route, function_name, proof);
      for (int32_t s : step.release) values[s] = at::Tensor();
      continue;
    }
    if (route != nullptr) route->cursor = step.alloc_begin;
    stack.clear();
    for (const Arg& a : step.args) pushArg(a, values, &stack);
    step.op->callBoxed(stack);
    TORCH_CHECK(route == nullptr || route->cursor == step.alloc_end, "graphtrees: the replay of '",
                function_name, "' diverged from its recording: op #", k, " ", opName(step),
                " made ", route ? route->cursor - step.alloc_begin : 0,
                " allocations where the recording made ", step.alloc_end - step.alloc_begin,
                " (its allocations depend on the input values)");
    for (size_t w : step.waits) stack[w].toCustomClass<c10d::Work>()->wait();
    for (size_t r = 0; r < step.results.size() && r < stack.size(); ++r) {
      const auto& slots = step.results[r];
      if (slots.size() == 1 && stack[r].isTensor()) {
        if (slots[0] >= 0) values[slots[0]] = std::move(stack[r]).toTensor();
      } else if (!slots.empty()) {
        const c10::List<at::Tensor> list = stack[r].toTensorList();
        for (size_t e = 0; e < slots.size() && e < list.size(); ++e) {
          if (slots[e] >= 0) values[slots[e]] = list.get(e);
        }
      }
    }
    for (int32_t s : step.release) values[s] = at::Tensor();
  }
}

// Note [Control steps of a program] in OpProgram.h.
void OpProgram::runControl(const Control& c, std::vector<at::Tensor>& values,
                           torch::jit::Stack& stack, RouteState* route,
                           const std::string& function_name, Proof* proof) const {
  const auto drop = [&](int arm) {
    for (int32_t s : c.drop[arm]) values[s] = at::Tensor();
  };
  const auto arm = [&](int a) { runSteps(c.arms[a], values, stack, route, function_name, proof); };
  // Note [Arms a recording did not run]: the proof's run of an arm the call does not take.
  const auto prove = [&](int a) {
    if (proof == nullptr) return;
    RngStates held;
    {
      RouteSuspended outside_the_pool;  // graphtrees' copy of the states
      held = RngStates(proof->generators);
    }
    ++proof->depth;
    arm(a);
    --proof->depth;
    held.restore();
    RouteSuspended outside_the_pool;
    for (int32_t s : c.outs[a]) proof->untaken.push_back(values[s].clone());
    drop(a);
    if (a == 0 && c.kind == Control::Kind::kCond) {
      for (int32_t s : c.outs[0]) values[s] = at::Tensor();  // made in the arm (the recorder's)
    }
  };
  if (c.kind == Control::Kind::kCond) {
    const bool taken = readPredicate(values[c.pred]);
    prove(taken ? 1 : 0);
    if (taken) {
      arm(0);
      drop(0);
      return;
    }
    arm(1);
    for (size_t i = 0; i < c.outs[0].size(); ++i) {
      const Home& h = c.homes[i];
      // The recording's memory for arms[0]'s result: the graph's, free until this copy (it was
      // alive from here on when recorded, so nothing the replay allocates overlaps it).
      at::Tensor home = at::from_blob(h.data, h.sizes, h.strides, at::TensorOptions(h.dtype));
      home.copy_(values[c.outs[1][i]]);
      values[c.outs[0][i]] = std::move(home);
    }
    drop(1);
    return;
  }
  for (bool first = true;; first = false) {
    arm(0);
    const bool go_on = readPredicate(values[c.pred]);
    drop(0);
    if (!go_on) {
      if (first) prove(1);
      return;
    }
    arm(1);
    if (proof != nullptr && proof->depth > 0) {  // once at most, its values dropped, as recorded
      drop(1);
      return;
    }
    for (size_t i = 0; i < c.carried.size(); ++i) {
      const at::Tensor& out = values[c.outs[1][i]];
      at::Tensor& carried = values[c.carried[i]];
      if (!out.is_same(carried)) carried.copy_(out);
    }
    drop(1);
  }
}

std::vector<std::string> OpProgram::controlKinds() const {
  std::vector<std::string> kinds;
  std::vector<const std::vector<Step>*> todo{&steps_};
  for (size_t i = 0; i < todo.size(); ++i) {
    for (const Step& s : *todo[i]) {
      if (!s.control) continue;
      kinds.push_back(s.control->kind == Control::Kind::kCond ? "cond" : "while_loop");
      todo.push_back(&s.control->arms[0]);
      todo.push_back(&s.control->arms[1]);
    }
  }
  return kinds;
}

std::string OpProgram::firstDifference(const OpProgram& eager) const {
  const size_t n = std::min(steps_.size(), eager.steps_.size());
  for (size_t k = 0; k < n; ++k) {
    const Step& then = steps_[k];
    const Step& now = eager.steps_[k];
    const std::string name = opName(then);
    const std::string prefix = "op #" + std::to_string(k) + " " + name + ": ";
    if (name != opName(now)) {
      return "op #" + std::to_string(k) + ": the recording ran " + name + " where the eager run " +
             "ran " + opName(now) +
             ": the Python code took another path than when it was recorded (a Python value "
             "decided it, and the recording baked that decision in)";
    }
    if (then.control || now.control) continue;  // their arms: the same Python code (FX graphs)
    const auto& schema = then.op->schema().arguments();
    for (size_t i = 0; i < then.args.size() && i < now.args.size(); ++i) {
      const Arg& a = then.args[i];
      const Arg& b = now.args[i];
      const std::string arg = i < schema.size() ? schema[i].name() : std::to_string(i);
      const bool both_constant = a.kind == Arg::Kind::kConstant && b.kind == Arg::Kind::kConstant;
      if (both_constant && !sameConstant(a, b)) {
        return prefix + "argument '" + arg + "' was " + showIValue(a.shown) +
               " when recorded and is " + showIValue(b.shown) +
               " now: a Python value was baked into the recording";
      }
      const auto held = [](const OpProgram& p, int32_t s) -> const at::Tensor* {
        for (const auto& h : p.held_) {
          if (h.first == s) return &h.second;
        }
        return nullptr;
      };
      if (a.kind == Arg::Kind::kSlot && b.kind == Arg::Kind::kSlot) {
        const at::Tensor* ha = held(*this, a.slots[0]);
        const at::Tensor* hb = held(eager, b.slots[0]);
        if (ha != nullptr && hb != nullptr && !ha->is_same(*hb)) {
          return prefix + "argument '" + arg +
                 "' is another tensor than when it was recorded (a tensor attribute or global "
                 "was replaced; the recording reads the one it saw)";
        }
      }
      if (a.kind != Arg::Kind::kConstant && a.kind == b.kind && a.slots.size() != b.slots.size()) {
        return prefix + "argument '" + arg + "' was a list of " + std::to_string(a.slots.size()) +
               " tensors when recorded and is a list of " + std::to_string(b.slots.size()) +
               " now: a Python value decided its length";
      }
      if ((a.kind == Arg::Kind::kConstant) != (b.kind == Arg::Kind::kConstant)) {
        return prefix + "argument '" + arg + "' was " +
               (a.kind == Arg::Kind::kConstant ? showIValue(a.shown) : std::string("a tensor")) +
               " when recorded and is " +
               (b.kind == Arg::Kind::kConstant ? showIValue(b.shown) : std::string("a tensor")) +
               " now";
      }
    }
  }
  if (steps_.size() != eager.steps_.size()) {
    return "the recording ran " + std::to_string(steps_.size()) + " ops where the eager run ran " +
           std::to_string(eager.steps_.size()) +
           ": the Python code took another path than when it was recorded";
  }
  return std::string();
}

}  // namespace graphtrees
