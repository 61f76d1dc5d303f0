#include "cpu/ProgramRecorder.h"

#include "cpu/CpuPool.h"

#include <ATen/ScalarOps.h>
#include <ATen/core/class_type.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

namespace graphtrees {

namespace {

thread_local ProgramRecorder* tls_recorder = nullptr;

// The value of a wrapped number (a 0-dim tensor ATen made from a Python number), read without
// dispatching an op (.item() would be a host read of its own).
std::optional<c10::Scalar> wrappedValue(const at::Tensor& t) {
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble:
      return c10::Scalar(*static_cast<const double*>(p));
    case at::kLong:
      return c10::Scalar(*static_cast<const int64_t*>(p));
    case at::kBool:
      return c10::Scalar(*static_cast<const bool*>(p));
    case at::kComplexDouble:
      return c10::Scalar(*static_cast<const c10::complex<double>*>(p));
    default:
      return std::nullopt;
  }
}

bool isWork(const c10::IValue& v) {
  if (!v.isObject()) return false;
  const auto name = v.toObjectRef().type()->name();
  return name && name->qualifiedName() == "__torch__.torch.classes.c10d.Work";
}

// An undefined tensor is not one: a composite kernel passes its `Tensor?` argument on as an
// undefined tensor where Python passed None (aten::conv2d's bias to aten::convolution).
bool containsTensor(const c10::IValue& v) {
  bool found = false;
  v.visit([&](const c10::IValue& e) {
    found = found || (e.isTensor() && e.toTensor().defined());
    return found;
  });
  return found;
}

// Every slot a step reads or writes, inside a control step's arms too.
void slotsOf(const OpProgram::Step& step, std::vector<int32_t>* out) {
  for (const auto& a : step.args) out->insert(out->end(), a.slots.begin(), a.slots.end());
  for (const auto& r : step.results) out->insert(out->end(), r.begin(), r.end());
  if (!step.control) return;
  const OpProgram::Control& c = *step.control;
  out->push_back(c.pred);
  for (int arm = 0; arm < 2; ++arm) {
    out->insert(out->end(), c.outs[arm].begin(), c.outs[arm].end());
    for (const auto& s : c.arms[arm]) slotsOf(s, out);
  }
  out->insert(out->end(), c.carried.begin(), c.carried.end());
}

// Note [Values of an op program]: each value a list of steps makes (an op's result, a cond's
// results) is dropped after its last use in that list, unless it is `handed` on out of it.
void planReleases(std::vector<OpProgram::Step>* steps, const std::unordered_set<int32_t>& handed) {
  std::unordered_map<int32_t, size_t> last;  // made here -> the last step that uses it
  std::vector<int32_t> used;
  for (size_t k = 0; k < steps->size(); ++k) {
    const OpProgram::Step& step = (*steps)[k];
    used.clear();
    slotsOf(step, &used);
    for (int32_t s : used) {
      auto it = last.find(s);
      if (it != last.end()) it->second = k;
    }
    const auto made = [&](int32_t s) {
      if (s >= 0 && !handed.count(s)) last.emplace(s, k);
    };
    for (const auto& r : step.results) std::for_each(r.begin(), r.end(), made);
    if (step.control && step.control->kind == OpProgram::Control::Kind::kCond) {
      std::for_each(step.control->outs[0].begin(), step.control->outs[0].end(), made);
    }
  }
  for (auto& step : *steps) step.release.clear();
  for (const auto& kv : last) (*steps)[kv.second].release.push_back(kv.first);
  for (auto& step : *steps) std::sort(step.release.begin(), step.release.end());
}

}  // namespace

ProgramRecorder::ProgramRecorder(const std::vector<at::Tensor>& inputs,
                                 const std::vector<Allocation>* allocations, const CpuPool* pool)
    : CaptureWatcher(Needs{/*inputs=*/true, /*outputs=*/true}),
      program_(std::make_unique<OpProgram>()),
      allocations_(allocations),
      pool_(pool),
      prev_(tls_recorder) {
  target_ = &program_->steps_;
  program_->num_inputs_ = static_cast<int32_t>(inputs.size());
  program_->num_slots_ = program_->num_inputs_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    slots_.emplace(inputs[i].unsafeGetTensorImpl(), static_cast<int32_t>(i));  // first one wins
    seen_.emplace_back(inputs[i].getIntrusivePtr());
  }
  tls_recorder = this;
  startWatching();
}

