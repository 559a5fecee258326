"""Every rank of an op takes one lane, even when the ranks' byte counts differ (an uneven all-to-all).

A config rule sends all-to-alls of at most ``LIMIT`` bytes to the gloo lane; the rest take the
default lane, tcp.  Three all-to-alls on two nodes: both nodes' buffers under the limit, one
node's under and the other's over it, both over.  The coordinator decides once per op (from the
largest buffer), so the daemons of both nodes must report the same lane for each op in their
mix, and every result must equal what the senders sent.
"""

from __future__ import annotations

from pathlib import Path

import fabric_workers as fw
import pytest

from commd.cli.status import format_status

pytestmark = pytest.mark.timeout(180)

LIMIT = 256  # bytes
#: rows[op][rank]: the elements (float32) a rank sends to rank 0 and rank 1
ROWS = [
    [[4, 4], [4, 4]],          # both nodes 32 B: under the limit → gloo on both
    [[4, 4], [4, 120]],        # node 0 32 B, node 1 496 B out: straddles → one lane on both (tcp, the larger)
    [[100, 100], [100, 100]],  # both 800 B: over → tcp on both
]


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
def test_ranks_with_different_bytes_take_the_same_lane(cluster, tmp_path: Path) -> None:
    config = tmp_path / "commd.toml"
    config.write_text(f'[scheduler]\ndefault_lane = "tcp"\ntuning = "off"\n\n[[rules]]\nkind = "alltoall"\n'
                      f'max_bytes = {LIMIT}\nlane = "gloo"\n')
    c = cluster(nnodes=2, nproc=1, extra=["--config", str(config)])
    results = c.join(c.start_workers(fw.uneven_all_to_all, ROWS), timeout=120)
    assert set(results.values()) == {"ok"}, results
    lanes = []
    for node in (0, 1):
        mix = [row for row in c.status(node)["mix"] if row["kind"] == "alltoall"]
        lanes.append({row["lane"]: row["ops"] for row in mix})
    assert lanes[0] == lanes[1] == {"gloo": 1, "tcp": 2}, lanes
    text = format_status(c.status(1))
    table = text[text.index("the mix:"):]
    assert "alltoall" in table and "gloo" in table and "tcp" in table, table
