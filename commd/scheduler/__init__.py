"""commd.scheduler."""