ProgramRecorder::~ProgramRecorder() {
  stopWatching();
  if (tls_recorder == this) tls_recorder = prev_;
}

void ProgramRecorder::noteUndispatchedAccess(const std::string& what) {
  if (ProgramRecorder* r = tls_recorder) {
    r->fail("it reaches tensor memory outside the dispatcher (" + what +
            "), where work no op shows can read or write it (numpy, ctypes, a C extension)");
  }
}

void ProgramRecorder::fail(std::string why) {
  if (failure_.empty()) failure_ = std::move(why);
}

namespace {
// Note [Composite ops are recorded decomposed]
// A program replays its steps below autograd (OpProgram::run). An op with no CPU kernel of its
// own runs its CompositeImplicitAutograd kernel there, which decides again what to call, and some
// decisions read autograd state: matmul folds a 3-d input into one mm when the other operand
// requires grad, and below autograd a view of a parameter does not (so F.linear on a
// non-contiguous input allocated differently on replay, and the program was not proved); SDPA
// picks its kernel likewise. So such an op is not a step: the ops its kernel called are, as a
// CUDA graph records the kernels they launched.
bool decomposedOnReplay(const c10::OperatorHandle& handle) {
  return !handle.hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
         handle.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
}
}  // namespace

Descend ProgramRecorder::onStart(const ObservedOp& op, int level) {
  const at::RecordFunction& fn = op.fn;
  if (!op.named()) return Descend::kSeeThrough;  // not an op: its calls stand for it
  const auto& handle = op.handle();
  if (level == 0 && handle && decomposedOnReplay(*handle)) return Descend::kSeeThrough;
  if (!failure_.empty() || paused_ > 0) return Descend::kNested;
  // RecordFunction swallows what a callback throws: an error here must fail the recording.
  try {
    if (level == 0) {
      if (!handle) {
        fail("op #" + std::to_string(target_->size()) + " " + fn.name() +
             " is not registered with the dispatcher");
      } else {
        recordStep(fn, *handle);
      }
    } else {
      noteNestedWrites(op);
    }
  } catch (const std::exception& e) {
    fail(std::string("recording ") + fn.name() + " failed: " + e.what());
  }
  return Descend::kNested;
}

void ProgramRecorder::noteNestedWrites(const ObservedOp& op) {
  // The top-level op may write through the ops it calls (aten::batch_norm updates its running
  // statistics in a nested op): the proof needs those storages' old bytes too.
  if (allocations_ == nullptr) return;
  const auto& handle = op.handle();
  if (!handle) return;
  const auto inputs = op.fn.inputs();
  const auto& args = handle->schema().arguments();
  for (size_t i = 0; i < inputs.size() && i < args.size(); ++i) {
    if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite()) continue;
    const c10::IValue& v = inputs[i];
    if (v.isTensor() && v.toTensor().defined()) noteWrite(v.toTensor());
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) noteWrite(t);
    }
  }
}

void ProgramRecorder::recordStep(const at::RecordFunction& fn, const c10::OperatorHandle& handle) {
  const std::string label = "op #" + std::to_string(target_->size()) + " " + fn.name();
  const auto& schema = handle.schema().arguments();
  const auto inputs = fn.inputs();
  if (inputs.size() != schema.size()) return fail(label + ": its arguments could not be observed");
  OpProgram::Step step(handle);
  step.alloc_begin = allocations_ != nullptr ? allocations_->size() : 0;
  std::vector<OpProgram::Arg> args;
  args.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size() && failure_.empty(); ++i) {
    args.push_back(argument(inputs[i]));
  }
  if (!failure_.empty()) {
    failure_ = label + ": " + failure_;
    return;
  }
  step.args = std::move(args);
  target_->push_back(std::move(step));  // complete, or not at all
}

void ProgramRecorder::onEnd(const ObservedOp& op, int level, Descend chosen) {
  if (chosen != Descend::kNested || level > 0 || !failure_.empty() || paused_ > 0 ||
      target_->empty()) {
    return;
  }
  const at::RecordFunction& fn = op.fn;
  try {
    recordResults(fn);
  } catch (const std::exception& e) {
    fail(std::string("recording the results of ") + fn.name() + " failed: " + e.what());
  }
}

