"""The pump's step schedule (the streaming document's update lifecycle), observed from
inside the calls it orders: what the critic's training call sees (the step counter, the
replay buffer's rows, the engines' state and weight version), the order in which
the worker groups, the engines and the rollout side are called, and what the pump
computes between the calls (the advantages and loss denominators the actor gets, the
critic's training inputs, each step's metrics).

Real: the pump, the sampler, the replay buffer and its batch builder, the residency
planner, the trace. Fakes stand only for what runs on other processes: the two worker
groups (one data-parallel rank each unless a test sets more; a call does its work when
submitted, which is when Ray would start it, since the pump submits in dependency
order) and the engines (generation is instant: each poll files the next group(s) the
sampler admits).
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
from ppo_driver.pump import NonFiniteError, TrainPump, _StepState
from ppo_driver.rollout import (
    GroupOutput,
    ReplayBuffer,
    SampleOutput,
    ScoredGroup,
    build_batch,
)
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import NOW, CallOptions, GroupResult, Rows, mini_batch_order
from ppo_lifecycle import Action, Role, Transition
from ppo_sampler import Sampler, make_sampler
from ppo_trainer import Moments, gae, masked_moments, masked_whiten, whiten_with
from ppo_trainer.testing import rounding_bound

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
    # each call with rows: ("<role>.<method>", its rows and per-sample tensors)
    tensors: list[tuple[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    actor_loss: float = 0.0  # what the actor's train_chunk reports as loss/pg
    actor_error: BaseException | None = None  # what its train_chunk raises instead


class _Done:
    """A call whose work was done at submit; it reports itself running for ``runs``
    checks of :meth:`done` (the world's ``critic_train_checks``, for the critic's training).
    ``value``: one data-parallel rank's result, or a list of them (one per rank)."""

    def __init__(self, value: Any, label: str, runs: int = 0, world: World | None = None) -> None:
        self.values = value if isinstance(value, list) else [value]
        self.label, self.runs, self.world = label, runs, world
        self.refs = (label,)
        self.index = len(world.log) - 1 if world is not None else -1  # its own log entry

    def done(self) -> bool:
        self.runs -= 1
        return self.runs < 0

    def result(self) -> GroupResult[Any]:
        if self.world is not None:
            self.world.awaited.append((len(self.world.log), self.index))
        return GroupResult(values=self.values, timeline=[(self.label, 0.0, 0.0)])


