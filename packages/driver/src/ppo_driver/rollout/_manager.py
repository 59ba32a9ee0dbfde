"""The rollout manager: dispatches prompt groups to engines (bounded in flight,
admitted through the sampler's lookahead), scores finished groups, files them in the
replay buffer and reports them ready to the sampler, and re-dispatches the groups of an
engine that died once it is back (exactly once per loss).

Prompts are consumed in order: step ``s`` is filled with ``prompts_per_step`` groups;
a group whose reward failed (raised, timed out, or returned something that is not a
real number) is recorded in :attr:`RolloutManager.failures` and replaced by the next
prompt for the same step, so every step still gets its full batch; after
``max_consecutive_group_failures`` failures in a row the manager raises
:class:`RewardFailure` instead of retrying forever. The group id is the global prompt
index.

An engine that Ray restarted holds its initial weights: it generates nothing
(:class:`EngineRestarted`) until ``on_engine_restart`` brought it to the current weights,
and the manager stops with an error if it is still stale afterwards.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from safetensors.torch import load_file, save_file

from ppo_driver._watch import address_reachable

from ._buffer import BufferMeta, ReplayBuffer, build_batch
from ._task import PromptDataset, RewardError, RewardFailure, RewardFn, ScoredGroup, score_group
from ._types import (
    ActorRef,
    EngineHealth,
    EngineRestarted,
    GroupOutput,
    GroupRequest,
    SamplingParams,
)

if TYPE_CHECKING:
    from ppo_sampler import Sampler
    from ray import ObjectRef

_log = logging.getLogger(__name__)


class ClusterLost(RuntimeError):
    """The Ray cluster the run is connected to is gone (its head, the GCS, does not
    answer): engines and workers on it will not come back."""


def gcs_address() -> str:
    """``host:port`` of the connected Ray cluster's GCS (known locally, no call to it)."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def cluster_reachable(timeout_s: float = 5.0) -> bool:
    """Whether the connected Ray cluster's GCS accepts a TCP connection: a stopped head
    refuses at once, a lost host within ``timeout_s``. Asks nothing of Ray itself (a
    driver whose GCS is gone blocks in Ray calls, then exits after 60 s)."""
    return address_reachable(gcs_address(), timeout_s)


_FORMAT = 1


class ManagerMeta(TypedDict):
    """``rollout.json``: the JSON half of :meth:`RolloutManager.state_dict`."""

    format: int
    next_prompt: int
    assigned: dict[str, int]
    """groups not failed per step (step as a string: JSON keys are)"""
    to_dispatch: list[list[int]]
    """``[group id, step]`` of each group to generate (again) on load"""
    failures: list[list[int | str]]
    """``[group id, step, message]`` of each failed group"""
    buffer: BufferMeta


@dataclass(frozen=True, slots=True)
class GroupFailure:
    """A group that will not be trained on, and why."""

    group_id: int
    step: int
    message: str


@dataclass(slots=True)
class _Call:
    engine: int
    groups: list[tuple[int, int]]  # (group id, step)


def longest(group: ScoredGroup) -> int:
    """The tokens of a group's longest response: the decode steps it took (its samples
    decode together); the key of ``file_by_length``."""
    return max(len(s.token_ids) for s in group.output.samples)


def _check_limits(
    *,
    engines: int,
    prompts_per_step: int,
    max_in_flight: int,
    groups_per_call: int,
    reward_timeout_s: float | None,
    max_consecutive_group_failures: int | None,
) -> None:
    """Refuse a :class:`RolloutManager` limit that cannot work, naming it and the fix."""
    if not engines:
        raise ValueError("RolloutManager needs at least one engine")
    if prompts_per_step < 1:
        raise ValueError(f"prompts_per_step={prompts_per_step}: use at least 1")
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight={max_in_flight}: allow at least one group in flight")
    if groups_per_call < 1:
        raise ValueError(f"groups_per_call={groups_per_call}: use at least 1")
    if reward_timeout_s is not None and not reward_timeout_s >= 0:
        raise ValueError(f"reward_timeout_s={reward_timeout_s}: use seconds > 0, or 0 for no limit")
    if max_consecutive_group_failures is not None and max_consecutive_group_failures < 1:
        raise ValueError(
            f"max_consecutive_group_failures={max_consecutive_group_failures}: use at "
            "least 1 (None: never stop)"
        )


