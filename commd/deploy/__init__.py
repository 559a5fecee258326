"""Deployment helpers: what cluster start-up scripts (Slurm prolog/epilog) need from commd."""
