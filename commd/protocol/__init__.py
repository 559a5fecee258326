"""commd.protocol."""
