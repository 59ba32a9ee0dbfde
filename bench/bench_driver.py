"""Step time of streaming against full-batch PPO, same config and seed, in one run.

The built-in task (response lengths vary per sample: a real long tail, no sleeps), one
Ray cluster for both modes. The full-batch runs use the streaming runs' micro-batches
(one rank's share of a block, as ``configs/full_batch.yaml`` does for the task), so the
two modes compute the same thing and differ by the schedule only. Reports per mode:
chunks per step, mean step time, and the fraction of each step the training devices sat
idle (the time the pump waited for the sampler to release a chunk, over the step time),
then the mean seconds per phase. The first step of each mode is a warm-up and is not
counted.

Profiles (``--profile``), each a list of overrides on the ``ppo-driver train`` defaults:

* ``separate`` (default): the document's setting on this CPU machine. Generation runs
  on its own device: the engine waits ``rollout.decode_delay_s`` (0.2 s) per decode
  step, so most of its time passes without taking the trainers' cores (its forwards
  still share the two CPU cores, which no real deployment does). Models of hidden
  192 / 3 layers, 128 prompts x 4 samples per step, responses of up to 24 tokens. The
  policy is one in training, not a fresh one: one full-batch run of 6 learning steps
  (default learning rates) writes a checkpoint, and every measured run resumes from it
  with the policy's learning rate at 1e-9. A fresh policy rarely samples EOS within 24
  tokens, so most groups finish at the last decode step and there is little to stream;
  after a few steps its lengths follow the prompts (1 to 12 letters asked for) with a
  tail to the limit, as a real model's do. The frozen policy keeps that length
  distribution the same in both modes, step after step, so their step times differ by
  the schedule only. With the default rate the two policies drift apart within 2-3
  steps (in one run, mean response lengths of 19 against 5 tokens at step 3), and the
  step times then follow the response lengths, not the pump.
* ``separate-learning``: ``separate`` from a fresh policy, learning at the default
  rates (no warm-up run).
* ``tail``: the real engine on the shared cores, responses of up to 48 tokens (the
  untrained policy's lengths spread from a few tokens to the limit). Training-bound
  here: generation hides behind critic training, and overlapped chunks compete with
  generation for the same two cores.
* ``tiny``: the defaults (responses of up to 12 tokens).
* ``balanced``: the larger models on the real engine (training-bound).

    uv run --frozen python bench/bench_driver.py [--profile separate] [--steps 8] [--rounds 2] [overrides ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROFILES: dict[str, list[str]] = {
    "balanced": [
        f"{role}.{key}={value}"
        for role in ("policy", "critic")
        for key, value in (
            ("hidden_size", 192),
            ("intermediate_size", 384),
            ("num_hidden_layers", 3),
        )
    ],
    "tiny": [],
    "tail": ["rollout.max_new_tokens=48"],
}
PROFILES["separate-learning"] = [
    *PROFILES["balanced"],
    "ppo.num_prompts_per_step=128",
    "rollout.max_new_tokens=24",
    "rollout.decode_delay_s=0.2",
]
PROFILES["separate"] = [*PROFILES["separate-learning"], "policy.lr=1e-9"]

WARM_STEPS: dict[str, int] = {"separate": 6}
"""Profiles measured from a policy in training: one full-batch run of that many steps
at the default learning rates, whose checkpoint every measured run resumes from."""


def _run(
    mode: str,
    overrides: list[str],
    steps: int,
    root: Path,
    *,
    warm: Path | None = None,
    streamed_micro_batches: bool = True,
) -> list[dict[str, Any]]:
    """``steps`` steps in ``mode``; from ``warm``'s checkpoint (a copy of that run
    directory, resumed) when given. Returns the metrics of those steps.
    ``streamed_micro_batches=False``: the full batch keeps a null micro-batch size (one
    micro-batch of the whole batch, padded to its longest response)."""
    from ppo_driver.checkpoint import checkpoint_step, find_latest
    from ppo_driver.config import load_config, trainer_configs
    from ppo_driver.run import train
    from ppo_driver.workload import load_workload

    done = 0
    if warm is not None:
        shutil.copytree(warm, root / mode)
        latest = find_latest(warm / "checkpoints")
        assert latest is not None, f"the warm-up run wrote no checkpoint in {warm}"
        done = checkpoint_step(latest) or 0
    cfg, _ = load_config(
        None, [*overrides, f"run.num_steps={done + steps}", "run.checkpoint_every=0"]
    )
    if mode == "full-batch" and streamed_micro_batches:
        # the streaming run's micro-batches as the driver resolves them (a null size while
        # streaming is one rank's share of a block; in full batch it would be the whole
        # batch, padded to its longest response), as configs/full_batch.yaml sets them
        vocab_size = load_workload(cfg).tokenizer.vocab_size
        actor, critic = trainer_configs(cfg, vocab_size=vocab_size)
        cfg.policy.train_micro_batch_size = actor.micro_batch_size
        cfg.critic.train_micro_batch_size = critic.micro_batch_size
    if mode == "full-batch":
        cfg.async_rl.min_groups_for_streaming_train = cfg.ppo.num_prompts_per_step
    cfg.run.progress = False
    result = train(cfg, run_dir=root / mode, keep_ray=True, resume=warm is not None)
    return result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="separate")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs per mode, interleaved (S F, then F S, ...) so that drifting machine "
        "load hits both modes alike",
    )
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=None,
        help="learning steps (full-batch, default learning rates) of one run that every "
        "measured run resumes from; default: the profile's (separate: 6), else 0",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    warm_steps = WARM_STEPS.get(args.profile, 0) if args.warm_steps is None else args.warm_steps

    from ppo_placement import shutdown_local_ray, start_local_ray

    t0 = time.perf_counter()
    start_local_ray(num_gpus=2, num_cpus=4)
    rows: dict[str, list[dict[str, Any]]] = {"streaming": [], "full-batch": []}
    overrides = [*PROFILES[args.profile], *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        warm = None
        if warm_steps > 0:  # the learning rates of the defaults, not the profile's
            from ppo_driver.config import load_config

            defaults, _ = load_config(None, [])
            lrs = [f"{role}.lr={defaults.model(role).lr}" for role in ("policy", "critic")]
            _run("full-batch", [*overrides, *lrs], warm_steps, Path(tmp) / "warm")
            warm = Path(tmp) / "warm" / "full-batch"
        for r in range(args.rounds):
            order = ("streaming", "full-batch") if r % 2 == 0 else ("full-batch", "streaming")
            for mode in order:
                metrics = _run(mode, overrides, args.steps, Path(tmp) / f"round{r}", warm=warm)
                rows[mode].extend(metrics[1:] or metrics)  # the first step warms up
    shutdown_local_ray()

    print()
    print(f"profile {args.profile}: {' '.join(overrides) or 'defaults'}")
    if warm_steps:
        print(f"measured from the checkpoint of {warm_steps} full-batch learning step(s)")
    print(f"{'mode':<11} {'chunks/step':>11} {'step_s':>8} {'wait_s':>8} {'idle':>6} {'reward':>7}")
    summary: dict[str, float] = {}
    for mode, timed in rows.items():
        step_s = statistics.mean(r["perf/step_s"] for r in timed)
        wait_s = statistics.mean(r["perf/wait_s"] for r in timed)
        idle = statistics.mean(r["perf/wait_s"] / r["perf/step_s"] for r in timed)
        chunks = statistics.mean(r["train/chunks"] for r in timed)
        reward = statistics.mean(r["rollout/reward_mean"] for r in timed)
        summary[mode] = step_s
        print(
            f"{mode:<11} {chunks:>11.2f} {step_s:>8.3f} {wait_s:>8.3f} {idle:>6.1%} {reward:>7.3f}"
        )
    # generation: dispatch to the last arrival (it overlaps the training phases)
    phases = (
        "wait",
        "switch",
        "value",
        "logprob",
        "backward",
        "update",
        "refit",
        "critic",
        "generation",
    )
    print()
    print(f"{'mode':<11} " + " ".join(f"{p:>8}" for p in phases) + "   (mean s per step)")
    for mode, timed in rows.items():
        means = [statistics.mean(float(r.get(f"perf/{p}_s", 0.0)) for r in timed) for p in phases]
        print(f"{mode:<11} " + " ".join(f"{m:>8.3f}" for m in means))
    print(
        f"step time full-batch / streaming: {summary['full-batch'] / summary['streaming']:.2f}x "
        f"(steps 2..{args.steps} of {args.rounds} run(s) per mode; "
        f"total bench {time.perf_counter() - t0:.0f} s)"
    )
    print()
    for name, value, target in _ratios(rows):
        print(f"{name:<58} {value:>7.3f}   {target}")


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(float(r.get(key, 0.0)) for r in rows)


def _ratios(rows: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, str]]:
    """The issue's three ratios and the actor's forwards per sample.

    * schedule overhead: the time a streaming step's trainers neither compute nor wait
      for generation (the driver's GAE and bookkeeping, Ray round trips, the model
      switches that do not overlap the wait), over their compute: ``(step - wait -
      compute) / compute``, compute = every trainer phase the workers timed (value
      forward, log-prob forward, the forward/backward of epoch 1, the updates with
      epochs 2..K, the refit, critic training);
    * overlap efficiency: the fraction of the hideable work that streaming hides,
      ``(full-batch step - streaming step - dropped) / hideable``; hideable = the
      full-batch step's epoch-1 work (its value forward and first forward/backward:
      epochs 2..K are ``train_epochs``, an update phase) times the share of the samples
      that streaming trains in non-final chunks; dropped = the full batch's separate
      log-prob forward (K > 1 policy epochs, ppo-driver before 0.8.1: 0 since, when its
      epoch 1 gives the old log-probs as streaming's does), saved outright, not by
      overlap.
    """
    stream, full = rows["streaming"], rows["full-batch"]
    phases = ("value", "logprob", "backward", "update", "refit", "critic")
    compute = sum(_mean(stream, f"perf/{p}_s") for p in phases)
    overhead = _mean(stream, "perf/step_s") - _mean(stream, "perf/wait_s") - compute
    non_final = statistics.mean(
        1.0 - r["train/chunk_groups"][-1] / sum(r["train/chunk_groups"]) for r in stream
    )
    dropped = _mean(full, "perf/logprob_s")
    hideable = (_mean(full, "perf/value_s") + _mean(full, "perf/backward_s")) * non_final
    saved = _mean(full, "perf/step_s") - _mean(stream, "perf/step_s") - dropped
    out = [
        (
            "streaming step time / full-batch step time",
            _mean(stream, "perf/step_s") / _mean(full, "perf/step_s"),
            "(lower is better)",
        ),
        (
            "schedule overhead / trainer compute (streaming)",
            overhead / compute if compute > 0 else float("nan"),
            "(target <= 0.10)",
        ),
        (
            "overlap efficiency (hidden / hideable work)",
            saved / hideable if hideable > 0 else float("nan"),
            f"(target >= 0.8; hideable {hideable:.3f} s/step)",
        ),
    ]
    for mode, timed in rows.items():
        if timed and "train/actor_forwards_per_sample" in timed[0]:
            out.append(
                (
                    f"actor forwards per sample ({mode})",
                    _mean(timed, "train/actor_forwards_per_sample"),
                    "(+ the backward; K policy epochs: K in both modes)",
                )
            )
    return out


if __name__ == "__main__":
    main()
