"""The layout of a tensor/pipeline-parallel job along its elastic dimension, and the state
transfer a resize needs (issue 26, item 5; docs/sharded.md "Layouts"). Pure: no Paddle.

A job with ``mp_degree`` x ``pp_degree`` (x ``sep_degree``) > 1 is elastic along the
data-parallel dimension only: each replica is a whole model-parallel group of
``mp * pp * sep`` ranks, and a world of W ranks holds ``W / (mp * pp * sep)`` replicas. A
rank's coordinates follow fleet's own order (``CommunicateTopology``'s axes ``data``,
``pipe``, ``sharding``, ``sep``, ``model``, the last varying fastest), so that the groups this
module names are the ones ``fleet.init`` forms for the same degrees.

A resize keeps whole replicas. What a new rank needs is its model-parallel slice: the
parameters and optimizer state of pipeline stage ``s``, sequence rank ``e`` and tensor rank
``k``. Every replica holds the same slices (data parallel keeps them equal), so a new rank at
``(s, e, k)`` is sent its slice by a staying rank at the same ``(s, e, k)``, whatever its
data-parallel index; a stayer at the same coordinates keeps its own. :func:`plan_transfer`
says who sends what to whom; :func:`plan_slices` makes it from what each rank of a new
generation holds, and tide/trainer/slices.py moves the state with tide/trainer/transfer.py's
``send_state`` (one chunked broadcast per source). :class:`RankLayout` is what the session
reads of one rank: its replica (the sampler's data-parallel rank), its gradient group, the
groups to form, and its slice's durable store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tide.base.errors import ConfigError


@dataclass(frozen=True)
class ModelParallel:
    """The degrees the model fixes: they never change with the world."""

    mp_degree: int = 1
    pp_degree: int = 1
    sep_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("mp_degree", "pp_degree", "sep_degree"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def group_size(self) -> int:
        """Ranks in one replica: the scaler's ``replica_multiple`` for this job."""
        return self.mp_degree * self.pp_degree * self.sep_degree


@dataclass(frozen=True, order=True)
class Coord:
    """A rank's place: its replica (``dp``) and its slice of the model (``pp``, ``sep``,
    ``mp``)."""

    dp: int
    pp: int
    sep: int
    mp: int

    @property
    def slice(self) -> tuple[int, int, int]:
        """Which part of the model the rank holds: equal across replicas."""
        return (self.pp, self.sep, self.mp)


def check_world(world_size: int, model: ModelParallel) -> int:
    """The data-parallel degree of ``world_size`` ranks; a ConfigError naming the settings
    when the world is not whole replicas."""
    if world_size < 1 or world_size % model.group_size:
        raise ConfigError(
            f"world size {world_size} is not a multiple of mp_degree x pp_degree x sep_degree "
            f"= {model.mp_degree} x {model.pp_degree} x {model.sep_degree} = "
            f"{model.group_size}: every replica is a whole model-parallel group (set the "
            f"scaler policy's replica_multiple to {model.group_size})"
        )
    return world_size // model.group_size


def coordinates(world_size: int, model: ModelParallel) -> list[Coord]:
    """Each rank's coordinates, by rank (fleet's order: model parallel fastest)."""
    dp = check_world(world_size, model)
    return [
        Coord(d, p, e, k)
        for d in range(dp)
        for p in range(model.pp_degree)
        for e in range(model.sep_degree)
        for k in range(model.mp_degree)
    ]


def rank_of(coord: Coord, model: ModelParallel) -> int:
    return (
        (coord.dp * model.pp_degree + coord.pp) * model.sep_degree + coord.sep
    ) * model.mp_degree + coord.mp


