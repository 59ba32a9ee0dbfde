"""A minimal single-process PPO loop on the built-in task, written the way cleanrl writes
its files: one file, top to bottom, no Ray, no switches, no streaming.

It is the baseline of ``bench/bench_learning.py``: same task (the ``repeat`` prompts and
reward of ``ppo_driver.rollout``), same models and initial weights (the trainer's
``build_causal_lm`` / ``build_value_model`` with the seeds the driver uses), same
hyper-parameters (``Args.from_driver_config``). The PPO math is written out here on
purpose (GAE, whitening, clipped losses), not imported, so that it is also an
independent check of the project's.

One iteration: generate ``prompts x samples`` responses with the current policy (KV
cache, one batch), score them, old values from the critic, old log-probs from the
policy, GAE -> advantages (whitened with the previous iteration's statistics, or over the
batch with ``normalization="chunk"``) and returns, ``ppo_epochs`` policy
updates on the whole batch, then ``critic_epochs`` passes of critic updates in
mini-batches of ``critic_mini_batch_size``.

    uv run --frozen python bench/minimal_ppo.py --steps 300 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
from ppo_driver.rollout import CharTokenizer, repeat_reward, synthetic_records
from ppo_trainer import ModelSpec, build_causal_lm, build_value_model

TASK_ALPHABET = "abcdefgh0123456789:"  # ppo_driver.run.TASK_ALPHABET


@dataclass
class Args:
    """Defaults: those of ``ppo-driver train`` (``Args.from_driver_config`` copies a config)."""

    seed: int = 0
    steps: int = 100
    prompts: int = 64  # prompt groups per step
    samples: int = 4  # samples per prompt
    max_new_tokens: int = 12
    max_count: int = 8  # the task's largest count
    temperature: float = 1.0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    lr: float = 5e-4
    critic_lr: float = 3e-3
    warmup_steps: int = 0
    critic_warmup_steps: int = 0  # lr warm-up of the critic's optimizer (steps = updates)
    max_grad_norm: float = 1.0
    ppo_epochs: int = 4
    critic_epochs: int = 2
    critic_mini_batch_size: int = 32
    eps_clip: float = 0.2
    value_clip: float | None = 0.2
    entropy_coef: float = 0.0
    loss_agg: str = "sample"  # "sample" or "token"
    normalize_advantages: bool = True
    normalization: str = "previous_step"  # or "chunk" (one batch: the batch's statistics)
    gamma: float = 1.0
    lam: float = 0.95
    threads: int = 1  # torch intra-op threads (the project's workers run with 1)
    log: bool = True

    @classmethod
    def from_driver_config(cls, cfg: Any, **extra: Any) -> Args:
        """The hyper-parameters of a ``ppo_driver.config.DriverConfig``."""
        p, pol, cri = cfg.ppo, cfg.policy, cfg.critic
        return cls(
            seed=cfg.run.seed,
            steps=cfg.run.num_steps,
            prompts=p.num_prompts_per_step,
            samples=p.num_generations_per_prompt,
            max_new_tokens=cfg.rollout.max_new_tokens,
            max_count=int(cfg.rollout.extra.get("max_count", 8)),
            temperature=cfg.rollout.temperature,
            hidden_size=pol.hidden_size,
            intermediate_size=pol.intermediate_size,
            num_hidden_layers=pol.num_hidden_layers,
            num_attention_heads=pol.num_attention_heads,
            num_key_value_heads=pol.num_key_value_heads,
            lr=pol.lr,
            critic_lr=cri.lr,
            warmup_steps=pol.warmup_steps,
            critic_warmup_steps=cri.warmup_steps,
            max_grad_norm=pol.max_grad_norm,
            ppo_epochs=p.ppo_epochs,
            critic_epochs=p.critic_ppo_epochs,
            critic_mini_batch_size=p.critic_mini_batch_size,
            eps_clip=p.eps_clip,
            value_clip=p.value_clip,
            entropy_coef=p.entropy_coef,
            loss_agg=p.loss_agg,
            normalize_advantages=p.adv_estimator.normalize_advantages,
            normalization=p.adv_estimator.normalization,
            gamma=p.adv_estimator.gamma,
            lam=p.adv_estimator.lam,
            **extra,
        )


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def reduce(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Per-token loss [B, T] -> scalar: token mean, or mean over samples of token means."""
    if how == "token":
        return masked_mean(per_token, mask)
    per_sample = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return per_sample.mean()


