"""commd.torch_backend: the torch.distributed backend "commd" (``registration`` registers it,
``process_group`` implements it)."""

#: The name users pass to ``init_process_group`` and ``new_group(backend=...)``.
BACKEND_NAME = "commd"
