"""commd.memory."""
