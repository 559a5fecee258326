"""``ShardedGuard``: FSDP2 over a (replicate, shard) device mesh (HSDP) that goes on when a rank dies.

A rank's parameter and optimizer shards live only in its row of the mesh (its replica), so a row
that lost a rank cannot go on; the other rows can, each holding a whole copy.  After a loss the
rows that are whole go on as a smaller mesh: every survivor keeps its column, so its local shards
stay as they are, and the guard builds the model and the optimizer again on the new mesh (with the
user's ``build`` and ``make_optimizer``) and copies its shards and optimizer state into them.  The
live ranks of a broken row leave the job (``ReplicaLostError``); started again with the lost rank's
replacement, they ask to come back, and the row is taken in whole at a step boundary, each of its
ranks receiving its column's shards and optimizer state from the lowest running row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from commd.client.errors import CommdError, UnrecoverableError
from commd.ft.seats import (
    ATTEMPT_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    RECOVER_TIMEOUT_S,
    Seats,
    agree_equal,
    broadcast_bytes,
    from_bytes,
    log,
    new_group,
    tensor_digest,
    to_bytes,
)
from commd.torch_backend.process_group import current_client


class ReplicaLostError(UnrecoverableError):
    """This rank's replica lost a rank: it left the job (started again, it rejoins with its replica)."""


