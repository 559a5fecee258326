"""Running matched ops: the local executor, the hierarchical (local → lane → local) phases, worker threads."""
