"""commd.daemon."""
