"""The worker contract, run once per registered backend (the ``backend`` fixture).

Streaming equivalence (any chunking, one or two data-parallel ranks), gradients kept
through a keep-gradients sleep, frozen critic targets, HF and checkpoint round trips,
masked chunks and steps, lifecycle idempotence.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from ppo_trainer import (
    KEEP_GRADIENTS,
    ActorWorker,
    CriticWorker,
    EmptyStepError,
    ModelSpec,
    Part,
    loss_denominator,
    masked_whiten,
    save_hf_checkpoint,
)
from safetensors.torch import load_file, save_file
from trainer_testlib import PPOData, actor_config, critic_config, make_data, with_model_inputs

# float32 tiny models: a chunked and a full-batch forward differ by rounding only.
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _with_key(key: str, message: str) -> str:
    return f"{key}: {message}"


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: Any) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=partial(_with_key, k), **tol)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def prepared(backend: str, *, b: int = 6, seed: int = 0, **actor_kw: Any) -> PPOData:
    """Data whose old log-probs / values come from the initial models."""
    data = make_data(b, seed=seed)
    actor = ActorWorker(actor_config(backend, **actor_kw))
    critic = CriticWorker(critic_config(backend))
    return with_model_inputs(
        data, actor.compute_logprobs(data.batch), critic.compute_values(data.batch)
    )


def run_actor(
    worker: ActorWorker, data: PPOData, chunks: list[list[int]], *, loss_agg: str
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Backward per chunk, then one finish_step; returns (grads before the step, metrics)."""
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg=loss_agg)
    ref = worker.compute_ref_logprobs(data.batch) if worker.config.use_reference else None
    for rows in chunks:
        part = data.rows(rows)
        worker.backward(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            ref_logprobs=None if ref is None else ref[rows],
            loss_denominator=den,
        )
    grads = worker.grads()
    return grads, worker.finish_step()


def split(sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param([1, 5], id="1+5"),
        pytest.param([2, 2, 2], id="2+2+2"),
        pytest.param([4, 1, 1], id="4+1+1"),
        pytest.param([1, 1, 1, 1, 1, 1], id="6x1"),
    ],
)
@pytest.mark.parametrize("loss_agg", ["token", "sample"])
def test_streaming_equivalence(backend: str, sizes: list[int], loss_agg: str) -> None:
    kw: dict[str, Any] = {"loss_agg": loss_agg, "kl_loss_coef": 0.05, "entropy_coef": 0.01}
    data = prepared(backend, **kw)
    full, chunked = (
        ActorWorker(actor_config(backend, **kw)),
        ActorWorker(actor_config(backend, **kw)),
    )
    g_full, m_full = run_actor(full, data, [list(range(6))], loss_agg=loss_agg)
    g_chunk, m_chunk = run_actor(chunked, data, split(sizes), loss_agg=loss_agg)
    assert max(float(g.abs().max()) for g in g_full.values()) > 1e-3  # a real gradient
    assert 0 < m_full["actor/clipfrac"] < 1  # the clipped branch is exercised
    assert_states_close(g_chunk, g_full, **GRAD_TOL)
    assert_states_close(chunked.export_weights(), full.export_weights(), **PARAM_TOL)
    for key in ("loss/pg", "loss/kl", "loss/entropy", "actor/grad_norm", "actor/clipfrac"):
        assert m_chunk[key] == pytest.approx(m_full[key], rel=1e-4, abs=1e-6), key
    assert m_full["actor/valid_tokens"] == data.batch["loss_mask"].sum().item()


def test_token_denominator_known_only_at_finish(backend: str) -> None:
    """Streaming with loss_agg=token: chunks use a provisional denominator, finish_step
    gets the true one and rescales; same gradients and parameters as the full batch."""
    data = prepared(backend)
    full = ActorWorker(actor_config(backend))
    g_full, m_full = run_actor(full, data, [list(range(6))], loss_agg="token")
    late = ActorWorker(actor_config(backend))
    for rows in split([4, 2]):
        part = data.rows(rows)
        late.backward(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=1.0,  # provisional
        )
    true_den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    m_late = late.finish_step(loss_denominator=true_den)
    assert m_late["loss/pg"] == pytest.approx(m_full["loss/pg"], rel=1e-4)
    assert m_late["actor/grad_norm"] == pytest.approx(m_full["actor/grad_norm"], rel=1e-4)
    assert_states_close(late.export_weights(), full.export_weights(), **PARAM_TOL)
    assert max(float(g.abs().max()) for g in g_full.values()) > 1e-3


