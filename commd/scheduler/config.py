"""The scheduler's settings: the `[scheduler]` table of the config file, its lane, program and codec
rules, and their wire form (node 0 sends its settings to every node when the fabric forms).

Everything here is validated data; which lane an op gets is ``selection.choose_lane``'s.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commd.core.ops import COMPRESSED_KINDS
from commd.protocol import schema as s
from commd.protocol.fabric import MAX_ALGO_NAME
from commd.protocol.schema import LANE_NAMES
from commd.scheduler.tuning import UNEVEN_VARIANT, TuningTable

#: Every lane name a rule or hint may name.
DEFAULT_LANE = "tcp"
#: Chosen by measurement (see the README's performance section): fused buffers up to
#: 64 KiB stay on the tcp lane's direct all-reduce, whose result per element does not
#: depend on the element's position, so fused and unfused results are bit-identical.
DEFAULT_FUSION_THRESHOLD = 64 << 10
MAX_FUSION_THRESHOLD = 64 << 20
MAX_FUSION_CYCLE_MS = 1000.0
#: Children per daemon in the control tree (scheduler/tree.py): up to this many + 1 nodes it is a star.
DEFAULT_CONTROL_FANOUT = 8
MAX_CONTROL_FANOUT = 4096

#: The tables of the daemon's TOML config file and what each holds (``[limits]`` is read by
#: ``commd.daemon.limits``, ``[metrics]`` by ``commd.observe.settings``); any other table is refused.
CONFIG_TABLES: dict[str, str] = {
    "scheduler": "scheduling settings: the default lane, stall limits, fusion, the tuning table (in a fabric, "
                 "node 0's apply to every node)",
    "rules": "lane rules: which lane runs the ops of a kind, size and group size",
    "algorithms": "program rules: which collective program runs a tcp lane op",
    "compression": "codec rules: which codec an op that lets the daemons choose runs with",
    "limits": "per-client limits of this node's daemon",
    "metrics": "this node's Prometheus endpoint and textfile",
}
#: ``[scheduler]``'s keys and what each sets (the fields of ``SchedulerConfig`` of the same names).
SCHEDULER_KEYS: dict[str, str] = {
    "default_lane": f"the lane of an op no hint, rule or tuning table decides: one of {', '.join(LANE_NAMES)}",
    "stall_warning_s": "an op waiting longer than this many seconds is logged once and shown by `commd status`",
    "stall_shutdown_s": "node 0 shuts the fabric down when a stall lasts this long (0: never; else above "
                        "stall_warning_s)",
    "fusion_threshold_bytes": "small all-reduces released together are fused up to this many bytes in all "
                              f"(0: no fusion; at most {MAX_FUSION_THRESHOLD}; the flag and "
                              "COMMD_FUSION_THRESHOLD win)",
    "fusion_cycle_ms": "how long a node collects ready ops before reporting them (0: once per event-loop turn; "
                       f"at most {MAX_FUSION_CYCLE_MS:g}; the flag and COMMD_FUSION_CYCLE_MS win)",
    "control_fanout": "children per daemon in the control tree that carries reports and releases between "
                      f"node 0 and the others (2 to {MAX_CONTROL_FANOUT}; a fabric of at most this many + 1 nodes "
                      f"is a star; default {DEFAULT_CONTROL_FANOUT}; COMMD_CONTROL_FANOUT wins)",
    "tuning": "the tuning table: a path, \"off\", or \"\" for the default table (`--tuning` and COMMD_TUNING win)",
    "algorithms_dir": "this node's directory of collective programs (\"\": none; `--algorithms-dir` and "
                      "COMMD_ALGORITHMS_DIR win)",
}
#: The rule tables: table -> (the key naming what a rule chooses, what that key holds).
RULE_TABLES: dict[str, tuple[str, str]] = {
    "rules": ("lane", f"the lane for matching ops: one of {', '.join(LANE_NAMES)}"),
    "algorithms": ("name", "the program for matching tcp lane ops (a library program or a file of the "
                           "algorithms directory)"),
    "compression": ("codec", "a codec name, or \"none\": leave matching ops uncompressed (a lossy codec applies "
                             "only to ops that allow lossy codecs)"),
}
#: The keys every rule table has beside its own, and what each bounds (a rule matches an op within all).
RULE_RANGE_KEYS: dict[str, str] = {
    "kind": "the op kind the rule serves, \"*\" for any (lane rules may also name \"alltoallv\": the all-to-alls "
            "whose node-to-node blocks differ, which \"alltoall\" serves too; compression rules: a kind that "
            "compresses)",
    "min_bytes": "the smallest op, in bytes, the rule serves",
    "max_bytes": "the largest op, in bytes, the rule serves",
    "min_group": "the smallest group (in ranks) the rule serves",
    "max_group": "the largest group (in ranks) the rule serves",
}
#: Kinds a lane rule may name beside the op kinds: the uneven variants, which the tuning table
#: decides apart from their kind (``tuning.UNEVEN_VARIANT``), so a rule can too.
LANE_RULE_VARIANTS = frozenset(UNEVEN_VARIANT.values())
#: Boolean keys only some rule tables have: table -> key -> what it allows.
RULE_FLAGS: dict[str, dict[str, str]] = {
    "algorithms": {"allow_order_dependent": "let the rule pick an order-dependent program (`commd algo check` says "
                                            "which are) for float sum, product and avg ops too, whose results may "
                                            "then differ between nodes in the last bits (default false: those ops "
                                            "skip it)"},
}


@dataclass(frozen=True)
class LaneRule:
    """``kind`` ('*' for any), byte range [min_bytes, max_bytes], group-size range → ``lane``."""

    lane: str
    kind: str = "*"
    min_bytes: int = 0
    max_bytes: int = 1 << 62
    min_group: int = 1
    max_group: int = s.MAX_GROUP_SIZE

    def matches(self, kind: str, nbytes: int, group_size: int, variant: str | None = None) -> bool:
        """``variant``: the op's uneven variant (``alltoallv``: an all-to-all of unequal node-to-node
        blocks), which a rule may name to serve those ops only; a rule naming the kind serves both."""
        if (self.kind not in ("*", kind) and (variant is None or self.kind != variant)
                and not (self.kind == "send" and kind == "sendrecv")):
            return False
        return _within(self, nbytes, group_size)


@dataclass(frozen=True)
class AlgorithmRule:
    """``kind`` ('*' for any), byte range, group-size range → the program ``name`` (tcp lane ops).

    ``allow_order_dependent``: the rule may pick an order-dependent program for ops whose result
    depends on the reduction order (float sums, products, averages), giving up commd's
    bit-identical results on every node for the program's speed; by default those ops skip it."""

    name: str
    kind: str = "*"
    min_bytes: int = 0
    max_bytes: int = 1 << 62
    min_group: int = 1
    max_group: int = s.MAX_GROUP_SIZE
    allow_order_dependent: bool = False

    def matches(self, kind: str, nbytes: int, group_size: int) -> bool:
        return (self.kind == "*" or self.kind == kind) and _within(self, nbytes, group_size)


