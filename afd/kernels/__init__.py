"""Native CPU kernels, loaded with ctypes; each has a torch fallback and is optional."""
