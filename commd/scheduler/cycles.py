"""Finding the cycle a training loop repeats, so that its ops can skip the coordinator.

The coordinator feeds every release of a collective to a :class:`CycleDetector`.  When
one group's releases (in increasing sequence numbers; the group's ops that take an
exchange ring leave gaps) end with the same run of op patterns twice in a row (at least
``min_window`` releases long), that run is the group's *cycle* (a cycle of one op must repeat over the whole window, not just twice): the
coordinator publishes it as a schedule (``protocol.fabric.Schedule``) and
every node releases the group's next ops itself (``fabric/scheduled.py``).

Only what every node can run alone in the global order qualifies: a release with a
cache id, on the tcp lane, not fused with another, of a group that spans every live node.
Anything else resets the detector.  Each schedule that ends early doubles the window
the next one needs (up to ``MAX_WINDOW``), so a loop that changes its pattern often
stays on negotiation instead of starting and ending schedules; one that held for two
cycles or more brings the first window back (a regular loop with an occasional extra op).
"""

from __future__ import annotations

from dataclasses import dataclass

from commd.protocol.fabric import MAX_SCHEDULE_SLOTS, ScheduleSlot

#: Releases a first cycle must cover (twice its length at least).
MIN_WINDOW = 4
#: The longest window the detector keeps (twice the longest cycle).
MAX_WINDOW = 2 * MAX_SCHEDULE_SLOTS
#: Earlier places of the same pattern tried as the start of a cycle, most recent first.
CANDIDATES = 8


@dataclass(frozen=True, slots=True)
class Cycle:
    group: str
    start_seq: int  # the group's next sequence number: slot 0
    slots: tuple[ScheduleSlot, ...]


class CycleDetector:
    def __init__(self, min_window: int = MIN_WINDOW) -> None:
        self.min_window = min_window
        self.group: str | None = None
        self.next_seq = 0
        self.history: list[ScheduleSlot] = []
        self._places: dict[tuple, list[int]] = {}  # slot -> its indexes in history

    def reset(self) -> None:
        self.group = None
        self.history = []
        self._places = {}

    def restart(self) -> None:
        """A schedule held for two cycles or more before it ended: the first window again."""
        self.min_window = MIN_WINDOW
        self.reset()

    def backoff(self) -> None:
        """A schedule ended before its cycle did: ask for a longer window next time."""
        self.min_window = min(self.min_window * 2, MAX_WINDOW)
        self.reset()

    def released(self, group: str, seq: int, slot: ScheduleSlot | None) -> Cycle | None:
        """One release (``slot`` None: one no schedule may hold); the cycle found, if any."""
        if slot is None:
            self.reset()
            return None
        if group != self.group or seq < self.next_seq or len(self.history) >= MAX_WINDOW:
            self.reset()
            self.group = group
        self.next_seq = seq + 1
        key = (slot.cache_id, slot.lane, slot.algo, slot.codec)
        n = len(self.history)
        self.history.append(slot)
        places = self._places.setdefault(key, [])
        found = None
        for place in reversed(places[-CANDIDATES:]):
            period = n - place
            repeats = max(2, -(-self.min_window // period))  # the cycle, whole, over the window at least
            if n + 1 < repeats * period or period > MAX_SCHEDULE_SLOTS:
                continue
            last = self.history[n + 1 - period:]
            if all(self.history[n + 1 - (r + 1) * period:n + 1 - r * period] == last for r in range(1, repeats)):
                found = Cycle(group, seq + 1, tuple(last))
                break
        places.append(n)
        return found
