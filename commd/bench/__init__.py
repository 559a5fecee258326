"""`commd bench` and `commd tune`: measure commd's collectives per lane, side by side with Gloo and MPI.

Modules, one role each:

- ``spec``: the options (shared by the orchestrator and the worker), their validation, op definitions.
- ``cases``: per op, the buffers, their deterministic contents and the NumPy reference check.
- ``paths``: how each measured path (commd with a lane hint, Gloo direct, MPI direct) runs an op.
- ``measure``: the timing loop of one (op, size, path) cell and its summary row.
- ``worker``: the program every rank runs under `commd launch` (commd and Gloo).
- ``mpi_worker``: the MPI-direct program under `mpiexec`.
- ``orchestrate``: `commd bench` from a shell: launches the workers here or on simulated hosts.
- ``report``: the table, the JSON file and the plot.
- ``tune``: `commd tune`: the sweep over every lane, the tuning table, `--show`.
- ``cli``: the argument parsers of `commd bench` and `commd tune`.
"""