def warmup(steps: int) -> Any:
    return lambda i: (i + 1) / (steps + 1) if i < steps else 1.0


def run(args: Args, on_step: Any = None) -> list[dict[str, float]]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = CharTokenizer(TASK_ALPHABET)
    records = synthetic_records(num_prompts=4096, seed=args.seed, max_count=args.max_count)
    spec = dict(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
    )
    # the driver's seeds: policy run.seed, critic run.seed + 1 (its head adds 1 more)
    policy = build_causal_lm(ModelSpec(**spec, seed=args.seed))
    critic = build_value_model(ModelSpec(**spec, seed=args.seed + 1))
    p_opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
    p_sched = torch.optim.lr_scheduler.LambdaLR(p_opt, warmup(args.warmup_steps))
    c_sched = torch.optim.lr_scheduler.LambdaLR(c_opt, warmup(args.critic_warmup_steps))
    gen = torch.Generator().manual_seed(args.seed)
    B = args.prompts * args.samples
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    stats: tuple[torch.Tensor, torch.Tensor] | None = None  # the last raw advantages' mean, var

    for step in range(args.steps):
        # ---- rollout: prompt i of the run is record i (as the driver's group ids)
        batch_records = [
            records[(step * args.prompts + i) % len(records)] for i in range(args.prompts)
        ]
        rows = [r for r in batch_records for _ in range(args.samples)]
        prompt = torch.tensor([tok.encode(r["prompt"]) for r in rows])  # [B, P], equal lengths
        P = prompt.shape[1]
        with torch.no_grad():
            out = policy(input_ids=prompt, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            tokens = torch.full((B, args.max_new_tokens), tok.pad_id)
            done = torch.zeros(B, dtype=torch.bool)
            length = torch.full((B,), args.max_new_tokens)
            for t in range(args.max_new_tokens):
                probs = torch.softmax(logits.float() / args.temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                nxt = torch.where(done, torch.full_like(nxt, tok.pad_id), nxt)
                tokens[:, t] = nxt
                stop = (nxt == tok.eos_id) & ~done
                length = torch.where(stop, torch.full_like(length, t + 1), length)
                done |= stop
                if bool(done.all()):
                    break
                out = policy(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
        rewards_s, stopped_s = torch.zeros(B), torch.zeros(B)
        for b in range(B):
            ids = tokens[b, : int(length[b])].tolist()
            stopped = ids[-1] == tok.eos_id
            text = tok.decode(ids[:-1] if stopped else ids)
            finish = "stop" if stopped else "length"
            stopped_s[b] = float(stopped)
            rewards_s[b] = repeat_reward(response=text, record=rows[b], finish_reason=finish)

        # ---- [B, T] tensors, shifted layout: position t is about token t
        T = P + int(length.max())
        input_ids = torch.full((B, T), tok.pad_id)
        input_ids[:, :P] = prompt
        input_ids[:, P:] = tokens[:, : T - P]
        pos = torch.arange(T)[None, :]
        end = (P + length)[:, None]
        attention = (pos < end).long()
        mask = ((pos >= P) & (pos < end)).float()
        rewards = torch.zeros(B, T)
        rewards[torch.arange(B), P + length - 1] = rewards_s

        def logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            lp = torch.log_softmax(logits[:, :-1].float(), -1)
            lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            return torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)

        def values_of(model_out: torch.Tensor) -> torch.Tensor:  # value of the state before t
            v = model_out.squeeze(-1).float()
            return torch.cat([torch.zeros(v.shape[0], 1), v[:, :-1]], dim=1)

        with torch.no_grad():
            old_logprobs = logprobs_of(
                policy(input_ids=input_ids, attention_mask=attention).logits, input_ids
            )
            old_values = values_of(critic(input_ids=input_ids, attention_mask=attention).logits)
            # GAE over the response positions (they are contiguous), 0 after the last one
            advantages = torch.zeros(B, T)
            last_adv, next_value = torch.zeros(B), torch.zeros(B)
            for t in reversed(range(T)):
                m = mask[:, t]
                delta = rewards[:, t] + args.gamma * next_value - old_values[:, t]
                adv = delta + args.gamma * args.lam * last_adv
                advantages[:, t] = adv * m
                next_value = torch.where(m.bool(), old_values[:, t], next_value)
                last_adv = torch.where(m.bool(), adv, last_adv)
            returns = (advantages + old_values) * mask
            mean = masked_mean(advantages.double(), mask)
            var = (((advantages.double() - mean) * mask) ** 2).sum() / (mask.sum() - 1).clamp(min=1)
            if args.normalize_advantages and args.normalization == "chunk":
                advantages = ((advantages - mean) * torch.rsqrt(var + 1e-8) * mask).float()
            elif args.normalize_advantages and stats is not None:  # the previous iteration's
                advantages = ((advantages - stats[0]) * torch.rsqrt(stats[1] + 1e-8) * mask).float()
            stats = (mean, var)

        # ---- policy: ppo_epochs updates on the whole batch
        for _ in range(args.ppo_epochs):
            logits = policy(input_ids=input_ids, attention_mask=attention).logits
            ratio = torch.exp((logprobs_of(logits, input_ids) - old_logprobs) * mask)
            pg = torch.max(
                -advantages * ratio,
                -advantages * torch.clamp(ratio, 1 - args.eps_clip, 1 + args.eps_clip),
            )
            loss = reduce(pg, mask, args.loss_agg)
            if args.entropy_coef > 0:
                lp_all = torch.log_softmax(logits.float(), -1)
                ent = -(lp_all.exp() * lp_all).sum(-1)
                ent = torch.cat([torch.zeros(B, 1), ent[:, :-1]], dim=1)
                loss = loss - args.entropy_coef * reduce(ent, mask, args.loss_agg)
            p_opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            p_opt.step()
            p_sched.step()

        # ---- critic: critic_epochs passes in mini-batches, frozen returns and old values
        for _ in range(args.critic_epochs):
            for s in range(0, B, args.critic_mini_batch_size):
                i = slice(s, s + args.critic_mini_batch_size)
                v = values_of(critic(input_ids=input_ids[i], attention_mask=attention[i]).logits)
                v_loss = (v - returns[i]) ** 2
                if args.value_clip is not None:
                    clipped = old_values[i] + torch.clamp(
                        v - old_values[i], -args.value_clip, args.value_clip
                    )
                    v_loss = torch.max(v_loss, (clipped - returns[i]) ** 2)
                c_loss = 0.5 * reduce(v_loss, mask[i], args.loss_agg)
                c_opt.zero_grad(set_to_none=True)
                c_loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
                c_opt.step()
                c_sched.step()

        row = {
            "step": step,
            "rollout/reward_mean": float(rewards_s.mean()),
            "rollout/response_len_mean": float(mask.sum(1).mean()),
            "rollout/stop_frac": float(stopped_s.mean()),
            "actor/grad_norm": float(grad_norm),
            "loss/value": c_loss.item(),
            "wall_s": time.perf_counter() - start,
        }
        history.append(row)
        if on_step is not None:
            on_step(row)
        if args.log:
            print(json.dumps(row), flush=True)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=_bool, default=default)
        elif f.name == "value_clip":
            parser.add_argument("--value-clip", type=_maybe_float, default=default)
        else:
            parser.add_argument(
                f"--{f.name.replace('_', '-')}", type=type(default), default=default
            )
    run(Args(**vars(parser.parse_args())))


def _bool(text: str) -> bool:
    return text.lower() in ("1", "true", "yes")


def _maybe_float(text: str) -> float | None:
    return None if text.lower() in ("none", "null") else float(text)


if __name__ == "__main__":
    main()
