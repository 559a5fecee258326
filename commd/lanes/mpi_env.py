"""Whether an MPI launcher started this process, from its environment alone.

Kept apart from the MPI lane (which needs torch and mpi4py) so that a daemon
deciding how to start imports neither.
"""

from __future__ import annotations

import os

#: Launcher variables holding the world size, checked in order: PMI_SIZE (MPICH's Hydra,
#: Intel MPI, Slurm's PMI-1/PMI-2), OMPI_COMM_WORLD_SIZE (Open MPI), MV2_COMM_WORLD_SIZE
#: (MVAPICH2).  MPI_LOCALNRANKS (Hydra) is deliberately not used: it counts the ranks on
#: this host, which is 1 for one daemon per node whatever the world size.
WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def mpi_world_size_from_env(environ: dict[str, str] | None = None) -> int | None:
    """The world size an MPI launcher announced in the environment, or None if not started by one.

    Reads only ``WORLD_SIZE_ENV``; mpi4py is not imported.
    """
    env = os.environ if environ is None else environ
    for name in WORLD_SIZE_ENV:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None