void ProgramRecorder::recordResults(const at::RecordFunction& fn) {
  OpProgram::Step& step = target_->back();
  if (step.control) return;  // the op that ended is not the last step's (an arm's first op, say)
  step.alloc_end = allocations_ != nullptr ? allocations_->size() : 0;
  const auto& outputs = fn.outputs();
  if (outputs.size() != step.op->schema().returns().size()) {
    return fail("op #" + std::to_string(target_->size() - 1) + " " + fn.name() +
                ": its results could not be observed");
  }
  auto slotOfResult = [&](const at::Tensor& t) -> int32_t {
    if (!t.defined() || slots_.count(t.unsafeGetTensorImpl())) return -1;
    return newSlot(t);
  };
  for (size_t r = 0; r < outputs.size(); ++r) {
    const c10::IValue& v = outputs[r];
    std::vector<int32_t> slots;
    if (v.isTensor()) {
      slots.push_back(slotOfResult(v.toTensor()));
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) slots.push_back(slotOfResult(t));
    } else if (isWork(v)) {
      step.waits.push_back(r);
    } else if (containsTensor(v)) {
      return fail("op #" + std::to_string(target_->size() - 1) + " " + fn.name() +
                  " returns tensors in a structure a program cannot take apart");
    }
    step.results.push_back(std::move(slots));
  }
}

OpProgram::Arg ProgramRecorder::argument(const c10::IValue& value) {
  using Kind = OpProgram::Arg::Kind;
  OpProgram::Arg a;
  if (value.isTensor() && !value.toTensor().defined()) {
    a.constant = value;  // where Python passed None (see containsTensor): shown, compared as None
    return a;
  }
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.unsafeGetTensorImpl()->is_wrapped_number() && !slots_.count(t.unsafeGetTensorImpl())) {
      const auto scalar = wrappedValue(t);
      if (!scalar) {
        fail("it takes a Python number as a tensor of type " +
             std::string(c10::toString(t.scalar_type())));
        return a;
      }
      RouteSuspended outside_the_pool;  // the program's own copy, outside every pool
      at::Tensor copy = at::detail::scalar_tensor_static(*scalar, t.scalar_type(), at::kCPU);
      copy.unsafeGetTensorImpl()->set_wrapped_number(true);
      a.constant = std::move(copy);
      a.shown = c10::IValue(*scalar);
      return a;
    }
    a.kind = Kind::kSlot;
    a.slots.push_back(slotOf(t));
    return a;
  }
  if (value.isTensorList()) {
    a.kind = Kind::kSlotList;
    for (const at::Tensor& t : value.toTensorVector()) {
      if (!t.defined()) {
        fail("one of its arguments is a list of tensors holding an undefined tensor");
        return a;
      }
      a.slots.push_back(slotOf(t));
    }
    return a;
  }
  if (value.isList() && containsTensor(value)) {
    // Tensor?[] (the indices of aten::index): tensors and Nones.
    a.kind = Kind::kOptionalSlotList;
    for (const c10::IValue& e : value.toListRef()) {
      if (e.isNone() || (e.isTensor() && !e.toTensor().defined())) {
        a.slots.push_back(-1);
      } else if (e.isTensor()) {
        a.slots.push_back(slotOf(e.toTensor()));
      } else {
        fail("one of its arguments is a list of tensors and other values");
      }
    }
    return a;
  }
  if (containsTensor(value)) {
    fail("one of its arguments holds tensors in a structure a program cannot rebuild");
    return a;
  }
  if (value.isGenerator()) noteGenerator(value.toGenerator());
  if (value.isStorage() && pool_ != nullptr && pool_->contains(value.toStorage().data())) {
    fail("one of its arguments is a storage made while the function ran");
    return a;
  }
  a.constant = value;
  a.shown = value;
  return a;
}

int32_t ProgramRecorder::slotOf(const at::Tensor& t) {
  noteWrite(t);  // any op may write it: aten::batch_norm writes its running statistics unsaid
  auto it = slots_.find(t.unsafeGetTensorImpl());
  if (it != slots_.end()) return it->second;
  if (pool_ != nullptr && t.has_storage() && pool_->contains(t.storage().data())) {
    fail(
        "it takes a tensor that was made while the function ran, but not by an op "
        "(torch.tensor(), torch.from_numpy(), Tensor.data, a pybind or ctypes call); a program "
        "cannot make it again");
    return 0;
  }
  if (pool_ != nullptr && t.has_storage() && OtherThreadAllocations::contains(t.storage().data())) {
    fail(
        "it takes a tensor made while it ran on another thread (a thread pool, an interop "
        "thread), whose ops a program does not see (Note [Tensors made on other threads])");
    return 0;
  }
  const int32_t s = newSlot(t);
  program_->held_.emplace_back(s, t);
  return s;
}

