"""The pump's step schedule (the streaming document's update lifecycle), observed from
inside the calls it orders: what the critic's training call sees (the step counter, the
replay buffer's rows, the engines' state and weight version), and the order in which
the worker groups, the engines and the rollout side are called.

Real: the pump, the sampler, the replay buffer and its batch builder, the residency
planner, the trace. Fakes stand only for what runs on other processes: the two worker
groups (one rank each; a call does its work when submitted, which is when Ray would
start it, since the pump submits in dependency order) and the engines (generation is
instant: each poll files the next group(s) the sampler admits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from driver_testlib import TINY_RUN, chunk_batch
from ppo_driver.batch import StepBatch
from ppo_driver.config import DriverConfig, load_config, sampler_config
from ppo_driver.pair import TrainPair
from ppo_driver.pump import TrainPump
from ppo_driver.rollout import (
    GroupOutput,
    ReplayBuffer,
    SampleOutput,
    ScoredGroup,
    build_batch,
)
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import NOW, CallOptions, GroupResult, Rows
from ppo_lifecycle import Action, Role, Transition
from ppo_sampler import Sampler, make_sampler

PAD = 0
STREAMING = ["async_rl.min_groups_for_streaming_train=2"]  # TINY_RUN's: 8 groups, minimum 2
FULL_BATCH = ["async_rl.min_groups_for_streaming_train=8"]
COLOCATED = [*FULL_BATCH, "cluster.colocate=true"]


@dataclass(frozen=True)
class Call:
    """One entry of the run's event log: a worker call, an engine call or a poll."""

    who: str  # "actor", "critic", "generation", "rollout"
    what: str  # the method
    wake_first: object = False
    sleep_after: object = None
    step: int = -1  # the pump's completed_steps when it happened
    ready: int = 0  # rollout polls: groups that became ready
    args: tuple[tuple[str, object], ...] = ()  # the call's scalar keyword arguments
    path: str = ""  # save_checkpoint / load_checkpoint: where


@dataclass
class Seen:
    """The world as the critic's training call finds it."""

    completed_steps: int
    claimed: list[int]  # replay buffer rows claimed (trained on, not yet released)
    sampler_claimed: list[int]
    engines_paused: bool
    engine_version: int  # the policy version on the engines
    pump_version: int
    log_index: int  # this call's position in the event log
    save_refused: str  # what save_models said when asked here ("" if it saved)


@dataclass
class World:
    cfg: DriverConfig
    log: list[Call] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    pump: TrainPump | None = None
    critic_train_checks: int = 0  # the critic's training runs for this many done() checks
    # the models on the training devices, from the calls' wake-ups and sleeps (the
    # critic is resident at start-up)
    resident: set[str] = field(default_factory=lambda: {"critic"})
    # (event, models resident, engines paused) at each trainer call and each group
    # generated
    shared: list[tuple[str, frozenset[str], bool]] = field(default_factory=list)
    # (len(log) when the pump waited for a call's result, the call's position in the log)
    awaited: list[tuple[int, int]] = field(default_factory=list)


class _Done:
    """A call whose work was done at submit; it reports itself running for ``runs``
    checks of :meth:`done` (the world's ``critic_train_checks``, for the critic's training)."""

    def __init__(self, value: Any, label: str, runs: int = 0, world: World | None = None) -> None:
        self.value, self.label, self.runs, self.world = value, label, runs, world
        self.refs = (label,)
        self.index = len(world.log) - 1 if world is not None else -1  # its own log entry

    def done(self) -> bool:
        self.runs -= 1
        return self.runs < 0

    def result(self) -> GroupResult[Any]:
        if self.world is not None:
            self.world.awaited.append((len(self.world.log), self.index))
        return GroupResult(values=[self.value], timeline=[(self.label, 0.0, 0.0)])


