"""commd.torch_backend."""