@dataclass(frozen=True)
class CodecRule:
    """``kind`` ('*' for any compressed kind), byte range, group-size range → ``codec`` (a
    ``commd.codecs`` name, or "none": leave such ops uncompressed) for ops that let the daemons
    choose.  A lossy codec applies only to ops that allowed lossy codecs (codec field "auto")."""

    codec: str
    kind: str = "*"
    min_bytes: int = 0
    max_bytes: int = 1 << 62
    min_group: int = 1
    max_group: int = s.MAX_GROUP_SIZE

    def matches(self, kind: str, nbytes: int, group_size: int) -> bool:
        return (self.kind == "*" or self.kind == kind) and _within(self, nbytes, group_size)


def _within(rule: LaneRule | AlgorithmRule | CodecRule, nbytes: int, group_size: int) -> bool:
    """Whether an op of ``nbytes`` on a group of ``group_size`` falls in a rule's ranges (both kinds of rule)."""
    return rule.min_bytes <= nbytes <= rule.max_bytes and rule.min_group <= group_size <= rule.max_group


@dataclass
class SchedulerConfig:
    """The daemon's `[scheduler]` settings and lane rules (from a TOML file)."""

    default_lane: str = DEFAULT_LANE
    rules: list[LaneRule] = field(default_factory=list)
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 0.0  # 0: never
    #: Small all-reduces released together are fused up to this many bytes (0: no fusion).
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD
    #: How long a node collects ready ops before reporting them (0: one report per loop turn).
    fusion_cycle_ms: float = 0.0
    #: Children per daemon in the control tree (node 0's value applies to every node).
    control_fanout: int = DEFAULT_CONTROL_FANOUT
    #: Where the tuning table comes from: a path, "off", or "" for the default location.
    tuning: str = ""
    #: The table in force (None: none, or refused; ``tuning_note`` says which and why).
    table: TuningTable | None = None
    tuning_note: str = "no tuning table"
    #: ``[[algorithms]]`` rules: which program runs a tcp lane op (node 0's decide).
    algorithm_rules: list[AlgorithmRule] = field(default_factory=list)
    #: ``[scheduler] algorithms_dir``: this node's user programs ("" = none; flag and env win).
    algorithms_dir: str = ""
    #: ``[[compression]]`` rules: which codec an op that lets the daemons choose runs with.
    codec_rules: list[CodecRule] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "default_lane": self.default_lane,
            "rules": [[r.lane, r.kind, r.min_bytes, r.max_bytes, r.min_group, r.max_group] for r in self.rules],
            "stall_warning_s": self.stall_warning_s,
            "stall_shutdown_s": self.stall_shutdown_s,
            "fusion_threshold_bytes": self.fusion_threshold_bytes,
            "fusion_cycle_ms": self.fusion_cycle_ms,
            "control_fanout": self.control_fanout,
            "table": self.table.to_json() if self.table is not None else None,
            "tuning_note": self.tuning_note,
            "algorithm_rules": [[r.name, r.kind, r.min_bytes, r.max_bytes, r.min_group, r.max_group,
                                 r.allow_order_dependent] for r in self.algorithm_rules],
            "codec_rules": [[r.codec, r.kind, r.min_bytes, r.max_bytes, r.min_group, r.max_group]
                            for r in self.codec_rules],
        }

    def adopt_table(self, table: TuningTable | None, nnodes: int, lanes: list[str]) -> None:
        """Use ``table`` if it was measured on a fabric like this one; else say why not and use the defaults."""
        if table is None:
            return
        problem = table.check_fabric(nnodes, lanes)
        where = table.source or "the coordinator's table"
        if problem is not None:
            self.table = None
            self.tuning_note = f"refused {where}: {problem}; using the default lane choice"
            return
        self.table = table
        self.tuning_note = f"using {where}: {table.describe()}"


