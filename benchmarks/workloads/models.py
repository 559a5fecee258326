"""Three training workloads with the communication of the models they stand for.

* ``moe``: a small transformer whose feed-forward layers are experts sharded over an
  expert-parallel (EP) group, DeepSpeed-MoE style: per MoE layer a dispatch and a combine
  ``all_to_all_single`` forward and the same two backward.  ``routing="capacity"`` pads every
  expert's tokens to a capacity (even splits, [experts, capacity, d_model]); ``"dropless"``
  sends exactly the routed tokens (uneven splits, Megatron-core dispatcher style), learning
  the splits from an ``all_to_all_single`` of the per-expert token counts, plus a one-integer
  MAX ``all_reduce`` of the busiest expert's load.  Replicated parameters: DDP over all ranks;
  expert parameters: one all-reduce over the expert-data-parallel group.
* ``dlrm``: embedding tables sharded by table (a different number of tables per rank, so every
  rank sends a different number of bytes), one uneven ``all_to_all_single`` of the pooled
  embeddings issued async and overlapped with the bottom MLP, its reverse backward, and DDP
  over the bottom and top MLPs.
* ``megatron``: GPT blocks with Megatron tensor parallelism (column- then row-parallel linears
  in attention and MLP; two TP all-reduces forward and two backward per layer), DDP over the
  data-parallel group.

Everything is float32 on CPU and seeded from ``cfg["seed"]``: parameters that ranks replicate
start equal, and each rank's data depends only on (seed, step, data rank), so runs on
different backends see identical inputs.  A world of one (``Groups`` with ``all=None``) is a
single-process model of the same computation: ``data_ranks`` then says how many ranks' data
it trains on, the reference a parallel run is checked against.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .groups import Groups

#: Sizes per workload and preset; any key can be overridden in the config.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "moe": {
        "tiny": {"vocab": 64, "seq": 16, "batch": 2, "d_model": 16, "heads": 2, "ffn": 32, "layers": 2,
                 "experts": 4, "capacity_factor": 1.25, "lr": 0.1},
        "bench": {"vocab": 512, "seq": 64, "batch": 4, "d_model": 128, "heads": 4, "ffn": 256, "layers": 2,
                  "experts": 8, "capacity_factor": 1.25, "lr": 0.1},
    },
    "dlrm": {
        "tiny": {"dense_in": 8, "bottom": [32], "top": [32], "dim": 8, "tables": 6, "rows": 50, "pooling": 2,
                 "batch": 8, "lr": 0.1},
        "bench": {"dense_in": 13, "bottom": [512, 128], "top": [512, 256], "dim": 64, "tables": 10,
                  "rows": 2000, "pooling": 4, "batch": 128, "lr": 0.1},
    },
    "megatron": {
        "tiny": {"vocab": 64, "seq": 16, "batch": 2, "d_model": 16, "heads": 4, "ffn": 64, "layers": 2, "lr": 0.1},
        "bench": {"vocab": 512, "seq": 64, "batch": 4, "d_model": 256, "heads": 8, "ffn": 1024, "layers": 2,
                  "lr": 0.1},
    },
}


# ---- seeding --------------------------------------------------------------------------
def _seed(*keys: Any) -> int:
    """A 63-bit seed from any keys: every (seed, purpose, step, rank) gets its own stream."""
    return int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:8], "little") >> 1


def _gen(*keys: Any) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*keys))


@contextmanager
def _seeded(*keys: Any) -> Iterator[None]:
    """Module construction under a seed of its own, leaving the global RNG as it was (so what one
    rank builds in addition, e.g. its experts, never shifts what the others build)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(*keys))
        yield


