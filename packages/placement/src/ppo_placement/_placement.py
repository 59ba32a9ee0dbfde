"""The Ray shell around :class:`Layout`: one placement group, ordered bundles, role views.

``SharedPlacement`` reserves ``layout.num_gpus`` bundles in ONE placement group, finds
out on which node and which GPU each bundle landed (a tiny task per bundle reports
``(node IP, node id, ray.get_gpu_ids())``; bundles without GPUs, or whose GPU ids the
caller does not need, are looked up in the placement group table instead, starting no
process), and orders the bundles by node IP (as numbers), node, then GPU id (as an
integer, so GPU 10 sorts after GPU 2). Ranks therefore fill a node before the next one.
Views hand the ordered bundles to the roles: actor rank r and critic rank r get the SAME
bundle (with GPU shares that fit together), rollout engines get the bundles from
``layout.rollout_offset`` on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ppo_placement._layout import Layout

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["Bundle", "RoleView", "SharedPlacement", "Slot"]

_log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "rollout")
_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_DEFAULT_SHARES = {
    # actor rank r and critic rank r sit on one bundle; a colocated engine joins them.
    False: {"actor": 0.5, "critic": 0.5, "rollout": 1.0},
    True: {"actor": 0.4, "critic": 0.4, "rollout": 0.2},
}
_PROBE_SHARE = 0.01


@dataclasses.dataclass(frozen=True)
class Bundle:
    """One reserved bundle, where it landed.

    Attributes:
        index: position in the ordered bundle list (what :class:`Layout` counts).
        bundle_index: Ray's own index of the bundle in the placement group.
        node_id: hex id of the node holding it.
        node_ip: that node's IP address.
        gpu_id: the GPU id it holds on that node (``ray.get_gpu_ids()`` of a task in
            it; an ``int`` when numeric), or ``None`` for a bundle without GPUs (or
            when the placement was made with ``probe_gpu_ids=False``).
    """

    index: int
    bundle_index: int
    node_id: str
    node_ip: str
    gpu_id: int | str | None


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one rank of one role runs.

    Attributes:
        role: ``"actor"``, ``"critic"`` or ``"rollout"``.
        rank: the rank within the role (0-based, in bundle order).
        node_rank: index of the rank's node among the view's nodes.
        local_rank: the rank's position among the view's ranks on its node.
        bundle: the bundle it runs on.
        placement_group: the shared placement group.
        num_gpus: the GPU share an actor on this slot requests.
        num_cpus: the CPU share an actor on this slot requests.
    """

    role: str
    rank: int
    node_rank: int
    local_rank: int
    bundle: Bundle
    placement_group: PlacementGroup
    num_gpus: float
    num_cpus: float

    @property
    def bundle_index(self) -> int:
        """Ray's bundle index, as the scheduling strategy uses it."""
        return self.bundle.bundle_index

    @property
    def node_ip(self) -> str:
        return self.bundle.node_ip

    @property
    def node_id(self) -> str:
        return self.bundle.node_id

    @property
    def gpu_id(self) -> int | str | None:
        return self.bundle.gpu_id

    @property
    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        """A Ray scheduling strategy that pins an actor (or task) to this slot's bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.bundle.bundle_index,
        )

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ActorClass.options(...)``: shares and strategy."""
        return {
            "num_gpus": self.num_gpus,
            "num_cpus": self.num_cpus,
            "scheduling_strategy": self.scheduling_strategy,
        }


@dataclasses.dataclass(frozen=True)
class RoleView:
    """The slots of one role, in rank order, with the node boundaries.

    Attributes:
        role: the role name.
        slots: one :class:`Slot` per rank.
    """

    role: str
    slots: tuple[Slot, ...]

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    def __getitem__(self, rank: int) -> Slot:
        return self.slots[rank]

    @property
    def node_boundaries(self) -> tuple[range, ...]:
        """Rank ranges per node, in node order: ``(range(0, 4), range(4, 8))``."""
        out: list[range] = []
        start = 0
        for _, group in itertools.groupby(self.slots, key=lambda s: s.node_id):
            size = len(list(group))
            out.append(range(start, start + size))
            start += size
        return tuple(out)

    @property
    def node_ips(self) -> tuple[str, ...]:
        """The IP of each node of the view, in node order (duplicates possible when
        several nodes share one machine)."""
        return tuple(self.slots[r.start].node_ip for r in self.node_boundaries)

    @property
    def gpu_ids(self) -> tuple[int | str | None, ...]:
        """The GPU id of each rank."""
        return tuple(s.gpu_id for s in self.slots)


