"""The native engine: build of llama.cpp + native/src, its ctypes bindings, and the memory export."""