def test_sample_denominator_counts_all_or_valid_samples(backend: str) -> None:
    data = prepared(backend)
    data.batch["loss_mask"][1] = 0.0  # one sample without a valid token
    rows = float(data.batch["loss_mask"].shape[0])
    valid = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="sample")
    assert valid == rows - 1
    for den in (rows, valid):
        worker = ActorWorker(actor_config(backend, loss_agg="sample"))
        for chunk in split([3, 3]):
            part = data.rows(chunk)
            worker.backward(
                part.batch,
                old_logprobs=part.old_logprobs,
                advantages=part.advantages,
                loss_denominator=den,
            )
        worker.finish_step()
    bad = ActorWorker(actor_config(backend, loss_agg="sample"))
    bad.backward(
        data.batch,
        old_logprobs=data.old_logprobs,
        advantages=data.advantages,
        loss_denominator=rows + 1,
    )
    with pytest.raises(ValueError, match="sample count"):
        bad.finish_step()


def test_per_chunk_normalisation_is_the_only_difference(backend: str) -> None:
    data = prepared(backend)
    chunks = split([2, 4])
    mask = data.batch["loss_mask"]
    per_chunk = torch.cat(
        [masked_whiten(values=data.advantages[rows], mask=mask[rows]) for rows in chunks]
    )
    whole = masked_whiten(values=data.advantages, mask=mask)

    def with_adv(adv: torch.Tensor) -> PPOData:
        return PPOData(data.batch, data.old_logprobs, adv, data.returns, data.old_values)

    streamed = ActorWorker(actor_config(backend))
    g_stream, _ = run_actor(streamed, with_adv(per_chunk), chunks, loss_agg="token")
    same_adv = ActorWorker(actor_config(backend))
    g_same, _ = run_actor(same_adv, with_adv(per_chunk), [list(range(6))], loss_agg="token")
    full_norm = ActorWorker(actor_config(backend))
    g_norm, _ = run_actor(full_norm, with_adv(whole), [list(range(6))], loss_agg="token")
    # Streaming with per-chunk normalisation == full batch fed the per-chunk advantages ...
    assert_states_close(g_stream, g_same, **GRAD_TOL)
    assert_states_close(streamed.export_weights(), same_adv.export_weights(), **PARAM_TOL)
    # ... and differs from full-batch normalisation by the normalisation alone.
    assert not torch.allclose(per_chunk, whole, atol=1e-3)
    assert max_diff(g_stream, g_norm) > 1e-3