def dp_groups(world_size: int, model: ModelParallel) -> list[list[int]]:
    """The data-parallel groups: the ranks that hold the same slice, one per replica, in
    replica order; one group per slice, by slice."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for rank, c in enumerate(coordinates(world_size, model)):
        groups.setdefault(c.slice, []).append(rank)
    return [groups[s] for s in sorted(groups)]


@dataclass(frozen=True)
class Move:
    """New rank ``to`` gets its slice from old rank ``source`` (``source`` is the same
    process as ``to`` when it keeps its own)."""

    to: int
    source: int
    slice: tuple[int, int, int]


@dataclass(frozen=True)
class Plan:
    """A resize's transfer: which new ranks keep their own slice, and which receive it from
    which old rank (a stayer), by slice."""

    keeps: Mapping[int, int]  # new rank -> its own old rank (same slice)
    moves: tuple[Move, ...]  # new ranks that receive

    def sources(self) -> dict[int, list[int]]:
        """Old rank -> the new ranks it sends its slice to (each source one broadcast)."""
        out: dict[int, list[int]] = {}
        for m in self.moves:
            out.setdefault(m.source, []).append(m.to)
        return out


def plan_transfer(
    old_world: int,
    new_world: int,
    model: ModelParallel,
    stayers: Mapping[int, int],
) -> Plan:
    """The state transfer of a resize from ``old_world`` to ``new_world`` ranks.

    ``stayers``: new rank -> old rank, for the processes (pods) in both generations; the
    other new ranks are newcomers. A new rank whose old rank held the same slice keeps it; any
    other is sent its slice by a stayer that held it, spread over such stayers in turn. Raises
    a ConfigError when a world is not whole replicas, and when no stayer holds a slice (a
    whole pipeline stage or tensor rank left: that state survives only in the durable
    checkpoint)."""
    old = coordinates(old_world, model)
    new = coordinates(new_world, model)
    for to, source in stayers.items():
        if not (0 <= to < new_world and 0 <= source < old_world):
            raise ValueError(f"stayer new rank {to} <- old rank {source} outside the worlds")
    if len(set(stayers.values())) != len(stayers):
        raise ValueError("two new ranks name the same old rank")
    holders: dict[tuple[int, int, int], list[int]] = {}
    for source in sorted(stayers.values()):
        holders.setdefault(old[source].slice, []).append(source)
    keeps: dict[int, int] = {}
    moves: list[Move] = []
    turn: dict[tuple[int, int, int], int] = {}
    for to, coord in enumerate(new):
        mine = stayers.get(to)
        if mine is not None and old[mine].slice == coord.slice:
            keeps[to] = mine
            continue
        candidates = holders.get(coord.slice)
        if not candidates:
            raise ConfigError(
                f"no staying rank holds model-parallel slice (pp {coord.pp}, sep {coord.sep}, "
                f"mp {coord.mp}) for new rank {to}: a resize must keep at least one whole "
                f"replica of mp_degree x pp_degree x sep_degree = {model.group_size} ranks"
            )
        i = turn.get(coord.slice, 0)
        turn[coord.slice] = i + 1
        moves.append(Move(to, candidates[i % len(candidates)], coord.slice))
    return Plan(keeps, tuple(moves))


def stayers_by_replica(old_world: int, new_world: int, model: ModelParallel) -> dict[int, int]:
    """The mapping a resize that moves whole replicas gives when the surviving replicas keep
    their order and the first ones stay: new rank -> old rank for the first
    ``min(old, new)`` replicas."""
    kept = min(check_world(old_world, model), check_world(new_world, model))
    return {r: r for r in range(kept * model.group_size)}


@dataclass(frozen=True)
class RankLayout:
    """One rank's place in a generation of ``world_size`` ranks: what the session of a
    model-parallel job reads (its data plan, its gradient group, its durable store)."""

    model: ModelParallel
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        check_world(self.world_size, self.model)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")

    @property
    def coord(self) -> Coord:
        return coordinates(self.world_size, self.model)[self.rank]

    @property
    def dp_degree(self) -> int:
        """Replicas: the data-parallel degree the sampler splits the global batch by."""
        return self.world_size // self.model.group_size

    @property
    def dp_rank(self) -> int:
        """This rank's replica: every rank of one replica gets the same samples."""
        return self.coord.dp

    @property
    def dp_ranks(self) -> list[int]:
        """The ranks holding this rank's slice, one per replica: its gradient group."""
        return next(r for r in dp_groups(self.world_size, self.model) if self.rank in r)

    @property
    def replica_ranks(self) -> list[int]:
        """The ranks of this rank's replica (its whole model-parallel group)."""
        g = self.model.group_size
        first = self.dp_rank * g
        return list(range(first, first + g))

    @property
    def tensor_ranks(self) -> list[int]:
        """The ranks of this rank's replica and pipeline stage and sequence rank: its tensor
        (``mp``) group, in tensor-rank order."""
        c = self.coord
        return [
            rank_of(Coord(c.dp, c.pp, c.sep, k), self.model) for k in range(self.model.mp_degree)
        ]

    @property
    def pipeline_ranks(self) -> list[int]:
        """The ranks of this rank's replica, sequence rank and tensor rank over the pipeline
        stages, by stage: its pipeline (tide/trainer/pipeline.py sends activations and
        gradients between adjacent ones)."""
        c = self.coord
        return [
            rank_of(Coord(c.dp, s, c.sep, c.mp), self.model) for s in range(self.model.pp_degree)
        ]

    @property
    def logs_samples(self) -> bool:
        """One rank per replica logs the replica's sample ids (its slice (0, 0, 0)): all of
        a replica's ranks train on the same ones."""
        return self.coord.slice == (0, 0, 0)

    @property
    def writes_durable(self) -> bool:
        """The first replica's ranks write the durable checkpoints, each its own slice."""
        return self.dp_rank == 0

    @property
    def slice_name(self) -> str:
        """The durable store's subdirectory of this rank's slice (the same in every
        generation and world: a slice is a place in the model)."""
        return slice_name(self.coord.slice)


