"""Programmable collectives: MSCCL-compatible programs, compiled to a checked IR and run by the daemons.

One stage per module: ``dsl`` (the MSCCLang-compatible language) → the compiler stages →
``ir`` (frozen dataclasses) ⇄ ``mscclxml`` (MSCCL's XML on disk) → ``checker`` (proves a
program right before it runs) → ``simulator`` (all ranks in one process) and
``interpreter`` (one rank per node's daemon, over a lane's ``Transport``).
"""