int32_t ProgramRecorder::newSlot(const at::Tensor& t) {
  const int32_t s = program_->num_slots_++;
  slots_.emplace(t.unsafeGetTensorImpl(), s);
  seen_.emplace_back(t.getIntrusivePtr());
  return s;
}

void ProgramRecorder::noteWrite(const at::Tensor& t) {
  if (allocations_ == nullptr || !t.has_storage()) return;
  const c10::Storage& storage = t.storage();
  if (storage.nbytes() == 0 || storage.data() == nullptr) return;
  if (saved_set_.count(storage.unsafeGetStorageImpl())) return;
  for (; made_seen_ < allocations_->size(); ++made_seen_) {
    made_.insert((*allocations_)[made_seen_].ptr);
  }
  if (made_.count(reinterpret_cast<uintptr_t>(storage.data()))) return;  // the function made it
  saved_set_.insert(storage.unsafeGetStorageImpl());
  if (saved_bytes_ + storage.nbytes() > kSavedBytesLimit) {
    if (unproven_.empty()) {
      unproven_ = "the tensors it reads that it did not make hold more than " +
                  std::to_string(kSavedBytesLimit >> 20) + " MiB, too much to copy for the proof";
    }
    return;
  }
  saved_bytes_ += storage.nbytes();
  const auto* bytes = static_cast<const uint8_t*>(storage.data());
  saved_.push_back({storage, std::vector<uint8_t>(bytes, bytes + storage.nbytes())});
}

void ProgramRecorder::noteGenerator(const at::Generator& g) {
  if (allocations_ == nullptr || generators_.has(g)) return;
  RouteSuspended outside_the_pool;  // the state is graphtrees' copy
  generators_.add(g);
}

std::unique_ptr<OpProgram> ProgramRecorder::finish(std::string* why) {
  if (tls_recorder == this) tls_recorder = prev_;
  stopWatching();
  if (!failure_.empty()) {
    *why = failure_;
    return nullptr;
  }
  if (!open_.empty()) {
    *why = "a torch.cond or torch.while_loop was left open";
    return nullptr;
  }
  planReleases(&program_->steps_, {});  // Note [Values of an op program]
  // Only what the run changed needs its old bytes back for the proof.
  saved_.erase(std::remove_if(saved_.begin(), saved_.end(),
                              [](const SavedStorage& s) {
                                return std::memcmp(s.storage.data(), s.before.data(),
                                                   s.before.size()) == 0;
                              }),
               saved_.end());
  seen_.clear();
  slots_.clear();
  return std::move(program_);
}

ProgramRecorder* ProgramRecorder::current() {
  return tls_recorder;
}

// Note [Control steps of a program] in cpu/OpProgram.h.
void ProgramRecorder::beginCond(const at::Tensor& pred) {
  if (!failure_.empty()) return;
  auto open = std::make_unique<OpenControl>();
  open->control = std::make_shared<OpProgram::Control>();
  open->control->kind = OpProgram::Control::Kind::kCond;
  open->control->pred = knownSlot(pred, "the predicate of torch.cond");
  open->parent = target_;
  open->first_slot[0] = program_->num_slots_;
  target_ = &open->control->arms[0];
  open_.push_back(std::move(open));
}

void ProgramRecorder::beginWhileLoop(const std::vector<at::Tensor>& carried) {
  if (!failure_.empty()) return;
  auto open = std::make_unique<OpenControl>();
  open->control = std::make_shared<OpProgram::Control>();
  open->control->kind = OpProgram::Control::Kind::kWhileLoop;
  for (const auto& t : carried) {
    open->control->carried.push_back(knownSlot(t, "a carried value of torch.while_loop"));
  }
  open->parent = target_;
  open->first_slot[0] = program_->num_slots_;
  target_ = &open->control->arms[0];
  open_.push_back(std::move(open));
}

void ProgramRecorder::nextArm() {
  if (!failure_.empty() || open_.empty()) return;
  OpenControl& open = *open_.back();
  TORCH_INTERNAL_ASSERT(open.arm == 0);
  open.arm = 1;
  open.first_slot[1] = program_->num_slots_;
  target_ = &open.control->arms[1];
}

int32_t ProgramRecorder::knownSlot(const at::Tensor& t, const char* what) {
  if (!t.defined()) {
    fail(std::string(what) + " is not a tensor");
    return -1;
  }
  auto it = slots_.find(t.unsafeGetTensorImpl());
  if (it != slots_.end()) return it->second;
  return slotOf(t);  // from outside the function (held), or a failure
}

