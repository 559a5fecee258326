"""Small but real training workloads (MoE, DLRM, Megatron GPT) over torch.distributed.

They run unchanged on any backend ("commd" or "gloo"), so a run on one backend is the
reference for the other: the same seeded model and data must give the same losses and
parameters, and the step times compare the backends on the traffic real models issue.
"""
