"""Benchmark: one PPO step through the workers vs a minimal single-process PyTorch loop.

Run: ``uv run --frozen python bench/bench_trainer.py [--steps 6] [--batch 16] [--seq 32]``.

One step on the default tiny model (``ModelSpec()``: Qwen2, vocab 128, hidden 64, 2
layers), streaming over ``--chunks`` chunks: per chunk a critic value forward, GAE,
per-chunk advantage whitening and one actor ``train_chunk`` (loss over the whole step's
valid tokens; one policy epoch, so the old log-probs are that forward's own and no
separate log-prob forward runs, on both sides); then one actor optimizer step and
``--critic-epochs`` critic epochs in mini-batches of ``--mini-batch``. Both sides use the same transformers models,
the same ``ppo_trainer`` math functions, AdamW, grad clipping and micro-batch size; the
baseline is a plain loop with none of the worker machinery (shape checks, micro-batch
lists, metric bookkeeping, the backend indirection, checkpoints-ready state).

Reported: tokens (``B * T``) per second of the step, best of ``--steps`` (runs of the
two sides are interleaved so machine load hits both alike), and
``ratio = baseline tokens/s / worker tokens/s`` (target: at most 1.15). A third row runs
the workers with the driver's lifecycle carried by each call (``wake_first`` /
``sleep_after``: actor keep-gradients sleep, critic wake/sleep), for information only:
the baseline moves no memory to compare with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from ppo_lifecycle import ALL_PARTS, KEEP_GRADIENTS
from ppo_trainer import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ModelSpec,
    build_causal_lm,
    build_value_model,
    gae,
    logprobs_from_logits,
    loss_denominator,
    masked_whiten,
    policy_loss,
    value_loss,
)


def make_batch(b: int, t: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    rewards = torch.zeros(b, t)
    for i in range(b):
        prompt = int(torch.randint(4, 12, (1,), generator=g))
        resp = int(torch.randint(t // 3, t - prompt + 1, (1,), generator=g))
        attention[i, : prompt + resp] = 1
        loss_mask[i, prompt : prompt + resp] = 1.0
        rewards[i, prompt + resp - 1] = float(torch.rand(1, generator=g))
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rewards": rewards,
    }


def chunks_of(b: int, k: int) -> list[slice]:
    size = -(-b // k)
    return [slice(s, min(s + size, b)) for s in range(0, b, size)]


# --------------------------------------------------------------------------- workers


def worker_step(
    actor: ActorWorker,
    critic: CriticWorker,
    batch: dict[str, torch.Tensor],
    args: argparse.Namespace,
    *,
    lifecycle: bool,
) -> None:
    den = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
    # the driver's plan, carried by each call (one round trip per model per chunk)
    wake = lifecycle
    keep = KEEP_GRADIENTS if lifecycle else None
    off = ALL_PARTS if lifecycle else None
    returns, old_values = [], []
    for sl in chunks_of(args.batch, args.chunks):
        chunk = {k: v[sl] for k, v in batch.items()}
        values = critic.compute_values(chunk, wake_first=wake, sleep_after=off)
        adv, ret = gae(
            rewards=chunk["rewards"], values=values, mask=chunk["loss_mask"], gamma=1.0, lam=0.95
        )
        adv = masked_whiten(values=adv, mask=chunk["loss_mask"])
        actor.train_chunk(
            chunk, advantages=adv, loss_denominator=den, wake_first=wake, sleep_after=keep
        )
        returns.append(ret)
        old_values.append(values)
    actor.finish_step(wake_first=wake, sleep_after=off)
    critic.train(
        batch,
        returns=torch.cat(returns),
        old_values=torch.cat(old_values),
        epochs=args.critic_epochs,
        mini_batch_size=args.mini_batch,
        wake_first=wake,
        sleep_after=off,
    )
    if lifecycle:  # as the driver: actor back for refit and the next step
        actor.wake_up()


# --------------------------------------------------------------------------- baseline


class Baseline:
    """The same math as a plain loop over two transformers models and two AdamW."""

    def __init__(self, spec: ModelSpec, args: argparse.Namespace) -> None:
        self.args = args
        self.actor = build_causal_lm(spec)
        self.critic = build_value_model(spec)
        self.a_opt = torch.optim.AdamW(self.actor.parameters(), lr=1e-5)
        self.c_opt = torch.optim.AdamW(self.critic.parameters(), lr=1e-5)

    def logprobs(self, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        logits = self.actor(input_ids=ids, attention_mask=am).logits.float()
        lp = logprobs_from_logits(logits=logits[:, :-1], labels=ids[:, 1:])
        return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)

    def values(self, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        v = self.critic(input_ids=ids, attention_mask=am).logits.squeeze(-1).float()
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        a, mb = self.args, self.args.micro_batch
        den = float(batch["loss_mask"].sum())
        returns, old_values = [], []
        for sl in chunks_of(a.batch, a.chunks):
            ids, am = batch["input_ids"][sl], batch["attention_mask"][sl]
            mask, rew = batch["loss_mask"][sl], batch["rewards"][sl]
            with torch.no_grad():
                values = torch.cat(
                    [self.values(ids[i : i + mb], am[i : i + mb]) for i in range(0, len(ids), mb)]
                )
            adv, ret = gae(rewards=rew, values=values, mask=mask, gamma=1.0, lam=0.95)
            adv = masked_whiten(values=adv, mask=mask)
            for i in range(0, len(ids), mb):
                lp = self.logprobs(ids[i : i + mb], am[i : i + mb])
                loss = policy_loss(
                    logprobs=lp,
                    old_logprobs=lp.detach(),  # one policy epoch: this forward is the old policy
                    advantages=adv[i : i + mb],
                    mask=mask[i : i + mb],
                    eps_clip=0.2,
                    denominator=den,
                ).pg_loss
                torch.autograd.backward(loss)
            returns.append(ret)
            old_values.append(values)
        torch.nn.utils.clip_grad_norm_(self.actor.parameters(), 1.0)
        self.a_opt.step()
        self.a_opt.zero_grad(set_to_none=True)
        ret_all, old_all = torch.cat(returns), torch.cat(old_values)
        for _ in range(a.critic_epochs):
            for s in range(0, a.batch, a.mini_batch):
                e = s + a.mini_batch
                ids, am = batch["input_ids"][s:e], batch["attention_mask"][s:e]
                mask = batch["loss_mask"][s:e]
                mden = float(mask.sum())
                for i in range(0, len(ids), mb):
                    v = self.values(ids[i : i + mb], am[i : i + mb])
                    loss = value_loss(
                        values=v,
                        old_values=old_all[s:e][i : i + mb],
                        returns=ret_all[s:e][i : i + mb],
                        mask=mask[i : i + mb],
                        value_clip=0.2,
                        denominator=mden,
                    ).v_loss
                    torch.autograd.backward(loss)
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), 1.0)
                self.c_opt.step()
                self.c_opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--mini-batch", type=int, default=8)
    p.add_argument("--critic-epochs", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    spec = ModelSpec()
    common = {
        "model": spec,
        "device": "cpu",
        "micro_batch_size": args.micro_batch,
        "max_grad_norm": 1.0,
    }
    actor = ActorWorker(ActorConfig(**common, lr=1e-5))
    critic = CriticWorker(CriticConfig(**common, lr=1e-5, value_clip=0.2))
    base = Baseline(spec, args)
    batch = make_batch(args.batch, args.seq, spec.vocab_size, seed=0)
    tokens = args.batch * args.seq

    def timed(fn: object) -> float:
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        return time.perf_counter() - t0

    # warm-up (first-call allocations, lazy inits)
    worker_step(actor, critic, batch, args, lifecycle=False)
    base.step(batch)
    worker_step(actor, critic, batch, args, lifecycle=True)
    critic.wake_up()
    times: dict[str, list[float]] = {"baseline": [], "workers": [], "workers+lifecycle": []}
    runs = {
        "baseline": lambda: base.step(batch),
        "workers": lambda: worker_step(actor, critic, batch, args, lifecycle=False),
        "workers+lifecycle": lambda: worker_step(actor, critic, batch, args, lifecycle=True),
    }
    order = list(runs)
    for i in range(args.steps):
        for name in order[i % 3 :] + order[: i % 3]:  # rotate: no side always runs first
            critic.wake_up()  # untimed: the plain paths start with both models resident
            times[name].append(timed(runs[name]))

    print(
        f"one PPO step, tiny Qwen2 (vocab {spec.vocab_size}, hidden {spec.hidden_size}, "
        f"{spec.num_hidden_layers} layers), B={args.batch} T={args.seq}, {args.chunks} chunks, "
        f"{args.critic_epochs} critic epochs, torch threads={torch.get_num_threads()}, "
        f"load avg={os.getloadavg()[0]:.1f}"
    )
    print(f"{'path':<20}{'best s':>9}{'median s':>10}{'tokens/s':>11}")
    best = {k: min(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:<20}{best[k]:>9.3f}{statistics.median(v):>10.3f}{tokens / best[k]:>11.0f}")
    ratio = best["workers"] / best["baseline"]
    med_ratio = statistics.median(times["workers"]) / statistics.median(times["baseline"])
    print(
        f"ratio baseline_tokens_per_s / workers_tokens_per_s = {ratio:.3f} (best), "
        f"{med_ratio:.3f} (median); target <= 1.15 -> {'OK' if ratio <= 1.15 else 'MISSED'}"
    )
    print(
        f"lifecycle (keep-grads sleep/wake per chunk) costs "
        f"{best['workers+lifecycle'] / best['workers']:.3f}x the plain worker step"
    )


if __name__ == "__main__":
    main()