# ---- communication, counted ------------------------------------------------------------
@dataclass
class CommLog:
    """Ops this workload issues itself (DDP's all-reduces are read from DDP), summed over steps."""

    steps: int = 0
    totals: dict[tuple[str, str, str, str], list[float]] = field(default_factory=dict)

    def add(self, op: str, group: str, phase: str, what: str, sent: int, received: int) -> None:
        entry = self.totals.setdefault((op, group, phase, what), [0, 0, 0])
        entry[0] += 1
        entry[1] += sent
        entry[2] += received

    def per_step(self) -> list[dict[str, Any]]:
        steps = max(self.steps, 1)
        return [{"op": op, "group": group, "phase": phase, "what": what, "count": n / steps,
                 "bytes_sent": s / steps, "bytes_received": r / steps}
                for (op, group, phase, what), (n, s, r) in self.totals.items()]


@dataclass
class Channel:
    """A process group with the name its ops are counted under."""

    group: Any
    name: str
    log: CommLog

    def all_to_all(self, x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None,
                   phase: str, what: str, async_op: bool = False) -> tuple[torch.Tensor, Any]:
        """``all_to_all_single`` of ``x`` (rows along dim 0; even when the splits are None)."""
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group, async_op=async_op)
        self.log.add("all_to_all_single", self.name, phase, what, x.numel() * x.element_size(),
                     out.numel() * out.element_size())
        return out, work

    def all_reduce(self, x: torch.Tensor, phase: str, what: str, op: Any = dist.ReduceOp.SUM) -> None:
        dist.all_reduce(x, op=op, group=self.group)
        nbytes = x.numel() * x.element_size()
        self.log.add("all_reduce", self.name, phase, what, nbytes, nbytes)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` forward (async when ``pending`` is a list: its work is appended there
    and the caller waits before reading the output); the reverse exchange backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, channel: Channel, what: str, out_splits: list[int] | None,
                in_splits: list[int] | None, pending: list[Any] | None = None) -> torch.Tensor:
        ctx.channel, ctx.what, ctx.out_splits, ctx.in_splits = channel, what, out_splits, in_splits
        out, work = channel.all_to_all(x, out_splits, in_splits, "forward", what, async_op=pending is not None)
        if pending is not None:
            pending.append(work)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back, _ = ctx.channel.all_to_all(grad, ctx.in_splits, ctx.out_splits, "backward", ctx.what)
        return back, None, None, None, None, None


def _exchange(x: torch.Tensor, channel: Channel | None, what: str, out_splits: list[int] | None = None,
              in_splits: list[int] | None = None) -> torch.Tensor:
    return x if channel is None else _AllToAll.apply(x, channel, what, out_splits, in_splits)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, channel: Channel) -> torch.Tensor:
        ctx.channel = channel
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        ctx.channel.all_reduce(grad, "backward", "activation grads")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial sums over the TP group forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, channel: Channel) -> torch.Tensor:
        channel.all_reduce(x, "forward", "activations")
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _ddp(module: nn.Module, group: Any, ignore: list[str] | None = None) -> nn.Module:
    """DDP over ``group`` (the module itself when there is no group: a single-process run)."""
    if group is None:
        return module
    if ignore:
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignore)
    return nn.parallel.DistributedDataParallel(module, process_group=group)


def _ddp_buckets(module: nn.Module) -> list[int]:
    """The bytes of each bucket DDP all-reduces per step (one all-reduce each), as the reducer holds
    them now (after the first step it has rebuilt them in gradient order, the first one small)."""
    if not isinstance(module, nn.parallel.DistributedDataParallel):
        return []
    return [b.buffer().numel() * b.buffer().element_size() for b in module.reducer._get_zeros_like_grad_buckets()]


def _group_ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


# ---- the workload interface ----------------------------------------------------------------
class Workload:
    """One rank's share of a training job: ``step`` runs forward, backward (with the workload's
    communication) and the optimizer step, and returns this rank's loss."""

    name = ""

    def __init__(self, cfg: dict[str, Any], groups: Groups) -> None:
        self.cfg, self.groups, self.log = cfg, groups, CommLog()
        self.all = Channel(groups.all, "all", self.log) if groups.all is not None else None
        #: Ranks whose data one step trains on (more than one only in a single-process reference).
        self.data_ranks = int(cfg.get("data_ranks", 1)) if groups.world == 1 else 1
        self.optimizer: torch.optim.Optimizer | None = None

    def step(self, step: int) -> float:
        raise NotImplementedError

    def modules(self) -> list[nn.Module]:
        """The (unwrapped) modules holding this rank's parameters, in a fixed order."""
        raise NotImplementedError

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{i}.{name}", p) for i, m in enumerate(self.modules()) for name, p in m.named_parameters()]

    def parameters(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]

    def reference_name(self, name: str) -> str | None:
        """The name (``named_parameters``) this rank's parameter ``name`` has in the single-process
        model (``build(..., local_groups())``); None for a slice of one (a tensor-parallel shard)."""
        return name

    def params_digest(self) -> str:
        """sha256 of this rank's parameters' bytes, in order: equal digests, bit-identical models."""
        digest = hashlib.sha256()
        for p in self.parameters():
            digest.update(p.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def ddp_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        """DDP-wrapped modules by name, with their groups (their all-reduces are DDP's)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What one step sends: this workload's own ops (mean per step so far) and DDP's buckets."""
        ops = self.log.per_step()
        for label, (module, group) in self.ddp_modules().items():
            name = self.group_name(group)
            buckets = _ddp_buckets(module)
            if buckets:
                total = float(sum(buckets))
                ops.append({"op": "all_reduce", "group": name, "phase": "backward", "what": f"{label} grads (DDP)",
                            "count": float(len(buckets)), "bytes_sent": total, "bytes_received": total,
                            "ranks": _group_ranks(group)})
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        return {"workload": self.name, "rank": self.groups.rank, "world": self.groups.world, "param_bytes": params,
                "sizes": {k: v for k, v in self.cfg.items() if k not in ("out",)}, "ops_per_step": ops,
                "groups": self.group_ranks()}

    def group_ranks(self) -> dict[str, list[int] | None]:
        return {"all": _group_ranks(self.groups.all)}

    def group_name(self, group: Any) -> str:
        """The name ``group_ranks`` gives ``group``."""
        for name in self.group_ranks():
            if getattr(self.groups, name) is group:
                return name
        return "?"

    def _token_step(self, step: int, stream: str, own_rank: int, before_step: Any = None) -> float:
        """One step of a token model: the mean cross-entropy over this rank's batch (or, in the one-process
        reference, over every data rank's), then the optimizer step."""
        self.log.steps += 1
        self.optimizer.zero_grad()
        losses = []
        for data_rank in range(self.data_ranks) if self.data_ranks > 1 else [own_rank]:
            tokens, targets = _token_batch(self.cfg, stream, step, data_rank)
            logits = self.ddp(tokens)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)))
        return self._optimize(torch.stack(losses).mean(), before_step)

    def _optimize(self, loss: torch.Tensor, before_step: Any = None) -> float:
        assert self.optimizer is not None
        loss.backward()
        if before_step is not None:
            before_step()
        self.optimizer.step()
        return float(loss.detach())


# ---- MoE ----------------------------------------------------------------------------------
class MoELayer(nn.Module):
    """Top-1 gated experts, ``experts // ep_size`` of them on this rank (global indices
    ep_rank * local .. + local), exchanging tokens with the EP group."""

    def __init__(self, cfg: dict[str, Any], layer: int, ep: Channel | None, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        d, self.num_experts, self.ep, self.ep_size = cfg["d_model"], cfg["experts"], ep, ep_size
        if self.num_experts % ep_size:
            raise ValueError(f"{self.num_experts} experts do not divide over {ep_size} EP ranks")
        self.local = self.num_experts // ep_size
        self.routing, self.capacity_factor = cfg.get("routing", "capacity"), cfg["capacity_factor"]
        if self.routing not in ("capacity", "dropless"):
            raise ValueError(f"unknown routing {self.routing!r}: capacity or dropless")
        self.gate = nn.Linear(d, self.num_experts, bias=False)
        self.experts = nn.ModuleList()
        for local in range(self.local):
            with _seeded(cfg["seed"], "expert", layer, ep_rank * self.local + local):
                self.experts.append(nn.Sequential(nn.Linear(d, cfg["ffn"]), nn.GELU(), nn.Linear(cfg["ffn"], d)))
        #: The most tokens any expert of the EP group got in the last forward (dropless routing).
        self.max_load = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weight, expert = F.softmax(self.gate(tokens), dim=-1).max(dim=-1)
        routed = self._capacity(tokens, expert) if self.routing == "capacity" else self._dropless(tokens, expert)
        return (routed * weight.unsqueeze(1)).view_as(x)

    def _capacity(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Every expert gets ``capacity`` slots per rank; tokens past it are dropped (output 0)."""
        n, d = tokens.shape
        experts, ep, local = self.num_experts, self.ep_size, self.local
        capacity = max(1, math.ceil(n / experts * self.capacity_factor))
        onehot = F.one_hot(expert, experts)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1
        keep = position < capacity
        slot = expert * capacity + position.clamp(max=capacity - 1)
        slots = tokens.new_zeros(experts * capacity, d).index_copy(0, slot[keep], tokens[keep])
        mine = _exchange(slots.view(experts, capacity, d), self.ep, "dispatch").view(ep, local, capacity, d)
        done = torch.stack([self.experts[e](mine[:, e].reshape(ep * capacity, d)).view(ep, capacity, d)
                            for e in range(local)], dim=1)
        back = _exchange(done.view(experts, capacity, d), self.ep, "combine").view(experts * capacity, d)
        return back.index_select(0, slot) * keep.unsqueeze(1).to(tokens.dtype)

    def _dropless(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Exactly the routed tokens travel: counts first (they give the splits), then the tokens."""
        ep, local = self.ep_size, self.local
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.num_experts)
        if self.ep is not None:
            received_counts, _ = self.ep.all_to_all(counts, None, None, "forward", "token counts")
        else:
            received_counts = counts
        load = received_counts.view(ep, local).sum(0).max().view(1)
        if self.ep is not None:
            self.ep.all_reduce(load, "forward", "max expert load (MAX)", dist.ReduceOp.MAX)
        self.max_load = int(load)
        in_splits = counts.view(ep, local).sum(1).tolist()
        out_splits = received_counts.view(ep, local).sum(1).tolist()
        received = _exchange(tokens.index_select(0, order), self.ep, "dispatch", out_splits, in_splits)
        sizes = received_counts.tolist()  # chunk q * local + e: peer q's tokens for my expert e
        chunks = received.split(sizes)
        outputs: list[list[torch.Tensor]] = []
        for e in range(local):
            rows = [sizes[q * local + e] for q in range(ep)]
            outputs.append(list(self.experts[e](torch.cat([chunks[q * local + e] for q in range(ep)])).split(rows)))
        done = torch.cat([outputs[e][q] for q in range(ep) for e in range(local)])
        back = _exchange(done, self.ep, "combine", in_splits, out_splits)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return back.index_select(0, inverse)


class MoEBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer: int, ep: Channel | None, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, cfg["heads"], batch_first=True)
        self.moe = MoELayer(cfg, layer, ep, ep_size, ep_rank)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class MoEModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], ep: Channel | None, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.embed, self.pos = nn.Embedding(cfg["vocab"], d), nn.Embedding(cfg["seq"], d)
        self.blocks = nn.ModuleList(MoEBlock(cfg, i, ep, ep_size, ep_rank) for i in range(cfg["layers"]))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, cfg["vocab"])
        self.mask = _causal_mask(cfg["seq"])  # not a buffer: DDP would broadcast it every step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))

    def expert_names(self) -> list[str]:
        return [name for name, _ in self.named_parameters() if ".experts." in name]


def _token_batch(cfg: dict[str, Any], purpose: str, step: int, data_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences x[t+1] = 3 x[t] + 1 (mod vocab) from random starts, one token in ten replaced by
    noise: inputs and next-token targets."""
    g = _gen(cfg["seed"], purpose, step, data_rank)
    vocab, seq = cfg["vocab"], cfg["seq"] + 1
    start = torch.randint(vocab, (cfg["batch"], 1), generator=g)
    powers = torch.tensor([pow(3, t, vocab) for t in range(seq)])
    offsets = torch.tensor([sum(pow(3, i, vocab) for i in range(t)) % vocab for t in range(seq)])
    seqs = (start * powers + offsets) % vocab
    noise = torch.rand(seqs.shape, generator=g) < 0.1
    seqs = torch.where(noise, torch.randint(vocab, seqs.shape, generator=g), seqs)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


class MoEWorkload(Workload):
    name = "moe"

    def __init__(self, cfg: dict[str, Any], groups: Groups) -> None:
        super().__init__(cfg, groups)
        self.ep = Channel(groups.ep, "ep", self.log) if groups.ep is not None else None
        self.expert_dp = Channel(groups.expert_dp, "expert_dp", self.log) if groups.expert_dp is not None else None
        with _seeded(cfg["seed"], "moe"):
            self.model = MoEModel(cfg, self.ep, groups.ep_size, groups.ep_rank)
        self.expert_params = [p for name, p in self.model.named_parameters() if ".experts." in name]
        self.ddp = _ddp(self.model, groups.all, self.model.expert_names())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"])

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def ddp_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        return {"replicated": (self.ddp, self.groups.all)}

    def group_ranks(self) -> dict[str, list[int] | None]:
        return {"all": _group_ranks(self.groups.all), "ep": _group_ranks(self.groups.ep),
                "expert_dp": _group_ranks(self.groups.expert_dp)}

    def _reduce_expert_grads(self) -> None:
        """Expert gradients summed over the ranks holding the same experts, divided by the world
        size as DDP divides the others: every gradient is that of the mean loss over all ranks."""
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.groups.world)
        if self.expert_dp is not None:
            self.expert_dp.all_reduce(flat, "backward", "expert grads")
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def step(self, step: int) -> float:
        return self._token_step(step, "moe-data", self.groups.rank, self._reduce_expert_grads)

    def reference_name(self, name: str) -> str | None:
        """Local expert l of this rank is expert ep_rank * local + l of the whole model."""
        parts = name.split(".")
        if "experts" in parts:
            at = parts.index("experts") + 1
            local = self.cfg["experts"] // self.groups.ep_size
            parts[at] = str(self.groups.ep_rank * local + int(parts[at]))
        return ".".join(parts)

    def max_loads(self) -> list[int]:
        return [block.moe.max_load for block in self.model.blocks]


# ---- DLRM ---------------------------------------------------------------------------------
def table_owners(tables: int, world: int) -> list[int]:
    """The rank owning each table: contiguous blocks, rank r getting about (r + 1) shares, so every
    rank holds a different number of tables (1, 2, 3, 4 of 10 at world 4)."""
    if tables < world:
        raise ValueError(f"{tables} tables cannot give each of {world} ranks one")
    weights = [r + 1 for r in range(world)]
    exact = [tables * w / sum(weights) for w in weights]
    counts = [max(1, int(x)) for x in exact]
    for r in sorted(range(world), key=lambda r: int(exact[r]) - exact[r]):
        if sum(counts) >= tables:
            break
        counts[r] += 1
    while sum(counts) > tables:
        counts[counts.index(max(counts))] -= 1
    return [r for r in range(world) for _ in range(counts[r])]


def table_rows(cfg: dict[str, Any], table: int) -> int:
    return cfg["rows"] * (1 + table % 3)


class DLRMTables(nn.Module):
    """This rank's embedding tables (sum-pooled bags), each initialised from its own seed."""

    def __init__(self, cfg: dict[str, Any], owned: list[int]) -> None:
        super().__init__()
        self.owned = owned
        self.bags = nn.ModuleList()
        for t in owned:
            rows = table_rows(cfg, t)
            bag = nn.EmbeddingBag(rows, cfg["dim"], mode="sum")
            with torch.no_grad():
                bound = math.sqrt(1.0 / rows)
                bag.weight.copy_(torch.rand(bag.weight.shape, generator=_gen(cfg["seed"], "table", t)) * 2 * bound - bound)
            self.bags.append(bag)

    def forward(self, indices: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([bag(indices[t]) for t, bag in zip(self.owned, self.bags, strict=True)], dim=1)


class DLRMWorkload(Workload):
    name = "dlrm"

    def __init__(self, cfg: dict[str, Any], groups: Groups) -> None:
        super().__init__(cfg, groups)
        world = groups.world
        self.owners = table_owners(cfg["tables"], world)
        self.per_rank = [self.owners.count(r) for r in range(world)]
        self.tables = DLRMTables(cfg, [t for t, r in enumerate(self.owners) if r == groups.rank])
        d, n = cfg["dim"], cfg["tables"]
        with _seeded(cfg["seed"], "dlrm-mlp"):
            self.bottom = _mlp([cfg["dense_in"], *cfg["bottom"], d], last_relu=True)
            self.top = _mlp([d + n * (n + 1) // 2, *cfg["top"], 1], last_relu=False)
        self.bottom_ddp = _ddp(self.bottom, groups.all)
        self.top_ddp = _ddp(self.top, groups.all)
        self.teacher = torch.randn(cfg["dense_in"], generator=_gen(cfg["seed"], "dlrm-teacher"))
        params = [*self.bottom.parameters(), *self.top.parameters(), *self.tables.parameters()]
        self.optimizer = torch.optim.SGD(params, lr=cfg["lr"])
        self.tril = torch.tril_indices(n + 1, n + 1, offset=-1)

    def modules(self) -> list[nn.Module]:
        return [self.bottom, self.top, self.tables]

    def ddp_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        return {"bottom MLP": (self.bottom_ddp, self.groups.all), "top MLP": (self.top_ddp, self.groups.all)}

    def batch(self, step: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """This rank's dense features and labels, and every table's indices for the whole global
        batch (rank q's samples are rows q * batch ..): the table owners look them up."""
        cfg, ranks = self.cfg, max(self.groups.world, self.data_ranks)
        b = cfg["batch"]
        local = range(ranks) if self.data_ranks > 1 else [self.groups.rank]
        dense = torch.cat([torch.randn(b, cfg["dense_in"], generator=_gen(cfg["seed"], "dlrm-dense", step, r))
                           for r in local])
        indices = [torch.randint(table_rows(cfg, t), (ranks * b, cfg["pooling"]),
                                 generator=_gen(cfg["seed"], "dlrm-idx", step, t)) for t in range(cfg["tables"])]
        rows = torch.cat([torch.arange(r * b, (r + 1) * b) for r in local])
        signal = dense @ self.teacher + sum(torch.cos(0.7 * idx[rows, 0].float() + t) for t, idx in enumerate(indices))
        return dense, indices, (signal > 0).float()

    def step(self, step: int) -> float:
        self.log.steps += 1
        cfg, groups = self.cfg, self.groups
        d, n = cfg["dim"], cfg["tables"]
        self.optimizer.zero_grad()
        dense, indices, labels = self.batch(step)
        pooled = self.tables(indices)  # [world * batch, my tables * dim]
        b = dense.shape[0]
        if self.all is not None:
            mine = self.per_rank[groups.rank] * d * cfg["batch"]
            in_splits = [mine] * groups.world
            out_splits = [count * d * cfg["batch"] for count in self.per_rank]
            pending: list[Any] = []
            received = _AllToAll.apply(pooled.reshape(-1), self.all, "pooled embeddings", out_splits, in_splits,
                                       pending)
            x = self.bottom_ddp(dense)  # overlaps the exchange
            pending[0].wait()
            emb = torch.cat([c.view(b, -1) for c in received.split(out_splits)], dim=1)
        else:
            emb, x = pooled, self.bottom_ddp(dense)
        z = torch.cat([x.unsqueeze(1), emb.view(b, n, d)], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.tril[0], self.tril[1]]
        logit = self.top_ddp(torch.cat([x, dots], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, labels)
        return self._optimize(loss, self._scale_table_grads)

    def reference_name(self, name: str) -> str | None:
        """This rank's j-th table is table owned[j] of the whole model."""
        parts = name.split(".")
        if parts[:2] == ["2", "bags"]:
            parts[2] = str(self.tables.owned[int(parts[2])])
        return ".".join(parts)

    def _scale_table_grads(self) -> None:
        """A table's gradient sums every rank's (local-mean) loss: divided by the world size as DDP
        divides the MLPs', it is the gradient of the global mean loss."""
        for p in self.tables.parameters():
            if p.grad is not None:
                p.grad.div_(self.groups.world)


# ---- Megatron -----------------------------------------------------------------------------
class ParallelBlock(nn.Module):
    """A GPT block whose attention heads and MLP columns are split over ``tp_size`` ranks:
    column-parallel QKV / fc1, row-parallel projection / fc2 (their bias added after the sum)."""

    def __init__(self, cfg: dict[str, Any], tp: Channel | None, tp_size: int) -> None:
        super().__init__()
        d, heads, ffn = cfg["d_model"], cfg["heads"], cfg["ffn"]
        if heads % tp_size or ffn % tp_size or d % heads:
            raise ValueError(f"heads {heads} / ffn {ffn} must divide by tp {tp_size}, d_model {d} by heads")
        self.tp, self.heads, self.head_dim = tp, heads // tp_size, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * self.heads * self.head_dim)
        self.proj = nn.Linear(self.heads * self.head_dim, d, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(d))
        self.fc1 = nn.Linear(d, ffn // tp_size)
        self.fc2 = nn.Linear(ffn // tp_size, d, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(d))

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else _CopyToTP.apply(x, self.tp)

    def _g(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp is None else _ReduceFromTP.apply(x, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self._f(self.ln1(x))).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self._g(self.proj(attn.transpose(1, 2).reshape(b, s, -1))) + self.proj_bias
        h = F.gelu(self.fc1(self._f(self.ln2(x))))
        return x + self._g(self.fc2(h)) + self.fc2_bias

    def load_shard(self, full: ParallelBlock, tp_rank: int) -> None:
        """Take tensor-parallel rank ``tp_rank``'s slices of an unsplit block's weights."""
        heads = slice(tp_rank * self.heads, (tp_rank + 1) * self.heads)
        cols = slice(tp_rank * self.heads * self.head_dim, (tp_rank + 1) * self.heads * self.head_dim)
        width = self.fc1.out_features
        rows = slice(tp_rank * width, (tp_rank + 1) * width)
        d = full.qkv.in_features
        with torch.no_grad():
            for name in ("ln1", "ln2"):
                getattr(self, name).load_state_dict(getattr(full, name).state_dict())
            self.qkv.weight.copy_(full.qkv.weight.view(3, full.heads, full.head_dim, d)[:, heads].reshape(-1, d))
            self.qkv.bias.copy_(full.qkv.bias.view(3, full.heads, full.head_dim)[:, heads].reshape(-1))
            self.proj.weight.copy_(full.proj.weight[:, cols])
            self.proj_bias.copy_(full.proj_bias)
            self.fc1.weight.copy_(full.fc1.weight[rows])
            self.fc1.bias.copy_(full.fc1.bias[rows])
            self.fc2.weight.copy_(full.fc2.weight[:, rows])
            self.fc2_bias.copy_(full.fc2_bias)


class ParallelGPT(nn.Module):
    """GPT with replicated embeddings, final norm and head, and ``ParallelBlock`` layers."""

    def __init__(self, cfg: dict[str, Any], tp: Channel | None, tp_size: int) -> None:
        super().__init__()
        d = cfg["d_model"]
        self.embed, self.pos = nn.Embedding(cfg["vocab"], d), nn.Embedding(cfg["seq"], d)
        self.blocks = nn.ModuleList(ParallelBlock(cfg, tp, tp_size) for _ in range(cfg["layers"]))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, cfg["vocab"], bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def load_shard(self, full: ParallelGPT, tp_rank: int) -> None:
        with torch.no_grad():
            for name in ("embed", "pos", "ln_f", "head"):
                getattr(self, name).load_state_dict(getattr(full, name).state_dict())
        for mine, whole in zip(self.blocks, full.blocks, strict=True):
            mine.load_shard(whole, tp_rank)


def full_gpt(cfg: dict[str, Any]) -> ParallelGPT:
    """The unsplit model every tensor-parallel shard is cut from (the same on every rank)."""
    with _seeded(cfg["seed"], "gpt"):
        return ParallelGPT(cfg, None, 1)


class MegatronWorkload(Workload):
    name = "megatron"

    def __init__(self, cfg: dict[str, Any], groups: Groups) -> None:
        super().__init__(cfg, groups)
        self.tp = Channel(groups.tp, "tp", self.log) if groups.tp is not None else None
        full = full_gpt(cfg)
        if groups.tp_size > 1:
            self.model = ParallelGPT(cfg, self.tp, groups.tp_size)
            self.model.load_shard(full, groups.tp_rank)
        else:
            self.model = full
        self.ddp = _ddp(self.model, groups.dp)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg["lr"])

    def modules(self) -> list[nn.Module]:
        return [self.model]

    def ddp_modules(self) -> dict[str, tuple[nn.Module, Any]]:
        return {"model": (self.ddp, self.groups.dp)}

    def reference_name(self, name: str) -> str | None:
        """Split over the TP group: QKV, fc1 (by rows) and the projection, fc2 weights (by columns)."""
        split = any(part in name for part in (".qkv.", ".fc1.", ".proj.weight", ".fc2.weight"))
        return None if split and self.groups.tp_size > 1 else name

    def group_ranks(self) -> dict[str, list[int] | None]:
        return {"all": _group_ranks(self.groups.all), "tp": _group_ranks(self.groups.tp),
                "dp": _group_ranks(self.groups.dp)}

    def step(self, step: int) -> float:
        """Every rank of a TP group trains on its DP replica's batch (seeded by the DP rank)."""
        return self._token_step(step, "gpt-data", self.groups.dp_rank)


WORKLOAD_CLASSES: dict[str, type[Workload]] = {"moe": MoEWorkload, "dlrm": DLRMWorkload, "megatron": MegatronWorkload}


def config(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` over the sizes of its preset (``cfg["preset"]``, default "tiny"), with a seed."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; known: {list(PRESETS)}")
    preset = cfg.get("preset") or "tiny"
    if preset not in PRESETS[name]:
        raise ValueError(f"unknown preset {preset!r} for {name}; known: {list(PRESETS[name])}")
    return {"seed": 0, **PRESETS[name][preset], **cfg, "preset": preset}


def local_groups() -> Groups:
    """The groups of a single-process run (no communication at all): the reference model."""
    return Groups(backend="none", rank=0, world=1, all=None)


def build(name: str, cfg: dict[str, Any], groups: Groups) -> Workload:
    """Workload ``name`` ("moe", "dlrm", "megatron") with ``cfg`` over its preset, on ``groups``
    (``make_groups``; ``local_groups()`` for the single-process reference)."""
    return WORKLOAD_CLASSES[name](config(name, cfg), groups)
