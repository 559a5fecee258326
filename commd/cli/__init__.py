"""commd.cli."""
