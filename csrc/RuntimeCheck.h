#pragma once

// Note [A private C++ runtime, found without formatting]
// graphtrees._ext calls graphtrees_private_cxx_runtime() through ctypes before it imports the
// module, and refuses the build (ImportError naming the compiler and the fix) when it returns 1:
// the extension carries its own copy of libstdc++ instead of using the process's libstdc++.so.6,
// and its locale code would crash at the first number it formats (Note [The process's C++
// runtime] in setup.py). The answer must not come from formatting anything, which is what
// crashes: it compares the object that holds std::locale::classic, as this library binds it, with
// the object that holds this library's own code (dladdr). Returns 1 (a private copy), 0 (the
// process's runtime) or -1 (dladdr could not tell).

extern "C" __attribute__((visibility("default"))) int graphtrees_private_cxx_runtime();