class RolloutManager:
    """Drives generation for the train pump.

    Args:
        engines: Ray actor handles of :class:`RolloutEngine` implementations.
        dataset: where prompt ``i`` comes from.
        sampler: a ``ppo_sampler`` sampler (``in_order`` / ``ready_first``); the manager
            calls ``can_dispatch`` (admission) and ``add`` (readiness).
        reward_fn: see :func:`load_reward_fn`.
        params: sampling parameters of every group.
        prompts_per_step: groups per training step (``ppo.num_prompts_per_step``).
        max_in_flight: the most groups dispatched and not yet returned.
        buffer: the replay buffer (a new one by default).
        groups_per_call: groups sent to an engine in one ``generate`` call.
        on_engine_restart: called as ``hook(index, handle)`` when a restarted engine is
            back, before it gets work, to push the current weights to it
            (:meth:`WeightRefitter.restore_engine`). Without it a restarted engine stops
            the run (it would only serve its initial weights).
        reward_timeout_s: a reward call that takes longer fails its group (``None`` or
            0: no limit); see :func:`score_group`.
        max_consecutive_group_failures: raise :class:`RewardFailure` when this many
            groups fail in a row (``None``: never).
        file_in_dispatch_order: file finished groups (replay buffer + ``sampler.add``) in
            the order they were dispatched, each once every group dispatched before it is
            filed or failed, instead of as they finish (``async_rl.deterministic_chunks``:
            the sampler's fixed chunks are then the same groups whatever the timing).
        file_by_length: file finished groups in the order of their longest response
            (prompt index among equals), each once no group still out can come before
            it: every group still out has drawn at least that many tokens, by the
            engines' :meth:`progress` reports (``async_rl.block_order: length``). The
            sampler's fixed chunks are then the same groups whatever the timing, and
            they fill as early as the groups finish. :meth:`claim` keeps that order.
        progress_interval_s: with ``file_by_length``, the least time between two
            progress reports asked of each engine.
    """

    def __init__(
        self,
        *,
        engines: Sequence[ActorRef],
        dataset: PromptDataset,
        sampler: Sampler,
        reward_fn: RewardFn,
        params: SamplingParams,
        prompts_per_step: int,
        max_in_flight: int,
        buffer: ReplayBuffer | None = None,
        groups_per_call: int = 1,
        on_engine_restart: Callable[[int, ActorRef], None] | None = None,
        reward_timeout_s: float | None = 60.0,
        max_consecutive_group_failures: int | None = 32,
        file_in_dispatch_order: bool = False,
        file_by_length: bool = False,
        progress_interval_s: float = 0.02,
    ) -> None:
        if file_in_dispatch_order and file_by_length:
            raise ValueError(
                "RolloutManager: file_in_dispatch_order and file_by_length are two filing "
                "orders; pick one (async_rl.block_order)"
            )
        _check_limits(
            engines=len(engines),
            prompts_per_step=prompts_per_step,
            max_in_flight=max_in_flight,
            groups_per_call=groups_per_call,
            reward_timeout_s=reward_timeout_s,
            max_consecutive_group_failures=max_consecutive_group_failures,
        )
        self.engines = list(engines)
        self.dataset = dataset
        self.sampler = sampler
        self.reward_fn = reward_fn
        self.params = params
        self.prompts_per_step = prompts_per_step
        self.max_in_flight = max_in_flight
        self.buffer = buffer if buffer is not None else ReplayBuffer()
        self.groups_per_call = groups_per_call
        self.on_engine_restart = on_engine_restart
        self.reward_timeout_s = reward_timeout_s or None
        self.max_consecutive_group_failures = max_consecutive_group_failures
        self.file_in_dispatch_order = file_in_dispatch_order
        self.file_by_length = file_by_length
        self.progress_interval_s = float(progress_interval_s)
        # finished and scored, not yet filed: gid -> (group, step, weight version)
        self._held: dict[int, tuple[ScoredGroup, int, int]] = {}
        # file_in_dispatch_order / file_by_length: dispatched ids neither filed nor
        # failed, ascending (ids are handed out in increasing order)
        self._unfiled: dict[int, None] = {}
        # file_by_length: each engine's progress call in flight, when the last was sent,
        # and the tokens each group out has drawn at least (its latest report)
        self._progress: dict[int, ObjectRef[dict[int, int]]] = {}
        self._progress_sent = 0.0
        self._drawn: dict[int, int] = {}
        self._failure_streak = 0
        self._streak_start = ""  # the first failure of the current streak, with traceback
        # dispatch position
        self.next_prompt = 0
        self._fill_step = 0
        self._assigned: Counter[int] = Counter()  # step -> groups not failed
        self._pending: deque[tuple[int, int]] = deque()  # lost in flight, to re-dispatch
        self._in_flight: dict[ObjectRef[list[GroupOutput]], _Call] = {}
        self._alive = [True] * len(self.engines)
        self._probes: dict[int, ObjectRef[EngineHealth]] = {}
        self._incarnations: list[str | None] = [None] * len(self.engines)
        # records
        self.failures: list[GroupFailure] = []
        self.dispatch_counts: Counter[int] = Counter()
        self._calls_of_step: Counter[int] = Counter()  # step -> generate calls carrying it
        self.redispatched: list[int] = []
        self.peak_in_flight = 0
        self.max_step_dispatched = -1

    # -- inspection -------------------------------------------------------------------------
    @property
    def groups_in_flight(self) -> int:
        return sum(len(c.groups) for c in self._in_flight.values())

    def in_flight_ids(self) -> list[int]:
        return [g for c in self._in_flight.values() for g, _ in c.groups]

    def idle(self) -> bool:
        """Nothing in flight and nothing waiting for re-dispatch."""
        return not self._in_flight and not self._pending

    # -- the pump -----------------------------------------------------------------------------
    def pump(
        self,
        *,
        trainer_step: int,
        timeout_s: float = 0.0,
        wake_on: Sequence[ObjectRef[Any]] = (),
    ) -> list[int]:
        """Dispatch what may be dispatched, wait up to ``timeout_s`` for results, file
        them, dispatch again. Returns the group ids that became ready (in order).

        ``wake_on``: other calls (e.g. a trainer's) whose end also ends the wait."""
        import ray

        self._probe_dead()
        self._dispatch(trainer_step)
        ready: list[int] = []
        if self._in_flight:
            if self.file_by_length and self._held:
                # a progress report may let held groups go: wake for it, and ask for one
                # at most every progress_interval_s
                self._ask_progress()
                wake_on = [*wake_on, *self._progress.values()]
                if not self._progress:
                    later = self._progress_sent + self.progress_interval_s - time.monotonic()
                    timeout_s = min(timeout_s, max(later, 0.0))
            woke, _ = ray.wait([*self._in_flight, *wake_on], num_returns=1, timeout=timeout_s)
            done = [ref for ref in woke if ref in self._in_flight]
            if woke:
                more, _ = ray.wait(
                    list(self._in_flight), num_returns=len(self._in_flight), timeout=0
                )
                done = list(dict.fromkeys([*done, *more]))
            for ref in done:
                ready.extend(self._collect(ref))
            if self.file_by_length:
                self._read_progress()
                ready.extend(self._file_held())
        elif timeout_s > 0 and (self._pending or self._probes):
            self._wait_probes(timeout_s)
        if self.file_by_length and self._held and not self._in_flight and not self._pending:
            ready.extend(self._file_held())  # nothing is out: every held group goes
        self._probe_dead()
        self._dispatch(trainer_step)
        return ready

    # -- filing by length ---------------------------------------------------------------
    def _ask_progress(self) -> None:
        """Ask every engine with groups out for a progress report, unless one is in
        flight or the last was sent less than ``progress_interval_s`` ago."""
        if self._progress or time.monotonic() - self._progress_sent < self.progress_interval_s:
            return
        engines = {c.engine for c in self._in_flight.values()}
        for engine in sorted(engines):
            if self._alive[engine]:
                self._progress[engine] = self.engines[engine].progress.remote()
        self._progress_sent = time.monotonic()

    def _read_progress(self) -> None:
        """Take in the progress reports that came back: a group's count only grows, and
        only groups out on that engine take it (a re-dispatched group starts again)."""
        import ray
        from ray.exceptions import RayActorError

        if not self._progress:
            return
        done, _ = ray.wait(
            list(self._progress.values()), num_returns=len(self._progress), timeout=0
        )
        for engine, ref in list(self._progress.items()):
            if ref not in done:
                continue
            del self._progress[engine]
            try:
                report: dict[int, int] = ray.get(ref)
            except (RayActorError, EngineRestarted):
                continue  # the generate calls report the death
            out = {g for c in self._in_flight.values() if c.engine == engine for g, _ in c.groups}
            for gid, drawn in report.items():
                if gid in out:
                    self._drawn[gid] = max(self._drawn.get(gid, 0), int(drawn))

    def _length_horizon(self) -> float:
        """Every group still out (in flight or to re-dispatch) will have a longest
        response above this many tokens (infinite when none is out)."""
        out = [g for g in self._unfiled if g not in self._held]
        return min((self._drawn.get(g, 0) for g in out), default=math.inf)

    def _step_to_fill(self) -> int:
        """The lowest step that still lacks groups (a failure reopens its step)."""
        while self._assigned[self._fill_step] >= self.prompts_per_step:
            self._fill_step += 1
        return self._fill_step

    def _next_groups(self, trainer_step: int, limit: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while self._pending and len(out) < limit:
            out.append(self._pending.popleft())
        while len(out) < limit:
            step = self._step_to_fill()
            if not self.sampler.can_dispatch(step, trainer_step=trainer_step):
                break
            gid = self.next_prompt
            self.next_prompt += 1
            self._assigned[step] += 1
            if self.file_in_dispatch_order or self.file_by_length:
                self._unfiled[gid] = None
            out.append((gid, step))
        return out

    def _dispatch(self, trainer_step: int) -> None:
        while True:
            room = self.max_in_flight - self.groups_in_flight
            alive = [i for i, ok in enumerate(self._alive) if ok]
            if room <= 0 or not alive:
                return
            load = Counter(c.engine for c in self._in_flight.values() for _ in c.groups)
            engine = min(alive, key=lambda i: (load[i], i))
            groups = self._next_groups(trainer_step, min(room, self.groups_per_call))
            if not groups:
                return
            requests = [
                GroupRequest(
                    prompt_index=g, prompt_ids=self.dataset.prompt_ids(g), params=self.params
                )
                for g, _ in groups
            ]
            ref = self.engines[engine].generate.remote(requests)
            self._in_flight[ref] = _Call(engine=engine, groups=groups)
            for g, s in groups:
                self.dispatch_counts[g] += 1
                self.max_step_dispatched = max(self.max_step_dispatched, s)
            self._calls_of_step.update({s for _, s in groups})
            self.peak_in_flight = max(self.peak_in_flight, self.groups_in_flight)

    def _collect(self, ref: ObjectRef[list[GroupOutput]]) -> list[int]:
        import ray
        from ray.exceptions import RayActorError

        call = self._in_flight.pop(ref)
        try:
            outputs: list[GroupOutput] = ray.get(ref)
        except (RayActorError, EngineRestarted) as exc:
            if isinstance(exc, RayActorError) and not cluster_reachable():
                raise ClusterLost(
                    f"engine {call.engine} died with {len(call.groups)} group(s) in flight "
                    f"and the Ray cluster's head ({gcs_address()}) does not answer: the "
                    "cluster is gone, nothing that ran on it comes back"
                ) from exc
            _log.warning(
                "engine %d %s with %d group(s) in flight; they will be re-dispatched once "
                "it is back with the current weights",
                call.engine,
                "was restarted" if isinstance(exc, EngineRestarted) else "died",
                len(call.groups),
            )
            self._mark_dead(call.engine)
            for g, s in reversed(call.groups):
                self._pending.appendleft((g, s))
                self.redispatched.append(g)
                self._drawn.pop(g, None)
            return []
        for (gid, step), out in zip(call.groups, outputs, strict=True):
            assert out.prompt_index == gid, (out.prompt_index, gid)
            try:
                scored = score_group(
                    out,
                    record=self.dataset.record(gid),
                    reward_fn=self.reward_fn,
                    tokenizer=self.dataset.tokenizer,
                    timeout_s=self.reward_timeout_s,
                )
            except RewardError as exc:
                self._unfiled.pop(gid, None)
                self._drawn.pop(gid, None)
                self._group_failed(gid, step, exc)
                continue
            self._failure_streak = 0
            self._held[gid] = (scored, step, out.weight_version)
        return self._file_held()

    def _file_held(self) -> list[int]:
        """File finished groups in the replay buffer and report them ready to the sampler:
        all of them, or with ``file_in_dispatch_order`` those dispatched before every
        group still out, in dispatch order. Returns the filed ids."""
        if self.file_in_dispatch_order:
            order: list[int] = []
            while self._unfiled and (gid := next(iter(self._unfiled))) in self._held:
                del self._unfiled[gid]
                order.append(gid)
        elif self.file_by_length:
            horizon = self._length_horizon()
            length = {g: longest(group) for g, (group, _, _) in self._held.items()}
            order = sorted(
                (g for g in length if length[g] <= horizon), key=lambda g: (length[g], g)
            )
            for gid in order:
                del self._unfiled[gid]
                self._drawn.pop(gid, None)
        else:
            order = list(self._held)
        for gid in order:
            scored, step, version = self._held.pop(gid)
            self.buffer.add(scored, step=step)
            self.sampler.add(gid, step=step, weight_version=version)
        return order

    def _group_failed(self, gid: int, step: int, exc: RewardError) -> None:
        """Record the failure and reopen its step; raise after too many in a row."""
        self.failures.append(GroupFailure(group_id=gid, step=step, message=str(exc)))
        self._assigned[step] -= 1
        self._fill_step = min(self._fill_step, step)
        self._failure_streak += 1
        if self._failure_streak == 1:
            self._streak_start = "".join(traceback.format_exception(exc)).rstrip()
            _log.error("group %d (step %d) failed and is not trained on", gid, step, exc_info=exc)
        else:
            _log.error("group %d (step %d) failed and is not trained on: %s", gid, step, exc)
        limit = self.max_consecutive_group_failures
        if limit is not None and self._failure_streak >= limit:
            raise RewardFailure(
                f"{self._failure_streak} prompt groups failed in a row "
                f"(rollout.max_consecutive_group_failures={limit}): the reward keeps failing "
                "(it raised, timed out or returned something that is not a real number), so "
                f"no step can be filled. The first failure of the streak:\n{self._streak_start}"
            )

    # -- engine restarts -------------------------------------------------------------------
    def _mark_dead(self, engine: int) -> None:
        self._progress.pop(engine, None)  # a report from before the death is stale
        if self._alive[engine]:
            self._alive[engine] = False
            self._probes[engine] = self.engines[engine].health.remote()

    def _wait_probes(self, timeout_s: float) -> None:
        import ray

        if self._probes:
            ray.wait(list(self._probes.values()), num_returns=1, timeout=timeout_s)

    def _probe_dead(self) -> None:
        import ray
        from ray.exceptions import RayActorError

        for engine, probe in list(self._probes.items()):
            done, _ = ray.wait([probe], timeout=0)
            if not done:
                continue
            try:
                health = ray.get(probe)
            except RayActorError:
                self._probes[engine] = self.engines[engine].health.remote()
                continue
            del self._probes[engine]
            _log.warning("engine %d is back (incarnation %s)", engine, health.incarnation[:8])
            if self.on_engine_restart is not None:
                try:
                    self.on_engine_restart(engine, self.engines[engine])
                    health = ray.get(self.engines[engine].health.remote())
                except RayActorError:  # died again: probe again
                    self._probes[engine] = self.engines[engine].health.remote()
                    continue
            if health.needs_weights:
                raise RuntimeError(
                    f"engine {engine} was restarted by Ray and still holds its initial weights "
                    f"(version {health.weight_version}), not the current policy; pass "
                    "RolloutManager(on_engine_restart=refitter.restore_engine) so that a "
                    "restarted engine gets the current weights before it generates"
                )
            self._incarnations[engine] = health.incarnation
            self._alive[engine] = True

    # -- training side ------------------------------------------------------------------------
    def claim(self, group_ids: Sequence[int | str]) -> dict[str, torch.Tensor]:
        """Claim the groups the sampler selected in the replay buffer and build their
        batch (see :func:`build_batch`), rows in prompt-index order, or with
        ``file_by_length`` in the filing order (longest response, then prompt index),
        which the fixed blocks follow: the order groups arrived in depends on timing,
        and a batch's row order is its summation order (float32 addition is not
        associative), so a same-seed rerun must not depend on it."""
        by_length = self.file_by_length
        ids = sorted(
            (int(g) for g in group_ids),
            key=lambda g: (longest(self.buffer.get(g)) if by_length else 0, g),
        )
        groups = self.buffer.claim(ids)
        return build_batch(groups, pad_id=self.dataset.tokenizer.pad_id)

    def unclaim(self, group_ids: Sequence[int | str]) -> None:
        """Undo ``select`` + :meth:`claim` for a failed chunk."""
        ids = [int(g) for g in group_ids]
        self.buffer.unclaim(ids)
        self.sampler.release_claim(ids)

    def release(self, group_ids: Iterable[int | str]) -> None:
        """After BOTH updates of the step: drop the rows and tell the sampler."""
        ids = [int(g) for g in group_ids]
        self.buffer.release(ids)
        self.sampler.mark_consumed(ids)

    def take_generate_calls(self, step: int) -> int:
        """The ``generate`` calls that carried groups of ``step`` (re-dispatches
        included); forgets the count."""
        return self._calls_of_step.pop(step, 0)

    def redispatch_evicted(self) -> list[int]:
        """Groups a ``ready_first`` sampler evicted as stale: drop them from the buffer
        and queue their prompts again (they regenerate with newer weights)."""
        evicted = [int(g) for g in self.sampler.pop_evicted()]
        steps = [self.buffer.step_of(g) for g in evicted]
        self.buffer.drop(evicted)
        self._pending.extend(zip(evicted, steps, strict=True))
        return evicted

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> tuple[ManagerMeta, dict[str, torch.Tensor]]:
        """(JSON metadata, tensors): dispatch position, the groups in flight or waiting
        (re-dispatched on load), failures, and the replay buffer."""
        buf_meta, tensors = self.buffer.state_dict()
        lost = [[g, s] for c in self._in_flight.values() for g, s in c.groups]
        lost += [[g, s] for g, s in self._pending]
        lost += [[g, s] for g, (_, s, _) in self._held.items()]  # generated again on load
        meta: ManagerMeta = {
            "format": _FORMAT,
            "next_prompt": self.next_prompt,
            "assigned": {str(k): v for k, v in self._assigned.items()},
            "to_dispatch": lost,
            "failures": [[f.group_id, f.step, f.message] for f in self.failures],
            "buffer": buf_meta,
        }
        return meta, tensors

    def load_state_dict(self, meta: ManagerMeta, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a snapshot; must be called before any dispatch."""
        if self._in_flight:
            raise ValueError("RolloutManager.load_state_dict: groups are in flight; load first")
        if meta.get("format") != _FORMAT:
            raise ValueError(
                f"RolloutManager.load_state_dict: unknown format {meta.get('format')!r}"
            )
        self.buffer.load_state_dict(meta["buffer"], tensors)
        self.next_prompt = int(meta["next_prompt"])
        self._assigned = Counter({int(k): int(v) for k, v in meta["assigned"].items()})
        self._fill_step = 0
        self._pending = deque((int(g), int(s)) for g, s in meta["to_dispatch"])
        self._held = {}
        self._drawn = {}
        if self.file_in_dispatch_order or self.file_by_length:
            self._unfiled = dict.fromkeys(sorted(g for g, _ in self._pending))
        self.failures = [GroupFailure(int(g), int(s), str(m)) for g, s, m in meta["failures"]]

    def save(self, path: str | Path) -> None:
        """``rollout.json`` + ``rollout.safetensors`` in directory ``path`` (aside, then renamed)."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        meta, tensors = self.state_dict()
        save_file(tensors, str(d / "rollout.safetensors.tmp"))
        os.replace(d / "rollout.safetensors.tmp", d / "rollout.safetensors")
        (d / "rollout.json.tmp").write_text(json.dumps(meta))
        os.replace(d / "rollout.json.tmp", d / "rollout.json")

    def load(self, path: str | Path) -> None:
        d = Path(path)
        self.load_state_dict(
            json.loads((d / "rollout.json").read_text()), load_file(str(d / "rollout.safetensors"))
        )