def test_masked_chunk_adds_no_gradient(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    den = loss_denominator(loss_mask=data.batch["loss_mask"][:3], loss_agg="token")
    first = data.rows([0, 1, 2])
    actor.backward(
        first.batch,
        old_logprobs=first.old_logprobs,
        advantages=first.advantages,
        loss_denominator=den,
    )
    before = actor.grads()
    masked = data.rows([3, 4, 5])
    masked.batch["loss_mask"] = torch.zeros_like(masked.batch["loss_mask"])
    out = actor.backward(
        masked.batch,
        old_logprobs=masked.old_logprobs,
        advantages=masked.advantages,
        loss_denominator=den,
    )
    assert out["actor/valid_tokens"] == 0
    assert_states_close(actor.grads(), before, rtol=0, atol=0)
    actor.finish_step()


def test_all_masked_step_raises_before_any_update(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    weights = actor.export_weights()
    masked = data.rows([0, 1])
    masked.batch["loss_mask"] = torch.zeros_like(masked.batch["loss_mask"])
    actor.backward(
        masked.batch,
        old_logprobs=masked.old_logprobs,
        advantages=masked.advantages,
        loss_denominator=1.0,
    )
    with pytest.raises(EmptyStepError, match="masked"):
        actor.finish_step()
    assert_states_close(actor.export_weights(), weights, rtol=0, atol=0)
    assert actor.global_step == 0
    # the worker is usable afterwards
    run_actor(actor, data, [list(range(6))], loss_agg="token")
    assert actor.global_step == 1
    assert max_diff(actor.export_weights(), weights) > 0


def test_wrong_denominator_is_rejected_before_update(backend: str) -> None:
    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    weights = actor.export_weights()
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    part = data.rows([0, 1])
    actor.backward(
        part.batch,
        old_logprobs=part.old_logprobs,
        advantages=part.advantages,
        loss_denominator=den,
    )
    with pytest.raises(ValueError, match="differs"):
        actor.backward(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=den + 1,
        )
    with pytest.raises(ValueError, match="does not match"):
        actor.finish_step()  # only 2 of 6 samples were sent
    assert_states_close(actor.export_weights(), weights, rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss_denominator=0"):
        actor.backward(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=0,
        )


# --------------------------------------------------------------------------- lifecycle


def test_gradients_survive_keep_gradients_sleep(backend: str) -> None:
    data = prepared(backend)
    chunks = split([3, 3])
    plain = ActorWorker(actor_config(backend))
    g_plain, _ = run_actor(plain, data, chunks, loss_agg="token")

    actor = ActorWorker(actor_config(backend))
    critic = CriticWorker(critic_config(backend))
    den = loss_denominator(loss_mask=data.batch["loss_mask"], loss_agg="token")
    critic.sleep()
    first, second = data.rows(chunks[0]), data.rows(chunks[1])
    actor.backward(
        first.batch,
        old_logprobs=first.old_logprobs,
        advantages=first.advantages,
        loss_denominator=den,
    )
    held = actor.grads()
    actor.sleep(parts=KEEP_GRADIENTS)
    assert actor.is_asleep and actor.asleep_parts == KEEP_GRADIENTS
    assert_states_close(actor.grads(), held, rtol=0, atol=0)  # still resident
    critic.wake_up()
    values = critic.compute_values(second.batch)  # the critic works in between
    assert values.shape == second.batch["input_ids"].shape
    critic.sleep()
    actor.wake_up()
    assert not actor.is_asleep
    assert_states_close(actor.grads(), held, rtol=0, atol=0)
    actor.backward(
        second.batch,
        old_logprobs=second.old_logprobs,
        advantages=second.advantages,
        loss_denominator=den,
    )
    assert_states_close(actor.grads(), g_plain, **GRAD_TOL)
    actor.finish_step()
    assert_states_close(actor.export_weights(), plain.export_weights(), **PARAM_TOL)


def test_sleep_wake_idempotent_and_guarded(backend: str) -> None:
    data = make_data(4)
    actor = ActorWorker(actor_config(backend, kl_loss_coef=0.1))
    lp = actor.compute_logprobs(data.batch)
    ref = actor.compute_ref_logprobs(data.batch)
    torch.testing.assert_close(lp, ref, rtol=0, atol=0)  # reference == initial policy
    actor.sleep(parts=KEEP_GRADIENTS)
    actor.sleep(parts=KEEP_GRADIENTS)  # logged no-op
    actor.sleep()  # now the gradients too
    assert actor.asleep_parts == frozenset(Part)
    with pytest.raises(RuntimeError, match="asleep"):
        actor.compute_logprobs(data.batch)
    with pytest.raises(RuntimeError, match="asleep"):
        actor.finish_step()
    actor.wake_up()
    actor.wake_up()  # logged no-op
    torch.testing.assert_close(actor.compute_logprobs(data.batch), lp, rtol=0, atol=0)
    torch.testing.assert_close(actor.compute_ref_logprobs(data.batch), ref, rtol=0, atol=0)
    critic = CriticWorker(critic_config(backend))
    v = critic.compute_values(data.batch)
    critic.sleep()
    critic.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        critic.compute_values(data.batch)
    critic.wake_up()
    torch.testing.assert_close(critic.compute_values(data.batch), v, rtol=0, atol=0)


# --------------------------------------------------------------------------- critic


def test_critic_old_values_and_frozen_returns(backend: str) -> None:
    data = make_data(6, seed=3)
    critic = CriticWorker(critic_config(backend, value_clip=0.05))
    old = critic.compute_values(data.batch)
    assert bool((old[:, 0] == 0).all())
    again = CriticWorker(critic_config(backend, value_clip=0.05))
    torch.testing.assert_close(again.compute_values(data.batch), old, rtol=0, atol=0)
    # train(epochs=2) == two train(epochs=1) calls fed the SAME returns and old values:
    # the epochs never recompute targets from the updated critic.
    m = critic.train(data.batch, returns=data.returns, old_values=old, epochs=2, mini_batch_size=4)
    assert m["critic/optimizer_steps"] == 4
    assert m["critic/clipfrac"] > 0
    for _ in range(2):
        again.train(data.batch, returns=data.returns, old_values=old, epochs=1, mini_batch_size=4)
    assert_states_close(again.export_weights(), critic.export_weights(), **PARAM_TOL)
    new = critic.compute_values(data.batch)
    assert float((new - old).abs().max()) > 1e-4  # the update changed the values
    # refreshing old values from the updated critic would train differently (clipping)
    third = CriticWorker(critic_config(backend, value_clip=0.05))
    third.train(data.batch, returns=data.returns, old_values=old, epochs=1, mini_batch_size=4)
    third.train(
        data.batch,
        returns=data.returns,
        old_values=third.compute_values(data.batch),
        epochs=1,
        mini_batch_size=4,
    )
    assert max_diff(third.export_weights(), critic.export_weights()) > 1e-6


def test_critic_rejects_all_masked(backend: str) -> None:
    data = make_data(2)
    critic = CriticWorker(critic_config(backend))
    with pytest.raises(EmptyStepError):
        critic.train(
            {**data.batch, "loss_mask": torch.zeros_like(data.batch["loss_mask"])},
            returns=data.returns,
            old_values=data.old_values,
            epochs=1,
            mini_batch_size=2,
        )


# --------------------------------------------------------------------------- round trips


def test_hf_round_trip(backend: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    data = prepared(backend)
    actor = ActorWorker(actor_config(backend))
    run_actor(actor, data, [list(range(6))], loss_agg="token")
    weights = actor.export_weights()
    assert all(v.device.type == "cpu" for v in weights.values())
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    lp = actor.compute_logprobs(data.batch)
    hf_dir = save_hf_checkpoint(weights=weights, spec=actor.config.model, path=tmp_path / "hf")
    # transformers itself, on the exported weights, gives the same log-probs
    model = AutoModelForCausalLM.from_pretrained(hf_dir, use_safetensors=True)
    model.eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        logits = model(
            input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"]
        ).logits
    ids = data.batch["input_ids"]
    hf_lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(lp[:, 1:], hf_lp, rtol=1e-5, atol=1e-5)
    # and a worker loaded from the directory reproduces the worker's log-probs
    loaded = ActorWorker(actor_config(backend, model=ModelSpec(path=str(hf_dir))))
    torch.testing.assert_close(loaded.compute_logprobs(data.batch), lp, rtol=1e-6, atol=1e-6)
    assert_states_close(loaded.export_weights(), weights, rtol=0, atol=0)

    critic = CriticWorker(critic_config(backend))
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=1, mini_batch_size=6
    )
    cw = critic.export_weights()
    assert "score.weight" in cw
    c_dir = save_hf_checkpoint(
        weights=cw, spec=critic.config.model, path=tmp_path / "hfc", role="critic"
    )
    c_loaded = CriticWorker(critic_config(backend, model=ModelSpec(path=str(c_dir))))
    torch.testing.assert_close(
        c_loaded.compute_values(data.batch), critic.compute_values(data.batch), rtol=1e-6, atol=1e-6
    )


def test_checkpoint_round_trip(backend: str, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"warmup_steps": 2, "kl_loss_coef": 0.05}
    d1, d2 = prepared(backend, seed=1, **kw), prepared(backend, seed=2, **kw)
    actor = ActorWorker(actor_config(backend, **kw))
    critic = CriticWorker(critic_config(backend, warmup_steps=2))
    run_actor(actor, d1, [list(range(6))], loss_agg="token")
    critic.train(
        d1.batch, returns=d1.returns, old_values=d1.old_values, epochs=1, mini_batch_size=3
    )
    actor.save_checkpoint(tmp_path / "actor")
    critic.save_checkpoint(tmp_path / "critic")
    files = sorted(p.name for p in (tmp_path / "actor").rglob("*") if p.is_file())
    assert files == ["state.json", "state.safetensors"]  # no pickle anywhere
    _, m_a = run_actor(actor, d2, [list(range(6))], loss_agg="token")
    critic.train(
        d2.batch, returns=d2.returns, old_values=d2.old_values, epochs=1, mini_batch_size=3
    )

    actor2 = ActorWorker(actor_config(backend, **kw))
    critic2 = CriticWorker(critic_config(backend, warmup_steps=2))
    actor2.load_checkpoint(tmp_path / "actor")
    critic2.load_checkpoint(tmp_path / "critic")
    assert actor2.global_step == 1 and critic2.global_step == 2
    # Loaded state owns its memory: the first sleep after a resume can release it.
    for worker in (actor2, critic2):
        worker.sleep()
        worker.wake_up()
    _, m_b = run_actor(actor2, d2, [list(range(6))], loss_agg="token")
    critic2.train(
        d2.batch, returns=d2.returns, old_values=d2.old_values, epochs=1, mini_batch_size=3
    )
    assert m_a["actor/lr"] == m_b["actor/lr"] < actor.config.lr  # scheduler state restored
    assert_states_close(actor2.export_weights(), actor.export_weights(), rtol=0, atol=0)
    assert_states_close(critic2.export_weights(), critic.export_weights(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="not an actor"):
        actor2.load_checkpoint(tmp_path / "critic")


# --------------------------------------------------------------------------- two DP ranks

SHARDS = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}  # global mini-batch i = union of rank mini-batches i
CHUNKS = {0: [[0], [1, 2, 3]], 1: [[0, 1, 2], [3]]}  # positions within each rank's shard


def _dp_rank_main(rank: int, backend: str, init: str, data_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small CPU machine
    data = PPOData.from_tensors(load_file(data_file)).rows(SHARDS[rank])
    den = float(load_file(data_file)["batch.loss_mask"].sum())
    actor = ActorWorker(actor_config(backend), rank=rank, world_size=2, dist_init_method=init)
    for rows in CHUNKS[rank]:
        part = data.rows(rows)
        actor.backward(
            part.batch,
            old_logprobs=part.old_logprobs,
            advantages=part.advantages,
            loss_denominator=den,
        )
    actor.finish_step()
    critic = CriticWorker(critic_config(backend), rank=rank, world_size=2, dist_init_method=init)
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=2, mini_batch_size=2
    )
    save_file(actor.export_weights(), f"{out_dir}/actor{rank}.safetensors")
    save_file(critic.export_weights(), f"{out_dir}/critic{rank}.safetensors")


def test_two_data_parallel_ranks_match_single_process(backend: str, tmp_path: Path) -> None:
    data = prepared(backend, b=8)
    data_file = str(tmp_path / "data.safetensors")
    save_file({k: v.contiguous() for k, v in data.tensors().items()}, data_file)
    mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _dp_rank_main,
        args=(backend, f"file://{tmp_path / 'pg'}", data_file, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    actor = ActorWorker(actor_config(backend))
    run_actor(actor, data, [list(range(8))], loss_agg="token")
    critic = CriticWorker(critic_config(backend))
    critic.train(
        data.batch, returns=data.returns, old_values=data.old_values, epochs=2, mini_batch_size=4
    )
    for rank in (0, 1):
        assert_states_close(
            load_file(str(tmp_path / f"actor{rank}.safetensors")),
            actor.export_weights(),
            **PARAM_TOL,
        )
        assert_states_close(
            load_file(str(tmp_path / f"critic{rank}.safetensors")),
            critic.export_weights(),
            **PARAM_TOL,
        )