def slice_name(s: tuple[int, int, int]) -> str:
    return f"slice-pp{s[0]}-sep{s[1]}-mp{s[2]}"


def all_groups(world_size: int, model: ModelParallel) -> list[list[int]]:
    """Every data-parallel group, then every tensor group, then every pipeline group and
    every pair of adjacent stages that is not one, of more than one rank: the subgroups a
    model-parallel job forms, listed the same on every rank (Paddle numbers groups in the
    order each process forms them)."""
    tensor: list[list[int]] = []
    pipes: list[list[int]] = []
    for rank in range(world_size):
        me = RankLayout(model, world_size, rank)
        if me.tensor_ranks[0] == rank:
            tensor.append(me.tensor_ranks)
        if me.pipeline_ranks[0] == rank:
            pipes.append(me.pipeline_ranks)
    pairs = [p[s : s + 2] for p in pipes for s in range(len(p) - 1) if len(p) > 2]
    return [g for g in (*dp_groups(world_size, model), *tensor, *pipes, *pairs) if len(g) > 1]


@dataclass(frozen=True)
class SliceHolding:
    """What one rank of a new generation holds in its pod's memory, read from the state's
    layout file: the step (0: none) and the rank and world it held it as."""

    step: int
    old_rank: int = -1
    old_world: int = 0


@dataclass(frozen=True)
class SlicePlan:
    """A model-parallel job's restore from memory: the step, the transfer (by *new*
    ranks: a source sends to its receivers), or ``step`` 0 when memory cannot serve every
    slice (the durable stores must)."""

    step: int
    keeps: tuple[int, ...] = ()
    sends: Mapping[int, tuple[int, ...]] = field(default_factory=dict)


def plan_slices(holdings: list[SliceHolding], model: ModelParallel) -> SlicePlan:
    """From every new rank's holding (by new rank): the newest step held in memory, if its
    holders (all of one old world) hold every slice the new world needs; who keeps its own
    and which holder sends to which newcomer (:func:`plan_transfer`)."""
    new_world = len(holdings)
    newest = max((h.step for h in holdings), default=0)
    if newest == 0:
        return SlicePlan(0)
    held = [(r, h) for r, h in enumerate(holdings) if h.step == newest and h.old_world > 0]
    worlds = {h.old_world for _, h in held}
    if len(worlds) != 1:
        return SlicePlan(0)
    old_world = worlds.pop()
    stayers = {r: h.old_rank for r, h in held}
    try:
        plan = plan_transfer(old_world, new_world, model, stayers)
    except (ConfigError, ValueError):
        return SlicePlan(0)
    by_old = {old: new for new, old in stayers.items()}
    sends: dict[int, tuple[int, ...]] = {}
    for source, receivers in sorted(plan.sources().items()):
        sends[by_old[source]] = tuple(receivers)
    return SlicePlan(newest, tuple(sorted(plan.keeps)), sends)