def _values(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fake critic's values: a different one at each token (not 0: the discount
    factor and GAE's lambda then enter the advantages in different ways)."""
    return (inputs["input_ids"] % 5).float() / 4


class _Group:
    """A worker group of ``dp_size`` data-parallel ranks (one unless a test sets more):
    records each call, does the work at submit. ``train_chunk`` (on each rank's share of
    the rows: ``Rows.split``), ``counters`` and the critic's ``train`` answer once per
    rank; any other call answers for all its rows at once."""

    dp_size = 1

    def __init__(self, role: str, world: World, rollout: _Rollout, engines: _Engines) -> None:
        self.role, self.world, self.rollout, self.engines = role, world, rollout, engines
        self.trained: dict[int, float] = {}  # rows trained on (forward + backward), per rank
        self.kept: dict[int, float] = {}  # rows the rank keeps for epochs 2..K

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
        if rows is not None:
            tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            self.world.tensors.append((f"{self.role}.{method}", {**inputs, **tensors}))
        value: Any = None
        if method == "compute_values":
            value = _values(inputs)
        elif method == "compute_logprobs":
            value = torch.zeros(inputs["loss_mask"].shape)
        elif method == "train_chunk":
            assert rows is not None
            if self.world.actor_error is not None:
                raise self.world.actor_error
            value = []
            for rank, share in enumerate(rows.split(self.dp_size)):
                mask = inputs["loss_mask"][share]
                self.trained[rank] = self.trained.get(rank, 0.0) + mask.shape[0]
                if kwargs["keep"]:
                    self.kept[rank] = self.kept.get(rank, 0.0) + mask.shape[0]
                value.append(
                    {
                        "actor/valid_tokens": float(mask.sum()),
                        "loss/pg": self.world.actor_loss,
                        # per-rank means over the rank's tokens, as the trainer's
                        "actor/clipfrac": 0.0,
                        "actor/approx_kl": 0.0,
                        # the engine/trainer KL over the rank's valid tokens: 1/4 each
                        "rollout/kl_engine_trainer_sum": 0.25 * float(mask.sum()),
                    }
                )
        elif method == "finish_step":
            value = {"actor/grad_norm": 0.0, "actor/updates": 1.0}  # the step's updates
        elif method == "train_epochs":
            for rank, kept in self.kept.items():
                self.trained[rank] += kwargs["epochs"] * kept
            self.kept = {}
            value = {"actor/grad_norm": 0.0, "actor/updates": 1.0 + kwargs["epochs"]}
        elif method == "counters":
            value = [
                {"policy_forward_backward": self.trained.get(rank, 0.0)}
                for rank in range(self.dp_size)
            ]
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
            value = [{"loss/value": float(rank)} for rank in range(self.dp_size)]
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
        self.claims: list[dict[str, torch.Tensor]] = []  # each chunk's batch, as claimed

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
        self.claims.append(build_batch(self.buffer.claim(sorted(group_ids)), pad_id=PAD))
        return self.claims[-1]

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
        # one policy epoch: the actor ranks keep no chunk (nothing to train them again)
        kept = [dict(c.args)["keep"] for c in world.log if c.what == "train_chunk"]
        assert kept and not any(kept)
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


def _lengths(step: int) -> dict[int, list[int]]:
    """The response length of each sample of each group of ``step`` (``_Rollout._group``:
    sample ``j`` of group ``g`` has ``1 + (g + j) % 5`` tokens, reward ``j % 2``)."""
    return {g: [1 + (g + j) % 5 for j in range(2)] for g in range(8 * step, 8 * step + 8)}


def test_step_metrics_are_each_steps_own_numbers() -> None:
    """Two streamed steps, three policy epochs, two data-parallel actor ranks: each step's
    metrics come from that step's batch and calls. The rewards' mean and max, the mean
    response length, each group's longest response (in group order); one entry per chunk
    of the actor's chunk sums, the last chunk's included, each summed over the ranks
    (``chunk/valid_tokens``: the chunk's valid tokens; ``chunk/pg``: its share of the
    loss), and none of its per-rank means (epoch 1's clip fraction and approx KL, 0 by
    construction); the engine/trainer KL per valid
    token of the whole step (the fake reports 1/4 for every token); the update's numbers
    from the last update call (``train_epochs``: 3 updates); the wake-ups of this step
    only. Every number is a small dyadic rational or an integer, exact in float32 and
    float64 sums of these few terms, so they are compared exactly."""
    world, _ = _world(*STREAMING, "ppo.ppo_epochs=3")
    pump = world.pump
    assert pump is not None
    pump.pair.actor.dp_size = 2  # type: ignore[misc]
    world.actor_loss = 0.25  # each rank's share of each chunk's loss
    resident = "critic"  # at start-up
    for step in range(2):
        begin, first_tensor = len(world.log), len(world.tensors)
        m = pump.run_step().metrics
        lengths = _lengths(step)
        assert (m["rollout/reward_mean"], m["rollout/reward_max"]) == (0.5, 1.0)
        assert m["rollout/response_len_mean"] == sum(map(sum, lengths.values())) / 16
        assert m["rollout/group_len_max"] == [max(n) for n in lengths.values()]
        chunks = [t for label, t in world.tensors[first_tensor:] if label == "actor.train_chunk"]
        assert m["train/chunks"] == len(chunks) > 1
        assert m["chunk/valid_tokens"] == [float(t["loss_mask"].sum()) for t in chunks]
        assert sum(m["chunk/valid_tokens"]) == sum(map(sum, lengths.values()))
        assert m["chunk/pg"] == [0.5] * len(chunks)
        assert sorted(k for k in m if k.startswith("chunk/")) == ["chunk/pg", "chunk/valid_tokens"]
        assert m["rollout/kl_engine_trainer"] == 0.25
        assert m["actor/updates"] == 3.0
        # epoch 1's forward + backward and epochs 2 and 3, summed over the two ranks
        assert m["train/actor_forwards_per_sample"] == 3.0
        switches = 0  # a model waking after the other one was resident
        for c in world.log[begin:]:
            woke = c.what == "wake_up" or (c.who in ("actor", "critic") and c.wake_first)
            if woke and c.who != resident:
                switches, resident = switches + 1, c.who
        assert m["train/switches"] == switches > 0


@pytest.mark.parametrize("mode", [STREAMING, FULL_BATCH], ids=["streaming", "full_batch"])
def test_token_mean_loss_is_divided_by_the_steps_valid_tokens(mode: list[str]) -> None:
    """``loss_agg=token``, three policy epochs. Streaming, the step's valid-token count
    is known only after the last chunk: every chunk gets the same provisional count
    (samples per step x ``max_new_tokens``) and the update (``finish_step``) the true
    one, the sum of all the chunks' valid tokens. Full batch, the one chunk is the step:
    its own count from the start, and no count for the update. Epochs 2 and 3
    (``train_epochs``) get the true count in both."""
    world, _ = _world(*mode, "ppo.loss_agg=token", "ppo.ppo_epochs=3")
    pump = world.pump
    assert pump is not None
    provisional = 16.0 * world.cfg.rollout.max_new_tokens
    for step in range(2):
        begin = len(world.log)
        pump.run_step()
        tokens = float(sum(map(sum, _lengths(step).values())))
        assert tokens != provisional
        actor = [c for c in world.log[begin:] if c.who == "actor"]
        chunks = [dict(c.args)["loss_denominator"] for c in actor if c.what == "train_chunk"]
        (finish,) = [dict(c.args) for c in actor if c.what == "finish_step"]
        (epochs,) = [dict(c.args) for c in actor if c.what == "train_epochs"]
        if mode is STREAMING:
            assert len(chunks) > 1 and chunks == [provisional] * len(chunks)
            assert finish == {"loss_denominator": tokens}
        else:
            assert chunks == [tokens]
            assert finish == {}  # None: the chunks' count was the true one
        assert epochs == {"epochs": 2, "loss_denominator": tokens}


def _gae_written_out(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE per sample over its valid positions, in float64 (``ppo_trainer.gae``'s
    definition: ``delta = r + gamma * V_next - V``, ``A = delta + gamma * lam * A_next``)."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        next_value = next_adv = 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[b, t]]):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            next_adv = delta + gamma * lam * next_adv
            next_value = float(values[b, t])
            out[b, t] = next_adv
    return out


@pytest.mark.parametrize("normalization", ["previous_step", "chunk"])
def test_the_actor_gets_gae_advantages_normalised_as_configured(normalization: str) -> None:
    """Each chunk's advantages are the GAE (discount 0.9, lambda 0.5: with values that are
    not 0 they enter differently) of the chunk's rewards and the critic's values for it,
    as written out here in float64, within the float32 rounding of the recursion.
    ``previous_step``: step 0 (no statistics yet) goes unwhitened, and its valid raw
    advantages' statistics are the pump's ``adv_stats`` after it; step 1 is whitened with
    them (``whiten_with``: the same float32 GAE, compared bit for bit); statistics of a
    single token leave step 2 unwhitened. ``chunk``: each chunk whitened with its own
    statistics (``masked_whiten``)."""
    world, rollout = _world(
        *STREAMING,
        "ppo.adv_estimator.normalize_advantages=true",
        f"ppo.adv_estimator.normalization={normalization}",
        "ppo.adv_estimator.gamma=0.9",
        "ppo.adv_estimator.lam=0.5",
    )
    pump = world.pump
    assert pump is not None
    stats: Moments | None = None  # step 0's, once it ran
    for step in range(3):
        if step == 2:
            pump.adv_stats = Moments(n=1.0, mean=0.5, var=0.0)
        first_claim, first_tensor = len(rollout.claims), len(world.tensors)
        pump.run_step()
        trained = [t for label, t in world.tensors[first_tensor:] if label == "actor.train_chunk"]
        claims = rollout.claims[first_claim:]
        assert len(trained) == len(claims) > 1
        raw = []
        for got, claim in zip(trained, claims, strict=True):
            assert torch.equal(got["input_ids"], claim["input_ids"])
            mask, rewards, values = claim["loss_mask"], claim["rewards"], _values(claim)
            advantages, _ = gae(rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.5)
            raw.append(advantages)
            if step == 0:  # the float32 recursion: 4 rounded operations per position
                written = _gae_written_out(rewards, values, mask, 0.9, 0.5)
                width = mask.shape[1]
                bound = rounding_bound(terms=4 * width, magnitude=3.0 * width)
                assert (advantages.double() - written).abs().max() <= bound
            if normalization == "chunk":
                expected = masked_whiten(values=advantages, mask=mask)
            elif step == 1:
                assert stats is not None
                expected = whiten_with(values=advantages, mask=mask, stats=stats)
            else:
                expected = advantages
            assert torch.equal(got["advantages"], expected), (step, normalization)
        if step == 0:
            stats = masked_moments(
                values=torch.cat(
                    [a[c["loss_mask"].bool()] for a, c in zip(raw, claims, strict=True)]
                )[None],
                mask=torch.ones(1, sum(int(c["loss_mask"].sum()) for c in claims)),
            )
            assert stats.n == sum(map(sum, _lengths(0).values())) and stats.var > 0
            assert pump.adv_stats == stats


def test_critic_trains_on_the_step_batch_in_global_mini_batch_order() -> None:
    """Critic training, two data-parallel critic ranks: the step batch's rows, returns and
    old values, all three permuted alike by ``mini_batch_order`` (so each rank's k-th local
    mini-batch is its share of the k-th global one), ``critic_ppo_epochs`` epochs, and each
    rank's share of ``critic_mini_batch_size`` as its mini-batch."""
    world, _ = _world(*FULL_BATCH, "ppo.critic_ppo_epochs=3")
    pump = world.pump
    assert pump is not None
    pump.pair.critic.dp_size = 2  # type: ignore[misc]
    batch = _step_batch([p for p in range(8) for _ in range(2)])
    batch.returns = torch.arange(16.0)[:, None].expand(16, 4) + torch.arange(4.0) / 8
    batch.old_values = -batch.returns
    pump.in_update = True  # as inside a step
    out = pump._critic_train(_StepState(0, policy=False), batch, colocated=False)
    assert out == {"loss/value": 0.5}  # the mean over the ranks (which report 0 and 1)
    (got,) = [t for label, t in world.tensors if label == "critic.train"]
    order = mini_batch_order(16, 2, 4)
    assert order.tolist() != list(range(16))  # two ranks: not the batch's own order
    for key, expected in {**batch.model_inputs(), "returns": batch.returns}.items():
        assert torch.equal(got[key], expected[order]), key
    assert torch.equal(got["old_values"], batch.old_values[order])
    (call,) = [c for c in world.log if (c.who, c.what) == ("critic", "train")]
    assert dict(call.args) == {"epochs": 3, "mini_batch_size": 4}


class _WorkerRefusal(FloatingPointError):
    """What Ray raises for a worker's ``FloatingPointError``: the worker's own error as
    ``cause``, its message in a traceback of the remote call."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray task failed\n{cause}")
        self.cause = cause


def test_a_non_finite_step_is_refused_naming_the_step_once() -> None:
    """A non-finite number in the step's metrics (the actor's loss) is refused as
    ``NonFiniteError`` naming the step once; a worker's refusal of a non-finite loss
    (raised in the rank) becomes one naming the step and the worker's message, without
    Ray's wrapping."""
    world, _ = _world(*STREAMING)
    pump = world.pump
    assert pump is not None
    world.actor_loss = float("nan")
    with pytest.raises(NonFiniteError, match=r"^step 0: non-finite metric\(s\): ") as info:
        pump.run_step()
    assert "step 0: step" not in str(info.value) and info.value.step == 0
    world, _ = _world(*STREAMING)
    pump = world.pump
    assert pump is not None
    world.actor_error = _WorkerRefusal(FloatingPointError("actor rank 0: loss is nan"))
    with pytest.raises(NonFiniteError) as info:
        pump.run_step()
    assert str(info.value) == "step 0: actor rank 0: loss is nan" and info.value.step == 0


def test_a_chunk_whose_groups_are_not_in_the_order_taken_is_refused() -> None:
    """A chunk of several fixed blocks is cut into the blocks' rows by position, which
    holds only if the claimed rows list the groups in the order the gate took them; a
    chunk in another order is refused, naming both orders."""
    world, _ = _world(*STREAMING)
    pump = world.pump
    assert pump is not None
    pump.gate.blocks = [1, 1]  # two blocks of one group (2 samples each)
    chunk = chunk_batch([1, 1, 0, 0], 2)
    assert pump._block_rows([1, 0], chunk) == [2, 2]
    with pytest.raises(
        AssertionError, match=r"groups \[1, 0\] are not in the order taken \[0, 1\]"
    ):
        pump._block_rows([0, 1], chunk)


@pytest.mark.parametrize("mode", [STREAMING, COLOCATED], ids=["streaming", "colocated"])
def test_critic_warm_up_trains_the_critic_alone_and_leaves_the_engines_weights(
    mode: list[str],
) -> None:
    """``critic_warmup_steps=1``: step 0 trains the critic only: no actor call and no
    refit (the engines keep weight version 0); streaming, the critic stays resident
    through the whole step (no switch). Step 1 trains the policy and refits it once."""
    world, rollout = _world(*mode, "ppo.critic_warmup_steps=1")
    pump = world.pump
    assert pump is not None
    for step in range(2):
        begin = len(world.log)
        metrics = pump.run_step().metrics
        calls = world.log[begin:]
        actor = [c.what for c in calls if c.who == "actor" and c.what != "counters"]
        refits = [c for c in calls if (c.who, c.what) == ("generation", "refit")]
        assert rollout.engines.version == metrics["weight_version"] == len(refits) == step
        if step == 0:
            assert actor == []
            if mode is STREAMING:
                assert metrics["train/switches"] == 0
                assert not [c for c in calls if c.what == "sleep"]
        else:
            assert "train_chunk" in actor and "finish_step" in actor
