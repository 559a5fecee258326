"""Simulated multi-node setups on one machine (network namespaces on a bridge, shaped with tc).

See ``commd.sim.hosts`` for the API and ``python -m commd.sim --help`` for the command line.
"""

from commd.sim.hosts import (
    DEFAULT_PREFIX,
    DELAY_BACKENDS,
    MAX_HOSTS,
    InstanceState,
    ShapingUnavailableError,
    SimHost,
    SimHostsError,
    SimulatedHosts,
    cleanup_stale,
    link_commands,
    list_instances,
    netns_unavailable,
    parse_rate,
    remove_instance,
    resolve_delay_backend,
    shaping_unavailable,
    state_dir,
)

__all__ = [
    "DEFAULT_PREFIX",
    "DELAY_BACKENDS",
    "MAX_HOSTS",
    "InstanceState",
    "ShapingUnavailableError",
    "SimHost",
    "SimHostsError",
    "SimulatedHosts",
    "cleanup_stale",
    "link_commands",
    "list_instances",
    "netns_unavailable",
    "parse_rate",
    "remove_instance",
    "resolve_delay_backend",
    "shaping_unavailable",
    "state_dir",
]
