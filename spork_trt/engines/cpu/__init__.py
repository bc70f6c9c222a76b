"""The CPU torch engine and its C++ kernels, named by ISA and op (avx512_*, avx2_*)."""
