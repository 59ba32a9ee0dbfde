"""The per-chunk protocol the driver calls (torch backend; the mechanism is the workers'):
lifecycle options around a call and its timeline, forward counters, the mesh.

Streaming without old log-probs (bit-identical gradients, counters) runs once per backend
in ``test_trainer_contract.py::test_streaming_chunk_is_its_own_old_policy``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools

import pytest
import torch
from ppo_lifecycle import (
    ALL_PARTS,
    BACKWARD_PARTS,
    FORWARD_PARTS,
    KEEP_GRADIENTS,
    Action,
    Part,
    Role,
    Transition,
)
from ppo_trainer import ActorWorker, CriticWorker, Mesh, Timeline, loss_denominator
from ppo_trainer._workers import lifecycle_options
from trainer_testlib import actor_config, critic_config, make_data


def labels(timeline: Timeline) -> list[str]:
    """The labels, after checking the entries are ordered, non-overlapping intervals."""
    for label, t0, t1 in timeline:
        assert t0 <= t1, label
    for (_, _, end), (label, start, _) in itertools.pairwise(timeline):
        assert end <= start, label
    return [label for label, _, _ in timeline]


def test_actor_lifecycle_options_and_timeline() -> None:
    data = make_data(4)
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    actor = ActorWorker(actor_config("torch"))
    assert actor.last_timeline() == []
    # the worded labels are the plan's own (ppo_lifecycle.Transition)
    assert str(Transition(Role.ACTOR, Action.WAKE_UP)) == "actor.wake_up"
    assert str(Transition(Role.ACTOR, Action.SLEEP, KEEP_GRADIENTS)) == "actor.sleep(keep_grads)"

    actor.compute_logprobs(data.batch)
    assert labels(actor.last_timeline()) == ["compute_logprobs"]
    actor.sleep()
    actor.sleep()  # no lifecycle options: the timeline stays the last call's
    assert labels(actor.last_timeline()) == ["compute_logprobs"]

    metrics = actor.train_chunk(
        data.batch,
        advantages=data.advantages,
        loss_denominator=den,
        wake_first=True,
        sleep_after=KEEP_GRADIENTS,
    )
    assert metrics["actor/valid_tokens"] == den
    assert actor.asleep_parts == KEEP_GRADIENTS
    assert labels(actor.last_timeline()) == [
        "actor.wake_up",
        "train_chunk",
        "actor.sleep(keep_grads)",
    ]

    # invalid options are refused before any work (no forward, nothing moved)
    with pytest.raises(ValueError, match="parts='disk' is invalid"):
        actor.compute_logprobs(data.batch, wake_first=True, sleep_after=["disk"])  # type: ignore[list-item]
    assert actor.asleep_parts == KEEP_GRADIENTS
    assert actor.counters()["policy_forward"] == 4
    assert actor.last_timeline() == []

    # work that raises: no sleep after it; the timeline keeps what completed
    with pytest.raises(ValueError, match="differs"):
        actor.train_chunk(
            data.batch,
            advantages=data.advantages,
            loss_denominator=den + 1,
            wake_first=True,
            sleep_after=ALL_PARTS,
        )
    assert not actor.is_asleep
    assert labels(actor.last_timeline()) == ["actor.wake_up"]

    actor.finish_step(wake_first=True, sleep_after=ALL_PARTS)  # wake_up is idempotent
    assert actor.asleep_parts == ALL_PARTS
    assert labels(actor.last_timeline()) == ["actor.wake_up", "finish_step", "actor.sleep(all)"]
    weights = actor.export_weights(wake_first=True)
    assert weights is not None and "lm_head.weight" in weights  # rank 0 of one
    assert labels(actor.last_timeline()) == ["actor.wake_up", "export_weights"]
    assert actor.counters() == {
        "policy_forward": 4,
        "policy_forward_backward": 4,
        "reference_forward": 0,
    }
    # the options are part of each method's signature (Ray and the driver see them)
    for method in ("compute_logprobs", "train_chunk", "finish_step", "export_weights"):
        params = inspect.signature(getattr(ActorWorker, method)).parameters
        assert params["wake_first"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["sleep_after"].default is None


def test_critic_lifecycle_options_and_counters() -> None:
    data = make_data(6)
    critic = CriticWorker(critic_config("torch"))
    critic.sleep()
    values = critic.compute_values(data.batch, wake_first=True, sleep_after=ALL_PARTS)
    assert critic.is_asleep
    assert labels(critic.last_timeline()) == [
        "critic.wake_up",
        "compute_values",
        "critic.sleep(all)",
    ]
    critic.train(
        data.batch,
        returns=data.returns,
        old_values=values,
        epochs=2,
        mini_batch_size=4,
        wake_first=True,
    )
    assert not critic.is_asleep
    assert labels(critic.last_timeline()) == ["critic.wake_up", "train"]
    assert critic.counters() == {"value_forward": 6, "value_forward_backward": 12}


def test_partial_wake_up_brings_back_what_the_work_needs() -> None:
    """A forward needs parameters and buffers only: the optimizer state (and gradients)
    stay asleep until work that needs them, which is refused until they are back."""
    data = make_data(4)
    critic = CriticWorker(critic_config("torch"))
    resident = critic.compute_values(data.batch)
    events: list[str] = []
    backend = critic._backend
    backend.release_process_groups = lambda: events.append("release")  # type: ignore[method-assign]
    backend.restore_process_groups = lambda: events.append("restore")  # type: ignore[method-assign]
    critic.sleep()
    values = critic.compute_values(data.batch, wake_first=FORWARD_PARTS, sleep_after=ALL_PARTS)
    torch.testing.assert_close(values, resident, rtol=0, atol=0)
    assert labels(critic.last_timeline()) == [
        "critic.wake_up(parameters+buffers)",
        "compute_values",
        "critic.sleep(all)",
    ]
    critic.wake_up(parts=FORWARD_PARTS)
    assert critic.asleep_parts == {Part.OPTIMIZER, Part.GRADIENTS}
    torch.testing.assert_close(critic.compute_values(data.batch), resident, rtol=0, atol=0)
    train = functools.partial(
        critic.train, data.batch, returns=data.returns, old_values=values, epochs=1
    )
    with pytest.raises(
        RuntimeError, match=r"train\(\) called while asleep \(\['gradients', 'optimizer'\]"
    ):
        train(mini_batch_size=4)
    train(mini_batch_size=4, wake_first=True)
    assert labels(critic.last_timeline()) == ["critic.wake_up", "train"]
    assert not critic.is_asleep
    # groups released by each sleep after a wake-up, restored by every wake-up
    assert events == ["release", "restore", "release", "restore", "restore"]

    actor = ActorWorker(actor_config("torch", kl_loss_coef=0.1))
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    ref = actor.compute_ref_logprobs(data.batch)
    actor.sleep()
    actor.wake_up(parts=FORWARD_PARTS)  # the reference model comes back whole
    torch.testing.assert_close(actor.compute_ref_logprobs(data.batch), ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"\['gradients'\] asleep"):
        actor.train_chunk(data.batch, advantages=data.advantages, loss_denominator=den)
    actor.sleep()
    actor.train_chunk(
        data.batch,
        advantages=data.advantages,
        loss_denominator=den,
        wake_first=BACKWARD_PARTS,
        sleep_after=KEEP_GRADIENTS,
    )
    assert labels(actor.last_timeline())[0] == "actor.wake_up(parameters+buffers+gradients)"
    actor.wake_up(parts=FORWARD_PARTS)
    with pytest.raises(RuntimeError, match=r"\['optimizer'\] asleep"):
        actor.finish_step()
    actor.finish_step(wake_first={Part.OPTIMIZER})
    assert labels(actor.last_timeline()) == ["actor.wake_up(optimizer)", "finish_step"]
    assert not actor.is_asleep


def test_lifecycle_options_must_be_declared() -> None:
    def work(self: ActorWorker, batch: object) -> None:
        del self, batch

    with pytest.raises(TypeError, match="keyword-only 'wake_first'"):
        lifecycle_options(work)


def test_mesh() -> None:
    mesh = Mesh(3, 8, 1, 2, 2, 2, tp_rank=1, pp_rank=0)
    assert (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank) == (1, 1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.rank = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="world_size=8"):
        Mesh(0, 8, 0, 2, 2, 1, tp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="tp_rank=2 is out of range"):
        Mesh(0, 4, 0, 2, 2, 1, tp_rank=2, pp_rank=0)
    actor = ActorWorker(actor_config("torch"))
    # the torch backend is data parallel only
    assert actor.mesh() == Mesh(0, 1, 0, 1, 1, 1, tp_rank=0, pp_rank=0)