def _number(table: dict[str, Any], key: str, where: str, default: float, low: float = 0.0) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise ValueError(f"{where}: '{key}' must be a number >= {low}, got {value!r}")
    return float(value)


def _int(table: dict[str, Any], key: str, where: str, default: int) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: '{key}' must be a non-negative integer, got {value!r}")
    return value


def parse_config(data: dict[str, Any], where: str = "config") -> SchedulerConfig:
    """Validate a config mapping (the TOML file's contents); errors name the key."""
    # [limits]: commd.daemon.limits reads it; [metrics]: commd.observe.settings
    unknown = set(data) - CONFIG_TABLES.keys()
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {sorted(unknown)}; known: {', '.join(CONFIG_TABLES)}")
    sched = data.get("scheduler", {})
    if not isinstance(sched, dict):
        raise ValueError(f"{where}: [scheduler] must be a table")
    unknown = set(sched) - SCHEDULER_KEYS.keys()
    if unknown:
        raise ValueError(f"{where}: unknown [scheduler] key(s) {sorted(unknown)}")
    config = SchedulerConfig()
    lane = sched.get("default_lane", DEFAULT_LANE)
    if lane not in LANE_NAMES:
        raise ValueError(f"{where}: [scheduler] default_lane {lane!r} is not one of {list(LANE_NAMES)}")
    config.default_lane = lane
    config.stall_warning_s = _number(sched, "stall_warning_s", f"{where} [scheduler]", 60.0, 0.001)
    config.stall_shutdown_s = _number(sched, "stall_shutdown_s", f"{where} [scheduler]", 0.0)
    config.fusion_threshold_bytes = _int(sched, "fusion_threshold_bytes", f"{where} [scheduler]",
                                         DEFAULT_FUSION_THRESHOLD)
    if config.fusion_threshold_bytes > MAX_FUSION_THRESHOLD:
        raise ValueError(f"{where}: [scheduler] fusion_threshold_bytes must be at most {MAX_FUSION_THRESHOLD}")
    config.fusion_cycle_ms = _number(sched, "fusion_cycle_ms", f"{where} [scheduler]", 0.0)
    if config.fusion_cycle_ms > MAX_FUSION_CYCLE_MS:
        raise ValueError(f"{where}: [scheduler] fusion_cycle_ms must be at most {MAX_FUSION_CYCLE_MS:g}")
    config.control_fanout = _int(sched, "control_fanout", f"{where} [scheduler]", DEFAULT_CONTROL_FANOUT)
    if not 2 <= config.control_fanout <= MAX_CONTROL_FANOUT:
        raise ValueError(f"{where}: [scheduler] control_fanout must lie in [2, {MAX_CONTROL_FANOUT}], "
                         f"got {config.control_fanout}")
    tuning = sched.get("tuning", "")
    if not isinstance(tuning, str):
        raise ValueError(f"{where}: [scheduler] tuning must be a path or \"off\", got {tuning!r}")
    config.tuning = tuning
    algorithms_dir = sched.get("algorithms_dir", "")
    if not isinstance(algorithms_dir, str):
        raise ValueError(f"{where}: [scheduler] algorithms_dir must be a path, got {algorithms_dir!r}")
    config.algorithms_dir = algorithms_dir
    config.algorithm_rules = _algorithm_rules(data.get("algorithms", []), where)
    config.codec_rules = _codec_rules(data.get("compression", []), where)
    for at, raw, kind, ranges in _ranged_tables(data.get("rules", []), where, "rules", "lane",
                                                s.OP_KINDS | LANE_RULE_VARIANTS):
        if raw.get("lane") not in LANE_NAMES:
            raise ValueError(f"{at}: 'lane' must be one of {list(LANE_NAMES)}, got {raw.get('lane')!r}")
        config.rules.append(LaneRule(lane=raw["lane"], kind=kind, **ranges))
    if config.stall_shutdown_s and config.stall_shutdown_s <= config.stall_warning_s:
        raise ValueError(f"{where}: stall_shutdown_s must exceed stall_warning_s (or be 0 to disable)")
    return config


