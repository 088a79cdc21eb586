"""``[cluster]``: the hosts a campaign's cells run on (HostSpec, ClusterConfig).

Apart from stack/fleet.py (the fleet of cells, which talks to Prefect and the engines), so a
campaign config is read and checked without them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator


class HostSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is refused, not ignored

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$", description="the host's name in the campaign")
    address: str = Field(
        min_length=1, description="where the other hosts reach it (its engines listen on it)"
    )
    work_pool: str | None = Field(None, description="its Prefect work pool (None: gyre-<name>)")
    cells: NonNegativeInt = Field(1, description="cells placed on it at the start")
    max_cells: PositiveInt | None = Field(
        None, description="the most cells it may hold once cells of lost hosts move (None: no limit)"
    )
    threads: PositiveInt | None = Field(
        None, description="torch threads of each of its cells' engines (None: [serving] engine_threads)"
    )
    devices: list[list[NonNegativeInt]] | None = Field(
        None,
        description="its GPUs, one list per cell it may hold (CUDA_VISIBLE_DEVICES of that cell's engine); "
        "the host then holds at most that many cells",
    )

    @model_validator(mode="after")
    def _slots(self) -> HostSpec:
        if self.devices is not None and self.cells > len(self.devices):
            raise ValueError(
                f"host {self.name}: cells {self.cells} but devices for {len(self.devices)} cells"
            )
        return self

    def pool(self) -> str:
        return self.work_pool or f"gyre-{self.name}"

    def capacity(self) -> int | None:
        """The most cells it may hold (None: no limit): max_cells, and one per entry of devices."""
        limits = [n for n in (self.max_cells, len(self.devices) if self.devices is not None else None) if n]
        return min(limits) if limits else None


class ClusterConfig(BaseModel):
    """``[cluster]``: the hosts a campaign's cells run on."""

    hosts: list[HostSpec] = Field(min_length=1)
    gateway_address: str | None = Field(
        None,
        description="the address of the machine the campaign runs on that every host reaches: the campaign's "
        "gateway listens there (a campaign with [cluster] needs it)",
    )
    gateways: int = Field(
        1,
        ge=1,
        le=8,
        description="gateway processes on gateway_address: each execution is pinned to one by its id and "
        "registered at the next as its standby, which takes its calls if the first dies "
        "(environments/gateways.py); every cell serves behind all of them",
    )
    heartbeat_misses: PositiveInt = Field(
        3, description="worker heartbeats a host may miss before its cells are replaced"
    )
    watch_interval_s: PositiveFloat = Field(5.0, description="how often the fleet checks the hosts")
    max_restarts: NonNegativeInt = Field(
        3, description="times a cell whose run ended on a live host is started again before it is given up"
    )
    cell_cpus: PositiveFloat | None = Field(
        None,
        description="cores' worth of CPU time each cell may use on its host: a CPU cgroup quota that its "
        "engine and trainer replica share, so a cell switched to training takes its share along, as "
        "[serving] partition does on one machine; the scheduler's core trainer gets the same quota "
        "(None: the cells of a host share its cores)",
    )
    core_hosts: list[str] = Field(
        default_factory=list,
        description="hosts that each hold one more rank of the core: the trainer (rank 0, on the campaign's "
        "machine) and one process per host named here form one DeepSpeed world for every step, each with "
        "its share of the optimizer state (trainer.zero_stage 1-2); a lost host's rank runs on a live host "
        "([] = the core is one process)",
    )

    @model_validator(mode="after")
    def _distinct(self) -> ClusterConfig:
        for what, values in (
            ("name", [h.name for h in self.hosts]),
            ("work pool", [h.pool() for h in self.hosts]),
        ):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(
                    f"[cluster] hosts share a {what}: {', '.join(twice)} (each host needs its own)"
                )
        unknown = sorted(set(self.core_hosts) - {h.name for h in self.hosts})
        if unknown:
            raise ValueError(f"[cluster] core_hosts names no host called {', '.join(unknown)}")
        if len(set(self.core_hosts)) != len(self.core_hosts):
            raise ValueError("[cluster] core_hosts names a host twice (a host holds one rank of the core)")
        if not any(h.cells for h in self.hosts):
            raise ValueError("[cluster] places no cell: give at least one host cells >= 1")
        for h in self.hosts:
            if h.max_cells is not None and h.cells > h.max_cells:
                raise ValueError(
                    f"[cluster] host {h.name}: cells {h.cells} is above its max_cells {h.max_cells}"
                )
        return self

    def host(self, name: str) -> HostSpec:
        return next(h for h in self.hosts if h.name == name)

    def core_rank_hosts(self, lost: Collection[str] = ()) -> list[str]:
        """The host of each core rank above 0 (rank r on ``core_hosts[r - 1]``). A rank whose host is
        ``lost`` runs on the live host holding the fewest ranks: what it restores (the policy, its
        optimizer share of the last checkpoint) is in object storage, not on its host."""
        live = [h.name for h in self.hosts if h.name not in lost]
        if not live:
            raise RuntimeError("every host of [cluster] is lost: no host is left for the core's ranks")
        held = Counter(h for h in self.core_hosts if h not in lost)
        placed = []
        for name in self.core_hosts:
            if name in lost:
                name = min(live, key=lambda n: (held[n], live.index(n)))
                held[name] += 1
            placed.append(name)
        return placed

    def placement(self) -> list[tuple[str, str]]:
        """(cell id, host name) of every cell at the start: cell-0, cell-1, ... in the hosts' order."""
        names = [h.name for h in self.hosts for _ in range(h.cells)]
        return [(f"cell-{i}", name) for i, name in enumerate(names)]