class _Group:
    """A one-rank worker group: records each call, does the work at submit."""

    dp_size = 1

    def __init__(self, role: str, world: World, rollout: _Rollout, engines: _Engines) -> None:
        self.role, self.world, self.rollout, self.engines = role, world, rollout, engines
        self.passes = 0

    def submit(
        self, options: CallOptions, method: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> _Done:
        return self._record(method.__name__, None, options, kwargs, args)

    def submit_rows(
        self,
        options: CallOptions,
        method: Callable[..., Any],
        rows: Rows,
        /,
        *args: Any,
        **kwargs: Any,
    ) -> _Done:
        return self._record(method.__name__, rows, options, kwargs, args)

    def build(self) -> None:
        pump = self.world.pump
        assert pump is not None
        self.world.log.append(Call(self.role, "build", step=pump.completed_steps))
        self.world.resident.add(self.role)  # a model just built is on the devices

    def transition(self, t: Transition, *, after: Sequence[object] = ()) -> _Done:
        method = "sleep" if t.action is Action.SLEEP else "wake_up"
        return self._record(method, None, NOW, {"parts": t.parts}, ())

    def _record(
        self,
        method: str,
        rows: Rows | None,
        options: CallOptions,
        kwargs: dict[str, Any],
        args: tuple[Any, ...],
    ) -> _Done:
        wake_first, sleep_after = options.wake_first, options.sleep_after
        pump = self.world.pump
        assert pump is not None
        scalars = tuple((k, v) for k, v in sorted(kwargs.items()) if isinstance(v, int | float))
        self.world.log.append(
            Call(
                self.role,
                method,
                wake_first,
                sleep_after,
                step=pump.completed_steps,
                args=scalars,
                path=args[0] if method in ("save_checkpoint", "load_checkpoint") else "",
            )
        )
        if wake_first or method == "wake_up":
            self.world.resident.add(self.role)
        if method not in ("sleep", "counters"):  # work on the devices (not a counter read)
            event = f"{self.role}.{method}"
            self.world.shared.append((event, frozenset(self.world.resident), self.engines.paused))
        if sleep_after is not None or method == "sleep":
            self.world.resident.discard(self.role)
        inputs = rows.tensors if rows is not None else {}
        value: Any = None
        if method in ("compute_values", "compute_logprobs"):
            value = torch.zeros(inputs["loss_mask"].shape)
        elif method == "train_chunk":
            self.passes += 1
            value = {"actor/valid_tokens": float(inputs["loss_mask"].sum()), "loss/pg": 0.0}
        elif method in ("finish_step", "train_epochs"):
            value = {"actor/grad_norm": 0.0}
        elif method == "counters":
            value = {"policy_forward_backward": float(self.passes)}
        elif method == "train":  # the critic's training: look around
            try:
                pump.save_models(Path("ckpt"), step=pump.completed_steps)
                refused = ""
            except RuntimeError as exc:
                refused = str(exc)
            self.world.seen.append(
                Seen(
                    completed_steps=pump.completed_steps,
                    claimed=sorted(self.rollout.buffer.claimed_ids()),
                    sampler_claimed=sorted(int(g) for g in self.rollout.sampler.claimed()),
                    engines_paused=self.engines.paused,
                    engine_version=self.engines.version,
                    pump_version=pump.weight_version,
                    log_index=len(self.world.log) - 1,
                    save_refused=refused,
                )
            )
            value = {"loss/value": 0.0}
        runs = self.world.critic_train_checks if method == "train" else 0
        return _Done(value, f"{self.role}.{method}", runs, self.world)

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> GroupResult[Any]:
        return self.submit(NOW, method, *args, **kwargs).result()


class _Engines:
    """The engines as the pump sees them (``GenerationControl``)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.paused = False
        self.version = 0

    def _log(self, what: str) -> None:
        pump = self.world.pump
        assert pump is not None
        self.world.log.append(Call("generation", what, step=pump.completed_steps))

    def refit(self, *, version: int) -> None:
        self._log("refit")
        self.version = version

    def pause(self) -> None:
        self._log("pause")
        self.paused = True

    def resume(self) -> None:
        self._log("resume")
        self.paused = False


class _Rollout:
    """The rollout manager's training side over the real replay buffer and sampler.
    Each poll files at most one finished group of a step the sampler admits (so the
    pump meets empty selections while it waits); paused engines file nothing."""

    def __init__(self, world: World, sampler: Sampler, engines: _Engines) -> None:
        self.world, self.sampler, self.engines = world, sampler, engines
        self.buffer = ReplayBuffer()
        self.next_gid = 0
        self.batch = world.cfg.batch_groups
        self.n = world.cfg.ppo.num_generations_per_prompt
        self.wake_ons: list[tuple[Any, ...]] = []  # each poll's wake_on

    @property
    def groups_in_flight(self) -> int:
        """A group is "in flight" while the world's engines could generate one more."""
        return int(not self.engines.paused)

    def pump(
        self, *, trainer_step: int, timeout_s: float = 0.0, wake_on: Sequence[Any] = ()
    ) -> list[int]:
        self.wake_ons.append(tuple(wake_on))
        gid, step = self.next_gid, self.next_gid // self.batch
        ready: list[int] = []
        if not self.engines.paused and self.sampler.can_dispatch(step, trainer_step=trainer_step):
            self.world.shared.append(
                ("generate", frozenset(self.world.resident), self.engines.paused)
            )
            self.buffer.add(self._group(gid), step=step)
            self.sampler.add(gid, step=step, weight_version=self.engines.version)
            self.next_gid += 1
            ready.append(gid)
        pump = self.world.pump
        assert pump is not None
        self.world.log.append(Call("rollout", "poll", step=pump.completed_steps, ready=len(ready)))
        return ready

    def _group(self, gid: int) -> ScoredGroup:
        samples = tuple(
            SampleOutput(
                token_ids=tuple(range(3, 4 + (gid + j) % 5)),
                logprobs=tuple(-0.5 for _ in range(1 + (gid + j) % 5)),
                finish_reason="stop",
            )
            for j in range(self.n)
        )
        out = GroupOutput(
            prompt_index=gid,
            prompt_ids=(1, 5 + gid % 3),
            samples=samples,
            weight_version=self.engines.version,
            engine_id="fake",
        )
        return ScoredGroup(output=out, rewards=tuple(float(j % 2) for j in range(self.n)))

    def claim(self, group_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        self.world.log.append(Call("rollout", "claim"))
        return build_batch(self.buffer.claim(sorted(group_ids)), pad_id=PAD)

    def release(self, group_ids: Iterable[int]) -> None:
        ids = [int(g) for g in group_ids]
        self.buffer.release(ids)
        self.sampler.mark_consumed(ids)

    def redispatch_evicted(self) -> list[int]:
        return []

    def take_generate_calls(self, step: int) -> int:
        return 0


def _world(*extra: str) -> tuple[World, _Rollout]:
    cfg, _ = load_config(None, [*TINY_RUN, *extra])
    world = World(cfg)
    sampler = make_sampler(sampler_config(cfg))
    engines = _Engines(world)
    engines.paused = cfg.cluster.colocate  # colocated engines start released
    rollout = _Rollout(world, sampler, engines)
    trace = TraceRecorder()
    pair = TrainPair(
        _Group("actor", world, rollout, engines),  # type: ignore[arg-type]
        _Group("critic", world, rollout, engines),  # type: ignore[arg-type]
        trace=trace,
    )
    world.pump = TrainPump(
        cfg,
        pair=pair,
        rollout=rollout,
        generation=engines,
        sampler=sampler,
        pad_id=PAD,
        trace=trace,
    )
    return world, rollout


def _index(log: list[Call], who: str, what: str, *, step: int) -> list[int]:
    return [i for i, c in enumerate(log) if (c.who, c.what, c.step) == (who, what, step)]


@pytest.mark.parametrize("mode", [STREAMING, FULL_BATCH], ids=["streaming", "full_batch"])
def test_refit_then_critic_training_then_release_then_count(mode: list[str]) -> None:
    """Separate generation devices: the policy update and the refit come before critic
    training (the critic's call finds the new version on the engines, the refit over);
    the step's rows are released and the step counted only after critic training (the
    critic's call finds them still claimed, the counter not yet advanced)."""
    world, rollout = _world(*mode)
    assert world.pump is not None
    for step in range(2):
        report = world.pump.run_step()
        assert world.pump.completed_steps == step + 1
        assert len(report.chunk_groups) > 1 if mode is STREAMING else report.chunk_groups == [8]
        seen = world.seen[step]
        # the rule's own order: refit ends before critic training starts
        (refit,) = _index(world.log, "generation", "refit", step=step)
        assert refit < seen.log_index
        assert seen.engine_version == seen.pump_version == step + 1
        # release after both updates: the step's rows are still claimed while the critic
        # trains on them (buffer and sampler), gone once the step returns
        assert seen.claimed == report.group_ids == list(range(8 * step, 8 * step + 8))
        assert seen.sampler_claimed == report.group_ids
        assert not any(g in rollout.buffer for g in report.group_ids)
        assert rollout.sampler.claimed() == []
        # completed-step counters advance after critic training
        assert seen.completed_steps == step
        # checkpoint exclusion covers the whole update, critic training included
        assert "save between steps" in seen.save_refused
        assert not seen.engines_paused  # generation has devices of its own: never paused
    assert all(c.what not in ("pause", "resume") for c in world.log)
    before = len(world.log)
    world.pump.save_models(Path("ckpt"), step=2)  # between steps
    saved = [c for c in world.log[before:] if c.what == "save_checkpoint"]
    assert sorted(c.who for c in saved) == ["actor", "critic"]
    assert {c.who: c.path for c in saved} == {"actor": "ckpt/actor", "critic": "ckpt/critic"}


def test_generation_is_collected_while_the_critic_trains() -> None:
    """Separate generation devices: the next step's generation is dispatched once the
    critic's training call is queued (the critic does not wait for one engine call per
    group), and while that training runs the pump keeps filing the next step's groups
    (polls that also wake when the call ends), so they are not collected and scored on
    the next step's critical path; it stops polling once the call is done."""
    world, rollout = _world(*STREAMING)
    assert world.pump is not None
    world.critic_train_checks = 3
    world.pump.run_step()
    (train,) = _index(world.log, "critic", "train", step=0)
    polls = [c for c in world.log[train + 1 :] if (c.who, c.what) == ("rollout", "poll")]
    before = [c for c in world.log[:train] if (c.who, c.what) == ("rollout", "poll")]
    # the dispatch, then step 1's groups, filed while it ran
    assert [c.ready for c in polls] == [1, 1, 1, 1]
    assert rollout.wake_ons[-4:] == [()] + [("critic.train",)] * 3
    assert all(w == () for w in rollout.wake_ons[:-3])  # no call to wake on elsewhere
    assert sum(c.ready for c in before) == 8  # step 0's own groups only, before it
    # colocated: the engines are released while the critic trains: nothing to collect
    world, rollout = _world(*COLOCATED)
    assert world.pump is not None
    world.critic_train_checks = 3
    world.pump.run_step()
    assert ("critic.train",) not in rollout.wake_ons


@pytest.mark.timeout(120)  # the old pump never resumed released engines: a hang
def test_colocated_full_batch_time_shares_the_devices_with_generation() -> None:
    """Generation on the training devices (full batch): the engines start released;
    they resume for generation only while both models sleep, and release their memory
    (pause) once the batch is generated, before any model wakes. The value forward
    wakes the critic after that (not before the wait); the refit follows critic
    training and the engines resume only after the actor slept again. A checkpoint
    between steps releases the engines first; the next step resumes them."""
    world, rollout = _world(*COLOCATED)
    assert world.pump is not None
    for step in range(3):
        begin = len(world.log)  # this step's events (a checkpoint's are before it)
        report = world.pump.run_step()
        seen = world.seen[step]
        assert seen.engines_paused  # observed from inside critic training
        assert seen.engine_version == step  # the refit has not happened yet
        pause, refit, resume, claim = (
            [i for i, c in enumerate(world.log) if i >= begin and c.what == what]
            for what in ("pause", "refit", "resume", "claim")
        )
        trainers = [
            i
            for i, c in enumerate(world.log)
            if i >= begin and c.who in ("actor", "critic") and c.what != "counters"
        ]
        # step 0 and the step after a checkpoint start released: resumed first
        starts_released = step in (0, 2)
        assert [len(pause), len(refit), len(resume)] == [1, 1, 1 + starts_released]
        work = [i for i in trainers if world.log[i].what != "sleep"]
        if starts_released:  # the critic (resident at start-up, after a checkpoint)
            # sleeps, then the engines resume
            assert world.log[trainers[0]] == Call("critic", "sleep", step=step, args=())
            assert trainers[0] < resume[0] < claim[0]
        assert claim[0] < pause[0] < work[0]  # released before any model wakes
        assert pause[0] < seen.log_index < refit[0] < resume[-1]
        assert trainers[-1] < resume[-1]  # the actor's sleep after the refit
        assert world.log[trainers[-1]] == Call("actor", "sleep", step=step, args=())
        (forward,) = [world.log[i] for i in trainers if world.log[i].what == "compute_values"]
        assert forward.wake_first  # the critic wakes after generation, not before it
        assert not rollout.engines.paused and rollout.engines.version == step + 1
        assert world.resident == set()  # between steps the devices are the engines'
        assert seen.claimed == report.group_ids and seen.completed_steps == step
        if step == 1:  # a checkpoint between steps: the engines release first
            before = len(world.log)
            world.pump.save_models(Path("ckpt"), step=step + 1)
            assert world.log[before] == Call("generation", "pause", step=step + 1)
            assert rollout.engines.paused and world.resident == {"critic"}
    # never a model on the devices while the engines generate, never the engines
    # resident while a model works
    generated = [r for e, r, _ in world.shared if e == "generate"]
    assert len(generated) == 3 * 8 and not any(generated)
    worked = [(e, paused) for e, _, paused in world.shared if e != "generate"]
    assert worked and all(paused for _, paused in worked), worked


def test_critic_is_prepared_before_the_wait_and_stays_across_empty_selections() -> None:
    """Streaming: the controller wakes the critic before it waits for the next chunk
    (between chunks), never inside the value forward that follows the wait, and keeps it
    resident across the empty selections of the wait (no switch between polls).
    (Colocated, the critic sleeps through generation: see the colocated test.)"""
    world, _ = _world(*STREAMING)
    assert world.pump is not None
    reports = [world.pump.run_step() for _ in range(2)]
    log = world.log
    forwards = [i for i, c in enumerate(log) if c.what == "compute_values"]
    assert len(forwards) == sum(len(r.chunk_groups) for r in reports)
    assert [log[i].wake_first for i in forwards] == [False] * len(forwards)
    waits = []  # polls of each wait that the critic's own wake-up preceded
    for i in forwards[1:]:
        j = i - 1  # walk back over the wait (the rollout's polls, the claim)
        while log[j].who == "rollout":
            j -= 1
        if (log[j].who, log[j].what) == ("critic", "wake_up"):
            waits.append(sum(c.what == "poll" for c in log[j + 1 : i]))
    # every chunk but a step's first: the actor was resident
    assert len(waits) == sum(len(r.chunk_groups) - 1 for r in reports)
    # the pump polls again only after an empty selection: a wait of two polls or more
    # met one, with the critic resident throughout (no switch among the polls)
    assert max(waits) >= 2


@pytest.mark.parametrize("mode", [STREAMING, FULL_BATCH], ids=["streaming", "full_batch"])
def test_policy_epochs_then_refit_then_critic(mode: list[str]) -> None:
    """Three policy epochs. Streaming: every chunk's ``train_chunk`` keeps the chunk on
    the actor ranks, one ``finish_step`` (epoch 1's update), then ONE ``train_epochs``
    call for epochs 2 and 3 over the kept chunks with the step's count. Full batch: the
    same calls over its one chunk (epoch 1 is one optimizer step over the batch too, so
    its forward gives the old log-probs). Neither makes a separate log-prob forward.
    Both: every policy update before the refit, the refit before critic training."""
    world, _ = _world(*mode, "ppo.ppo_epochs=3")
    assert world.pump is not None
    for step in range(2):
        report = world.pump.run_step()
        actor = [(i, c) for i, c in enumerate(world.log) if c.who == "actor" and c.step == step]
        work = [c.what for _, c in actor if c.what not in ("sleep", "wake_up", "counters")]
        chunks = len(report.chunk_groups)
        assert chunks > 1 if mode is STREAMING else chunks == 1
        assert work == [*["train_chunk"] * chunks, "finish_step", "train_epochs"]
        trained = [dict(c.args) for _, c in actor if c.what == "train_chunk"]
        assert all(t["keep"] is True for t in trained)
        (epochs,) = [dict(c.args) for _, c in actor if c.what == "train_epochs"]
        assert epochs == {"epochs": 2, "loss_denominator": 16.0}  # the step's samples
        last_update = max(i for i, c in actor if c.what in ("finish_step", "train_epochs"))
        # the update's calls are started together, the actor running them in order: the
        # pump waits for the last chunk's training only once every update call of the
        # step is submitted (no round trip between them)
        last_train = max(i for i, c in actor if c.what == "train_chunk")
        (when,) = [at for at, index in world.awaited if index == last_train]
        assert when > last_update, (when, last_update)
        (refit,) = _index(world.log, "generation", "refit", step=step)
        assert last_update < refit < world.seen[step].log_index


def _step_batch(prompt_indices: list[int]) -> StepBatch:
    return StepBatch(**vars(chunk_batch(prompt_indices, 4)))


def test_no_short_batch_guard_checks_every_group_size() -> None:
    """The no-short-batch guard: 2 groups of 4 samples. 3 + 5 samples have the right
    total and the right number of prompts, yet a sample moved between groups: refused,
    naming each group and its count."""
    world, _ = _world(
        "ppo.num_prompts_per_step=2",
        "ppo.num_generations_per_prompt=4",
        "async_rl.min_groups_for_streaming_train=2",
    )
    guard = world.pump
    assert guard is not None
    guard._check_batch(_step_batch([0, 0, 0, 0, 1, 1, 1, 1]))
    with pytest.raises(AssertionError, match="prompt 0 has 3 samples, prompt 1 has 5 samples"):
        guard._check_batch(_step_batch([0, 0, 0, 1, 1, 1, 1, 1]))
    with pytest.raises(AssertionError, match=r"expected 4 \(ppo.num_generations_per_prompt\)"):
        guard._check_batch(_step_batch([0, 0, 0, 1, 1, 1, 1, 1]))
    with pytest.raises(AssertionError, match="step batch has 7 samples, expected 8"):
        guard._check_batch(_step_batch([0, 0, 0, 1, 1, 1, 1]))
    with pytest.raises(AssertionError, match="a group was dropped or duplicated"):
        guard._check_batch(_step_batch([0, 0, 0, 0, 1, 1, 1, 2]))


def test_start_builds_one_model_at_a_time_and_the_plan_puts_the_actor_to_sleep() -> None:
    """``TrainPair.start``: the actor is built and loaded, then sleeps with every part
    (the planner's ``release_all``, not a hand-written call), before the critic is built
    and loaded; the planner then has the critic resident, as the pump's first step
    expects. Two models are never resident at once."""
    world, _ = _world(*STREAMING)
    assert world.pump is not None
    world.resident.clear()  # nothing is built yet
    pair = world.pump.pair
    pair.start(Path("ckpt"))
    got = [(c.who, c.what, c.path) for c in world.log]
    assert got == [
        ("actor", "build", ""),
        ("actor", "load_checkpoint", "ckpt/actor"),
        ("actor", "sleep", ""),
        ("critic", "build", ""),
        ("critic", "load_checkpoint", "ckpt/critic"),
    ]
    assert world.log[2].wake_first is False and world.resident == {"critic"}
    assert pair.resident is Role.CRITIC and pair.switches == 0
    loaded = [e for e, _, _ in world.shared if e.endswith("load_checkpoint")]
    assert loaded == ["actor.load_checkpoint", "critic.load_checkpoint"]
    assert all(len(r) == 1 for e, r, _ in world.shared)  # one model resident at a time
    report = world.pump.run_step()  # the first step runs from that state
    assert world.pump.completed_steps == 1 and report.chunk_groups