def _ranged_tables(rules: Any, where: str, table: str, key: str,
                   kinds: frozenset[str] | set[str] | tuple[str, ...], kinds_are: str = ""):  # noqa: ANN202
    """Each table of the array ``[[table]]``, checked alike: a table, no key but ``key``, ``kind`` and the
    four ranges; ``kind`` '*' or one of ``kinds``; ranges not empty.  Yields (where, table, kind, ranges)."""
    if not isinstance(rules, list):
        raise ValueError(f"{where}: '{table}' must be an array of tables ([[{table}]])")
    for i, raw in enumerate(rules):
        at = f"{where} {table}[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{at}: must be a table")
        flags = RULE_FLAGS.get(table, {})
        unknown = set(raw) - {key, *RULE_RANGE_KEYS, *flags}
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {sorted(unknown)}")
        for flag in flags:
            if flag in raw and not isinstance(raw[flag], bool):
                raise ValueError(f"{at}: '{flag}' must be true or false, got {raw[flag]!r}")
        kind = raw.get("kind", "*")
        if kind != "*" and kind not in kinds:
            raise ValueError(f"{at}: 'kind' {kind!r} is not '*' or {kinds_are or 'one of'} {sorted(kinds)}")
        ranges = {"min_bytes": _int(raw, "min_bytes", at, 0), "max_bytes": _int(raw, "max_bytes", at, 1 << 62),
                  "min_group": _int(raw, "min_group", at, 1), "max_group": _int(raw, "max_group", at, s.MAX_GROUP_SIZE)}
        if ranges["min_bytes"] > ranges["max_bytes"] or ranges["min_group"] > ranges["max_group"]:
            raise ValueError(f"{at}: empty range (min above max)")
        yield at, raw, kind, ranges