class SharedPlacement:
    """One placement group shared by actor, critic and rollout, as a :class:`Layout` says.

    ``create()`` reserves the bundles and discovers where they landed (idempotent: a
    second call is a no-op); ``teardown()`` removes the group (idempotent). Also a
    context manager. Views need ``create()`` first.

    Args:
        layout: from :func:`placement_layout`.
        bundle_resources: resources of one bundle (default ``{"GPU": 1, "CPU": 1}``).
        strategy: Ray placement strategy (``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"``,
            ``"STRICT_SPREAD"``).
        gpu_shares: per-role fraction of a bundle an actor requests (GPU and CPU alike).
            Default: actor 0.5 + critic 0.5 (rollout 1.0 on its own bundles); colocated:
            actor 0.4 + critic 0.4 + rollout 0.2. Roles on one bundle must fit in 1.0.
        name: placement group name (empty: anonymous).
        ready_timeout_s: how long ``create()`` waits for the reservation.
        probe_gpu_ids: learn each GPU bundle's GPU id with a tiny task inside it (only
            a process in a bundle learns it), and order the bundles of a node by it.
            ``False``, for GPUs that name no device (logical GPUs on a machine without
            CUDA): no task runs, the bundles of a node keep Ray's bundle order and
            ``gpu_id`` is ``None``. Bundles without GPUs never need the probe: their
            nodes come from Ray's placement group table.

    Raises:
        ValueError: bad resources, strategy or shares.
    """

    def __init__(
        self,
        layout: Layout,
        *,
        bundle_resources: Mapping[str, float] | None = None,
        strategy: str = "PACK",
        gpu_shares: Mapping[str, float] | None = None,
        name: str = "",
        ready_timeout_s: float = 300.0,
        probe_gpu_ids: bool = True,
    ) -> None:
        resources = dict(bundle_resources) if bundle_resources is not None else None
        if resources is None:
            resources = {"GPU": 1.0, "CPU": 1.0}
        if (
            not resources
            or any(v < 0 for v in resources.values())
            or not any(v > 0 for v in resources.values())
        ):
            raise ValueError(
                f"bundle_resources={resources!r} must hold at least one positive amount "
                'and none negative, e.g. {"GPU": 1, "CPU": 1}'
            )
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy={strategy!r} must be one of {_STRATEGIES}")
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s={ready_timeout_s} must be > 0")
        self._layout = layout
        self._resources = resources
        self._strategy = strategy
        self._shares = _check_shares(layout, gpu_shares)
        self._name = name
        self._ready_timeout_s = ready_timeout_s
        self._probe_gpu_ids = probe_gpu_ids
        self._pg: PlacementGroup | None = None
        self._bundles: tuple[Bundle, ...] = ()
        self._created = False

    # --- lifecycle ---------------------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def created(self) -> bool:
        return self._created

    def create(self) -> SharedPlacement:
        """Reserve the bundles and discover them; a no-op when already created.

        Raises:
            TimeoutError: the cluster could not provide the bundles in
                ``ready_timeout_s`` (the group is removed again).
        """
        if self._created:
            _log.info("SharedPlacement.create(): already created, nothing to do")
            return self
        if self._layout.num_gpus == 0:
            self._created = True
            return self
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group(
            [dict(self._resources) for _ in range(self._layout.num_gpus)],
            strategy=self._strategy,
            name=self._name,
        )
        try:
            ray.get(pg.ready(), timeout=self._ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise TimeoutError(
                f"placement group of {self._layout.num_gpus} x {self._resources} "
                f"({self._strategy}) not ready after {self._ready_timeout_s:g} s; the "
                f"cluster has {ray.cluster_resources()} in total "  # type: ignore[no-untyped-call]
                "(start Ray with more GPUs/CPUs or ask for fewer bundles)"
            ) from None
        try:
            if self._probe_gpu_ids and self._resources.get("GPU", 0.0) > 0:
                self._bundles = _discover(pg, self._ready_timeout_s)
            else:
                self._bundles = _look_up(pg)
        except BaseException:
            remove_placement_group(pg)
            raise
        self._pg = pg
        self._created = True
        return self

    def teardown(self) -> None:
        """Remove the placement group; a no-op when not created (or already removed)."""
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        self._pg = None
        self._bundles = ()
        self._created = False

    def __enter__(self) -> SharedPlacement:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    # --- what was reserved -----------------------------------------------------------

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The Ray placement group (``None`` before ``create()`` or for zero bundles)."""
        return self._pg

    @property
    def bundles(self) -> tuple[Bundle, ...]:
        """All bundles, ordered by node IP, node, GPU id."""
        self._require_created()
        return self._bundles

    def actor_view(self) -> RoleView:
        """Actor ranks: the training bundles, ``layout.train_bundles``."""
        return self._view("actor", self._layout.train_bundles)

    def critic_view(self) -> RoleView:
        """Critic ranks: the SAME bundles as the actor's (critic rank r = actor rank r)."""
        return self._view("critic", self._layout.train_bundles)

    def rollout_view(self) -> RoleView:
        """Rollout engines: ``layout.rollout_bundles`` (the training ones when colocated)."""
        return self._view("rollout", self._layout.rollout_bundles)

    def _require_created(self) -> None:
        if not self._created:
            raise RuntimeError("SharedPlacement: call create() before asking for bundles")

    def _view(self, role: str, indices: range) -> RoleView:
        self._require_created()
        share = self._shares[role]
        cpus = self._resources.get("CPU", 0.0)
        slots: list[Slot] = []
        if len(indices) == 0:
            return RoleView(role=role, slots=())
        pg = self._pg
        assert pg is not None, "bundles exist only once the placement group does"
        node_rank = -1
        local_rank = 0
        previous_node: str | None = None
        for rank, index in enumerate(indices):
            bundle = self._bundles[index]
            if bundle.node_id != previous_node:
                node_rank, local_rank, previous_node = node_rank + 1, 0, bundle.node_id
            slots.append(
                Slot(
                    role=role,
                    rank=rank,
                    node_rank=node_rank,
                    local_rank=local_rank,
                    bundle=bundle,
                    placement_group=pg,
                    num_gpus=share if self._resources.get("GPU", 0.0) > 0 else 0.0,
                    num_cpus=share * cpus,
                )
            )
            local_rank += 1
        return RoleView(role=role, slots=tuple(slots))


# --- helpers -----------------------------------------------------------------------


def _check_shares(layout: Layout, gpu_shares: Mapping[str, float] | None) -> dict[str, float]:
    shares = dict(_DEFAULT_SHARES[layout.colocate])
    if gpu_shares is not None:
        unknown = set(gpu_shares) - set(ROLES)
        if unknown:
            raise ValueError(f"gpu_shares has unknown roles {sorted(unknown)}; use {ROLES}")
        shares.update(gpu_shares)
    for role, share in shares.items():
        if not 0 < share <= 1:
            raise ValueError(f"gpu_shares[{role!r}]={share} must be in (0, 1]")
    sharing = ["actor", "critic"] + (["rollout"] if layout.colocate else [])
    total = sum(shares[r] for r in sharing)
    if total > 1 + 1e-9:
        raise ValueError(
            f"gpu_shares of {sharing} add up to {total:g} > 1 but they share one bundle: "
            f"lower them (got {shares})"
        )
    return shares


def _probe() -> tuple[str, str, list[str]]:
    """Runs inside a bundle: report its node IP, node id and GPU ids."""
    import ray

    return (
        ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        ray.get_runtime_context().get_node_id(),
        [str(g) for g in ray.get_gpu_ids()],
    )


def _discover(pg: PlacementGroup, timeout_s: float) -> tuple[Bundle, ...]:
    """The bundles of GPUs, probed: a task holding a sliver of each bundle's GPU reports
    where it ran (only a process in a bundle learns its GPU id)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(max_retries=0)(_probe)
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            ),
            name=f"ppo_placement.probe[{i}]",
            num_gpus=_PROBE_SHARE,
            num_cpus=0,
        ).remote()
        for i in range(pg.bundle_count)
    ]
    found = ray.get(refs, timeout=timeout_s)
    raw: list[tuple[int, str, str, list[str]]] = [
        (i, ip, node_id, gpus) for i, (ip, node_id, gpus) in enumerate(found)
    ]
    return order_bundles(raw)


def _look_up(pg: PlacementGroup) -> tuple[Bundle, ...]:
    """The bundles' nodes from Ray's placement group table (no GPU ids): no process
    starts, where a probe task per bundle starts (or takes) a worker process each."""
    import ray
    from ray.util import placement_group_table

    node_of: Mapping[int, str] = placement_group_table(pg)["bundles_to_node_id"]
    ip_of = {
        n["NodeID"]: n["NodeManagerAddress"]
        for n in ray.nodes()  # type: ignore[no-untyped-call]
    }
    return order_bundles([(i, ip_of[node_of[i]], node_of[i], []) for i in range(pg.bundle_count)])


def order_bundles(raw: list[tuple[int, str, str, list[str]]]) -> tuple[Bundle, ...]:
    """Order probed bundles: node IP as numbers, node id, GPU id as an integer, Ray index.

    Args:
        raw: one ``(ray_bundle_index, node_ip, node_id, gpu_ids)`` per bundle, as the
            probe reports them (``gpu_ids`` are strings, at most one per bundle).

    Raises:
        ValueError: a bundle holding more than one GPU.
    """
    records: list[tuple[int, str, str, int | str | None]] = []
    for i, ip, node_id, gpus in raw:
        if len(gpus) > 1:
            raise ValueError(
                f"bundle {i} holds {len(gpus)} GPUs {gpus}; SharedPlacement needs "
                'bundles of one GPU each, e.g. bundle_resources={"GPU": 1, "CPU": 1}'
            )
        records.append((i, ip, node_id, _gpu_id(gpus[0]) if gpus else None))
    records.sort(key=lambda b: (_ip_key(b[1]), b[2], _gpu_key(b[3]), b[0]))
    return tuple(
        Bundle(index=k, bundle_index=i, node_id=node_id, node_ip=ip, gpu_id=gpu)
        for k, (i, ip, node_id, gpu) in enumerate(records)
    )


def _gpu_id(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _gpu_key(gpu: int | str | None) -> tuple[int, int, str]:
    if gpu is None:
        return (2, 0, "")
    if isinstance(gpu, int):
        return (0, gpu, "")
    return (1, 0, gpu)


def _ip_key(ip: str) -> tuple[int, int, str]:
    """Sort IPs as numbers (10.0.0.9 before 10.0.0.10); unparsable names last."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (9, 0, ip)
    return (address.version, int(address), "")
