"""Observability of the daemon: Prometheus metrics and the per-op timeline trace."""