def _algorithm_rules(rules: Any, where: str) -> list[AlgorithmRule]:
    """``[[algorithms]]``: each a program ``name`` with the kind, size and group-size ranges it serves."""
    out = []
    for at, raw, kind, ranges in _ranged_tables(rules, where, "algorithms", "name", s.OP_KINDS):
        name = raw.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ALGO_NAME:
            raise ValueError(f"{at}: 'name' must be an algorithm's name (1 to {MAX_ALGO_NAME} characters), "
                             f"got {name!r}")
        out.append(AlgorithmRule(name=name, kind=kind, **ranges,
                                 allow_order_dependent=raw.get("allow_order_dependent", False)))
    return out


def _codec_rules(rules: Any, where: str) -> list[CodecRule]:
    """``[[compression]]``: each a ``codec`` (or "none") with the compressed kind, size and group-size
    ranges it serves."""
    from commd.codecs import CodecError, get

    out = []
    for at, raw, kind, ranges in _ranged_tables(rules, where, "compression", "codec", COMPRESSED_KINDS,
                                                "a kind that compresses"):
        codec = raw.get("codec")
        if codec != s.NO_CODEC:
            try:
                get(codec)
            except CodecError as exc:
                raise ValueError(f"{at}: 'codec': {exc}, or {s.NO_CODEC!r} (leave such ops uncompressed)") from None
        out.append(CodecRule(codec=codec, kind=kind, **ranges))
    return out


def load_config(path: str | Path) -> SchedulerConfig:
    """Read and validate a TOML config file."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {path} is not valid TOML: {exc}") from None
    return parse_config(data, str(path))


def config_from_wire(raw: dict[str, Any]) -> SchedulerConfig:
    rules = [LaneRule(r[0], r[1], r[2], r[3], r[4], r[5]) for r in raw.get("rules", [])]
    config = SchedulerConfig(raw["default_lane"], rules, raw["stall_warning_s"], raw["stall_shutdown_s"],
                             raw["fusion_threshold_bytes"], raw["fusion_cycle_ms"])
    if raw.get("table") is not None:
        config.table = TuningTable.from_json(raw["table"], "the coordinator's tuning table")
    config.tuning_note = str(raw.get("tuning_note", ""))
    fanout = raw.get("control_fanout", DEFAULT_CONTROL_FANOUT)
    if type(fanout) is not int or not 2 <= fanout <= MAX_CONTROL_FANOUT:
        raise ValueError(f"the coordinator's control_fanout must be an integer in [2, {MAX_CONTROL_FANOUT}], "
                         f"got {fanout!r}")
    config.control_fanout = fanout
    config.algorithm_rules = [AlgorithmRule(*r) for r in raw.get("algorithm_rules", [])]
    config.codec_rules = [CodecRule(*r) for r in raw.get("codec_rules", [])]
    return config
