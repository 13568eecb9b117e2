"""The GPU pool of a simulation: nodes, who holds which GPUs, spot nodes going away.

A replica takes ``gpus_per_replica`` GPUs on one node (first fit, on-demand nodes
first); the background (other tenants) takes single GPUs. Knowing where each
replica sits is what tells which jobs a reclaimed spot node hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKGROUND = "(background)"


@dataclass
class Node:
    index: int
    gpus: int
    spot: bool
    up: bool = True
    free: int = 0
    # A reclaim was announced for this node: nothing new is placed on it.
    doomed: bool = False

    def __post_init__(self) -> None:
        self.free = self.gpus


@dataclass
class Holding:
    """What one owner holds: (node index, GPUs) per replica, oldest first."""

    replicas: list[tuple[int, int]] = field(default_factory=list)

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.replicas)


class Cluster:
    def __init__(self, nodes: int, gpus_per_node: int, spot_nodes: int) -> None:
        self.nodes = [Node(i, gpus_per_node, False) for i in range(nodes)]
        self.nodes += [Node(nodes + i, gpus_per_node, True) for i in range(spot_nodes)]
        self.held: dict[str, Holding] = {}

    @property
    def capacity(self) -> int:
        return sum(n.gpus for n in self.nodes if n.up)

    def free_gpus(self) -> int:
        return sum(n.free for n in self.nodes if n.up and not n.doomed)

    def fits(self, replicas: int, gpr: int) -> int:
        """How many of ``replicas`` replicas of ``gpr`` GPUs would fit now."""
        n = 0
        for node in self.nodes:
            if node.up and not node.doomed:
                n += node.free // gpr
        return min(n, replicas)

    def take(self, owner: str, replicas: int, gpr: int) -> int:
        """Place up to ``replicas`` replicas; returns how many were placed."""
        h = self.held.setdefault(owner, Holding())
        placed = 0
        for node in self.nodes:
            while placed < replicas and node.up and not node.doomed and node.free >= gpr:
                node.free -= gpr
                h.replicas.append((node.index, gpr))
                placed += 1
            if placed == replicas:
                break
        return placed

    def give(self, owner: str, replicas: int, prefer: set[int] | None = None) -> None:
        """Release ``replicas`` of the owner's replicas: on the nodes in ``prefer`` first,
        then the newest."""
        h = self.held.get(owner)
        if h is None:
            return
        for _ in range(min(replicas, len(h.replicas))):
            idx = len(h.replicas) - 1
            if prefer:
                for i in range(len(h.replicas) - 1, -1, -1):
                    if h.replicas[i][0] in prefer:
                        idx = i
                        break
            node, g = h.replicas.pop(idx)
            n = self.nodes[node]
            if n.up:
                n.free += g
        if not h.replicas:
            del self.held[owner]

    def holders_on(self, node: int) -> dict[str, int]:
        """Owner -> replicas it holds on ``node``."""
        out: dict[str, int] = {}
        for owner, h in self.held.items():
            c = sum(1 for n, _ in h.replicas if n == node)
            if c:
                out[owner] = c
        return out

    def replicas_of(self, owner: str) -> int:
        h = self.held.get(owner)
        return len(h.replicas) if h else 0

    def go_down(self, node: int) -> dict[str, int]:
        """The node is gone: every replica on it is dropped; returns what each owner lost."""
        lost = self.holders_on(node)
        for owner in lost:
            h = self.held[owner]
            h.replicas = [(n, g) for n, g in h.replicas if n != node]
            if not h.replicas:
                del self.held[owner]
        n = self.nodes[node]
        n.up = False
        n.free = 0
        return lost

    def come_up(self, node: int) -> None:
        n = self.nodes[node]
        n.up, n.doomed, n.free = True, False, n.gpus
