"""Simulated multi-node setups on one machine (network namespaces on a bridge, shaped with tc).

See ``commd.sim.hosts`` for the API and ``python -m commd.sim --help`` for the command line.
"""

from commd.sim.hosts import *  # noqa: F403  (the package re-exports the module's public names)
from commd.sim.hosts import __all__  # noqa: F401
