"""commd.kernels."""
