"""The machine's load around a benchmark run: what it needs, what was there, and a warning when they clash.

A run's figures are only worth reading when its processes had the cores to
themselves.  ``commd bench`` runs every rank and every node's daemon on this
machine (simulated hosts included), so it needs ranks per node x nodes + one
core per daemon.  The 1-minute load average says how many runnable tasks the
machine had: if the others' load plus what the run needs exceeds the cores, the
run's processes wait for a core, and latencies measure the scheduler.

At the end, the 1-minute average includes the run's own processes.  Linux folds
the runnable count into it every 5 s with weight 1 - exp(-5/60), so ``needed``
busy processes for ``elapsed`` seconds add at most needed x (1 - exp(-elapsed/60)):
that is taken off before judging the others' load (an upper bound on the run's
share: the end warning never blames the run on itself).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: A load source: the 1-, 5- and 15-minute load averages (``os.getloadavg``'s shape).
LoadSource = Callable[[], tuple[float, float, float]]
#: The time constant of Linux's 1-minute load average, in seconds.
ONE_MINUTE_S = 60.0


def read_loadavg() -> tuple[float, float, float]:
    """This machine's load averages (os.getloadavg), the default load source."""
    return os.getloadavg()


@dataclass(frozen=True)
class Needs:
    """The cores a run needs: one per rank and one per node's daemon, all on this machine."""

    ranks: int
    daemons: int

    @property
    def cores(self) -> int:
        return self.ranks + self.daemons

    def describe(self) -> str:
        return f"{self.ranks} ranks + {self.daemons} daemon{'s' if self.daemons != 1 else ''}"


def needs_of(nproc: int, hosts: int) -> Needs:
    """What `commd bench --nproc-per-node N [--hosts H]` runs here at once (MPI's phase runs fewer)."""
    nodes = max(1, hosts)
    return Needs(ranks=nproc * nodes, daemons=nodes)


def own_share(needed: int, elapsed_s: float) -> float:
    """The most ``needed`` busy processes can have added to the 1-minute average in ``elapsed_s``."""
    return needed * (1.0 - math.exp(-max(0.0, elapsed_s) / ONE_MINUTE_S))


def _sample(source: LoadSource) -> dict[str, float] | None:
    try:
        one, five, fifteen = source()
    except OSError:  # no load average on this system
        return None
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


@dataclass
class LoadWatch:
    """The load at the start and at the end of a run, against what the run needs (``to_json`` for reports)."""

    needs: Needs
    cores: int
    source: LoadSource = read_loadavg
    start: dict[str, float] | None = None
    end: dict[str, float] | None = None
    elapsed_s: float | None = None
    warnings: list[str] | None = None

    def begin(self) -> str | None:
        """Sample the load before anything starts; the warning to show, if any."""
        self.warnings = []
        self.start = _sample(self.source)
        if self.start is None:
            return None
        others = self.start["1m"]
        if others + self.needs.cores <= self.cores:
            return None
        return self._warn(f"WARNING: the 1-minute load average is {others:.2f} on {self.cores} cores before the "
                          f"run, which needs {self.needs.cores} ({self.needs.describe()}): "
                          f"{max(0.0, self.cores - others):.1f} are free, so its processes will wait for cores "
                          "and its times measure the scheduler; rerun on an idle machine or with fewer ranks")

    def finish(self, elapsed_s: float) -> str | None:
        """Sample the load at the end; a warning when the others' load rose to where the run lacked cores."""
        self.elapsed_s = round(elapsed_s, 1)
        self.end = _sample(self.source)
        if self.end is None:
            return None
        mine = own_share(self.needs.cores, elapsed_s)
        others = max(0.0, self.end["1m"] - mine)
        before = self.start["1m"] if self.start is not None else 0.0
        if others + self.needs.cores <= self.cores or others <= before:
            return None
        return self._warn(f"WARNING: the 1-minute load average rose to {self.end['1m']:.2f} on {self.cores} cores "
                          f"by the end of the run (at most {mine:.2f} of it the run's own {self.needs.cores} "
                          f"processes over {elapsed_s:.0f} s): other work took cores from the run while it "
                          "measured, so its times are not representative")

    def _warn(self, text: str) -> str:
        if self.warnings is None:
            self.warnings = []
        self.warnings.append(text)
        return text

    def to_json(self) -> dict[str, Any]:
        return {"cores": self.cores, "needed_cores": self.needs.cores, "needed": self.needs.describe(),
                "start": self.start, "end": self.end, "elapsed_s": self.elapsed_s,
                "warnings": list(self.warnings or [])}