bool ProgramRecorder::madeInArm(int32_t slot, int arm) const {
  const OpenControl& open = *open_.back();
  if (slot < open.first_slot[arm] || slot >= open.first_slot[arm + 1]) return false;
  return std::none_of(program_->held_.begin(), program_->held_.end(),
                      [&](const auto& h) { return h.first == slot; });
}

void ProgramRecorder::endCond(const std::vector<at::Tensor>& outs0,
                              const std::vector<at::Tensor>& outs1) {
  if (!failure_.empty() || open_.empty()) return;
  OpenControl& open = *open_.back();
  open.first_slot[2] = program_->num_slots_;
  OpProgram::Control& c = *open.control;
  for (const auto& t : outs0) {
    const int32_t s = knownSlot(t, "a result of torch.cond");
    if (failure_.empty() && !madeInArm(s, 0)) {
      fail("a result of torch.cond's true branch is a tensor it did not make");
    }
    c.outs[0].push_back(s);
    c.homes.push_back({t.data_ptr(), t.sizes().vec(), t.strides().vec(), t.scalar_type()});
  }
  for (const auto& t : outs1) {
    const int32_t s = knownSlot(t, "a result of torch.cond");
    c.outs[1].push_back(s);
    if (madeInArm(s, 1)) c.drop[1].push_back(s);
  }
  if (c.outs[0].size() != c.outs[1].size()) fail("the branches of torch.cond return differently");
  // The Python layer refuses these (review of issue 48, W1 and W2); a program must never copy a
  // result into a buffer another result shares, nor one of another shape, dtype or layout.
  for (size_t i = 0; i < outs0.size() && failure_.empty(); ++i) {
    const c10::StorageImpl* storage = outs0[i].storage().unsafeGetStorageImpl();
    for (size_t j = 0; j < i; ++j) {
      if (outs0[j].storage().unsafeGetStorageImpl() == storage) {
        fail("results " + std::to_string(j) + " and " + std::to_string(i) +
             " of torch.cond's true branch share memory: the false branch's cannot be copied "
             "into both");
      }
    }
    if (i < outs1.size() &&
        (outs1[i].sizes() != outs0[i].sizes() || outs1[i].strides() != outs0[i].strides() ||
         outs1[i].scalar_type() != outs0[i].scalar_type())) {
      fail("result " + std::to_string(i) +
           " of torch.cond's branches differ in shape, strides or dtype");
    }
  }
  endControl();
}

void ProgramRecorder::endWhileLoop(const at::Tensor& pred,
                                   const std::vector<at::Tensor>& body_outs) {
  if (!failure_.empty() || open_.empty()) return;
  OpenControl& open = *open_.back();
  open.first_slot[2] = program_->num_slots_;
  OpProgram::Control& c = *open.control;
  c.pred = knownSlot(pred, "the predicate of torch.while_loop");
  if (failure_.empty() && !madeInArm(c.pred, 0)) {
    fail("the predicate of torch.while_loop is a tensor its cond_fn did not make");
  }
  c.drop[0].push_back(c.pred);
  for (const auto& t : body_outs) {
    const int32_t s = knownSlot(t, "a result of torch.while_loop's body");
    c.outs[1].push_back(s);
    if (madeInArm(s, 1)) c.drop[1].push_back(s);
  }
  if (c.outs[1].size() != c.carried.size())
    fail("the body of torch.while_loop returns differently");
  endControl();
}

void ProgramRecorder::endControl() {
  std::unique_ptr<OpenControl> open = std::move(open_.back());
  open_.pop_back();
  target_ = open->parent;
  if (!failure_.empty()) return;
  OpProgram::Control& c = *open->control;
  std::sort(c.drop[1].begin(), c.drop[1].end());
  c.drop[1].erase(std::unique(c.drop[1].begin(), c.drop[1].end()), c.drop[1].end());
  // What leaves an arm is not dropped inside it: the step hands it on, or drops it itself.
  std::unordered_set<int32_t> handed(c.outs[0].begin(), c.outs[0].end());
  handed.insert(c.outs[1].begin(), c.outs[1].end());
  if (c.pred >= 0) handed.insert(c.pred);
  for (auto& arm : c.arms) planReleases(&arm, handed);
  target_->emplace_back(std::shared_ptr<const OpProgram::Control>(std::move(open->control)));
}

}  // namespace graphtrees
