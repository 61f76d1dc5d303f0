#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <vector>

namespace graphtrees {

// Note [Objects in the call signature]
// An argument that is neither a tensor, a container nor a Python scalar (an enum, a numpy
// scalar, a user's object) goes into the key as its type and hash (Note [The call signature] in
// CallSignature.h). A hash does not identify a
// value (hash(np.int64(-1)) == hash(np.int64(-2))), and an identity hash is an address that a
// dead object's successor may reuse. So each signature also holds its objects: a value-hashed
// one itself (compared with ==; a float, complex or numpy scalar bit for bit, as Python floats in
// the key are: 0.0 is not -0.0, a NaN is itself), an identity-hashed one by weak reference where it
// allows one (compared with `is`; a dead one matches nothing, and the signature does not keep it
// alive), else itself; a bound method by its function and, weakly, its object. A call whose objects
// hash like a signature's but do not match it gets a signature of its own; a signature whose
// weakly held object died is evicted when its key comes again.
// The object weak reference `ref` refers to (a new reference), or a null object once it died.
py::object weakReferent(PyObject* ref);

// The bytes of a value that the key compares bit for bit: a float or complex, of a subclass too
// (numpy's float64 and complex128), or a numpy floating or complex scalar of another width
// (float16, float32, longdouble, complex64, clongdouble: their buffer holds the value). False
// for every other object, numpy arrays and other numpy scalars included: their bytes alone do
// not say their shape, dtype or unit, so they keep their hash and ==.
bool valueBits(PyObject* obj, std::string* bytes);

class KeyObjects {
 public:
  KeyObjects() = default;
  KeyObjects(const KeyObjects&) = delete;
  KeyObjects& operator=(const KeyObjects&) = delete;
  ~KeyObjects();  // releases its references under the GIL

  // Takes the objects of the call that made the signature.
  void hold(const std::vector<py::object>& objects);
  // Whether an object held by weak reference has died: the signature can never match again.
  bool anyDead() const;

  // Whether `objects` (a call's FlatArgs::key_objects) are the ones this signature was made for.
  bool matches(const std::vector<py::object>& objects) const;

 private:
  enum class How : uint8_t { kValue, kIdentity, kWeak, kMethod };
  struct Held {
    PyObject* ref;  // an owned reference: the object, or a weak reference to it
    How how;
    // kMethod: a bound method (made anew at each attribute access) is its function, held, and
    // its object, by weak reference, so that a signature does not keep a module alive.
    PyObject* func = nullptr;
  };
  std::vector<Held> held_;
};

}  // namespace graphtrees