#: The mesh's dimension names, as torch's HSDP examples name them.
MESH_DIMS = ("replicate", "shard")


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class ShardedGuard(Seats):
    """Runs training steps of an HSDP model so that the whole replicas go on when a rank dies, and
    a broken replica comes back when the lost rank's replacement does.

    ``build(mesh)``: the model with ``fully_shard(..., mesh=mesh)`` applied, on a 2-D mesh whose
    dimensions are ``("replicate", "shard")``; ``make_optimizer(parameters)``: its optimizer.
    Both are called again after every change of membership (the same model: the guard copies the
    shards in).  ``shards``: ranks per replica (the world must be a multiple of it).  A replica
    that lost a rank leaves the job: its live ranks raise ``ReplicaLostError``, and come back with it
when they are started again.
    """

    def __init__(self, build: Callable[[DeviceMesh], torch.nn.Module],
                 make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer], *, shards: int,
                 device_type: str = "cpu", min_ranks: int = 1, recover_timeout: float = RECOVER_TIMEOUT_S,
                 join_timeout: float = JOIN_TIMEOUT_S) -> None:
        world = dist.get_world_size()
        if dist.get_backend() != "commd":
            raise ValueError(f"commd.ft.ShardedGuard needs the 'commd' backend, not {dist.get_backend()!r}")
        if shards < 1 or world % shards:
            raise ValueError(f"shards must divide the world size {world}, got {shards}")
        super().__init__(tuple(range(world)), dist.group.WORLD, min_ranks=min_ranks,
                         recover_timeout=recover_timeout, join_timeout=join_timeout)
        self.shards = shards
        self.device_type = device_type
        self.build = build
        self.make_optimizer = make_optimizer
        admission = self._replacement()
        if admission is None:
            self.mesh = init_device_mesh(device_type, (world // shards, shards), mesh_dim_names=MESH_DIMS)
            self.model = build(self.mesh)
            self.optimizer = make_optimizer(self.model.parameters())
        else:
            self._join(admission)

    # ---- rows ------------------------------------------------------------------------------
    def _row(self, rank: int) -> list[int]:
        first = rank // self.shards * self.shards
        return list(range(first, first + self.shards))

    def _survivors(self, known: set[int]) -> list[int]:
        """The ranks of the replicas that lost no rank."""
        broken = {rank // self.shards for rank in known}
        return [rank for rank in self.ranks if rank // self.shards not in broken]

    def _left_out(self, known: set[int]) -> None:
        """This rank's replica lost a rank, so the replica leaves the job (``_on_give_up``).  Started
        again (``commd launch --max-restarts``) its ranks come back, together, once all of them asked."""
        row = self._row(self._me)
        self._leaving = True
        raise ReplicaLostError(f"rank {self._me}: its replica {row} lost ranks {sorted(set(row) & known)}, so it "
                               "left the job; the other replicas go on, and the replica comes back when its ranks "
                               "are started again (commd launch --max-restarts)")

    def _on_give_up(self, error: UnrecoverableError) -> None:
        """Leaving the job: this rank says goodbye to its daemon at once, so that the ops of the other
        replicas that wait for it fail now, and they go on without this replica."""
        if isinstance(error, ReplicaLostError):
            try:
                current_client().close()
            except CommdError as exc:
                log.warning("commd.ft: rank %d could not leave its daemon cleanly: %s", self._me, exc)

    def _joinable(self, asking: list[int]) -> list[int]:
        """The ranks of the replicas whose every missing rank asked to come back."""
        asked = set(asking)
        rows = sorted({rank // self.shards for rank in asking})
        whole = [self._row(row * self.shards) for row in rows]
        return [rank for row in whole if all(r in asked or r in self.ranks for r in row)
                for rank in row if rank not in self.ranks]

    # ---- the model on a new mesh ----------------------------------------------------------
    def _rebuild(self, group: Any, members: list[int], joining: list[int], tag: str) -> tuple[Any, int]:
        rows = sorted({rank // self.shards for rank in members})
        column = self._me % self.shards
        row_group = new_group(self._row(self._me), f"{tag}.row", ATTEMPT_TIMEOUT_S, self.op_timeout)
        column_ranks = [row * self.shards + column for row in rows]
        column_group = new_group(column_ranks, f"{tag}.col", ATTEMPT_TIMEOUT_S, self.op_timeout)
        layout = torch.tensor([self._row(row * self.shards) for row in rows])
        mesh = DeviceMesh.from_group([column_group, row_group], self.device_type, mesh=layout,
                                     mesh_dim_names=MESH_DIMS)
        state = self._local_state() if self._me not in joining else None
        moved = 0
        if joining:  # each column's shards, from its rank in the lowest running row
            source = min(r for r in column_ranks if r not in joining)
            data = broadcast_bytes(to_bytes(state) if self._me == source else b"", source, column_group)
            moved = len(data)
            if state is None:
                state = from_bytes(data)
        assert state is not None
        model = self.build(mesh)
        optimizer = self.make_optimizer(model.parameters())
        self._load_local_state(model, optimizer, mesh, state)
        return (model, optimizer, mesh), moved

    def _local_state(self) -> dict[str, Any]:
        """This rank's shards, buffers and optimizer state (local tensors), by parameter order."""
        parameters = list(self.model.parameters())
        return {
            "params": [_local(p).detach().clone() for p in parameters],
            "buffers": [b.detach().clone() for b in self.model.buffers()],
            "state": [{key: (isinstance(value, DTensor), _local(value).clone() if torch.is_tensor(value) else value)
                       for key, value in self.optimizer.state.get(p, {}).items()} for p in parameters],
            "groups": [{key: value for key, value in group.items() if key != "params"}
                       for group in self.optimizer.param_groups],
        }

    def _load_local_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                          state: dict[str, Any]) -> None:
        parameters = list(model.parameters())
        if len(parameters) != len(state["params"]):
            raise ValueError(f"build(mesh) made a model of {len(parameters)} parameters, not {len(state['params'])}")
        with torch.no_grad():
            for parameter, local in zip(parameters, state["params"], strict=True):
                _local(parameter).copy_(local)
            for buffer, value in zip(model.buffers(), state["buffers"], strict=True):
                buffer.copy_(value)
        for parameter, saved in zip(parameters, state["state"], strict=True):
            if saved:
                optimizer.state[parameter] = {
                    key: (DTensor.from_local(value, mesh, parameter.placements, shape=parameter.shape,
                                             stride=parameter.stride()) if sharded else value)
                    for key, (sharded, value) in saved.items()}
        for group, saved in zip(optimizer.param_groups, state["groups"], strict=True):
            group.update(saved)

    def _install(self, built: Any) -> None:
        self.model, self.optimizer, self.mesh = built

    def _check_states(self, built: Any, group: Any, members: list[int]) -> None:
        """The replicas of each shard must be equal: parameters and optimizer state."""
        model, optimizer, mesh = built
        tensors = [_local(p) for p in model.parameters()]
        tensors += [_local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        agree_equal(tensor_digest(tensors), mesh.get_group(MESH_DIMS[0]), members, "shards")
