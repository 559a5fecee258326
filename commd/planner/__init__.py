"""``commd plan``: a parallelization planner on SBP layouts, priced by commd's own measured costs.

Offline: it reads a model's layer graph and a tuning table, and writes a plan; it reaches the
daemons only through what it writes.  ``search.py`` solves the choice; see docs/architecture/index.md#planner.
"""
