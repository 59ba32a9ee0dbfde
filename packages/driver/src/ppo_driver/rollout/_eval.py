"""Held-out evaluation on the generation engines: every prompt of an eval data set,
one greedy sample each (temperature 0), scored by the run's reward function.

The requests go to the same engines as training's, beside whatever generation is in
flight (a row never depends on its batch mates, so training's samples are unchanged),
with the weights the engines hold: after a step's refit, the policy that step trained.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._task import PromptDataset, RewardError, RewardFn, score_group
from ._types import ActorRef, GroupOutput, GroupRequest, SamplingParams

if TYPE_CHECKING:
    from ray import ObjectRef

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluation pass. ``rewards``: one per prompt scored (a prompt whose reward
    failed is counted in ``failures`` instead); ``lengths``: response tokens per prompt
    (the stop token included)."""

    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    failures: int
    seconds: float
    weight_versions: tuple[int, ...]

    def metrics(self) -> dict[str, float]:
        """``eval/*`` metrics (``eval/reward_mean`` is NaN when every reward failed)."""
        n = len(self.rewards)
        return {
            "eval/reward_mean": sum(self.rewards) / n if n else float("nan"),
            "eval/response_length_mean": sum(self.lengths) / max(1, len(self.lengths)),
            "eval/prompts": float(n + self.failures),
            "eval/reward_failures": float(self.failures),
            "eval/weight_version": float(max(self.weight_versions, default=-1)),
            "perf/eval_s": self.seconds,
        }


class Evaluator:
    """Greedy decoding of every prompt of ``dataset`` on ``engines``, scored with
    ``reward_fn``.

    Args:
        engines: Ray actor handles of :class:`~ppo_driver.rollout.RolloutEngine`.
        dataset: the held-out prompts (``rollout.eval_dataset_path``).
        reward_fn: the run's reward (called as in training, with the prompt's record).
        max_new_tokens, stop_token_ids: as in training.
        timeout_s: per reward call (``None`` or 0: no limit), as in training.
        prompts_per_call: prompts sent to an engine in one ``generate`` call; at most
            two calls per engine are in flight.
    """

    def __init__(
        self,
        *,
        engines: Sequence[ActorRef],
        dataset: PromptDataset,
        reward_fn: RewardFn,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        timeout_s: float | None = None,
        prompts_per_call: int = 16,
    ) -> None:
        if not engines:
            raise ValueError("Evaluator needs at least one engine")
        if prompts_per_call < 1:
            raise ValueError(f"prompts_per_call={prompts_per_call}: use at least 1")
        self.engines = list(engines)
        self.dataset = dataset
        self.reward_fn = reward_fn
        self.params = SamplingParams(
            n=1,
            temperature=0.0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
        )
        self.timeout_s = timeout_s or None
        self.prompts_per_call = prompts_per_call

    def run(self) -> EvalResult:
        """Generate and score every prompt once. Raises the engine's error
        (``ray.exceptions.RayActorError``, :class:`~ppo_driver.rollout.EngineRestarted`)
        when an engine is lost meanwhile."""
        import ray

        t0 = time.perf_counter()
        n = len(self.dataset)
        calls = [
            [
                GroupRequest(
                    prompt_index=i, prompt_ids=self.dataset.prompt_ids(i), params=self.params
                )
                for i in range(start, min(n, start + self.prompts_per_call))
            ]
            for start in range(0, n, self.prompts_per_call)
        ]
        outputs: list[GroupOutput] = []
        in_flight: dict[ObjectRef[list[GroupOutput]], int] = {}  # ref -> engine
        next_call = 0
        window = 2 * len(self.engines)
        while next_call < len(calls) or in_flight:
            while next_call < len(calls) and len(in_flight) < window:
                busy = list(in_flight.values())
                engine = min(range(len(self.engines)), key=lambda i: (busy.count(i), i))
                ref = self.engines[engine].generate.remote(calls[next_call])
                in_flight[ref] = engine
                next_call += 1
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                del in_flight[ref]
                outputs.extend(ray.get(ref))
        rewards: list[float] = []
        lengths: list[int] = []
        failures = 0
        for out in sorted(outputs, key=lambda o: o.prompt_index):
            lengths.append(len(out.samples[0].token_ids))
            try:
                scored = score_group(
                    out,
                    record=self.dataset.record(out.prompt_index),
                    reward_fn=self.reward_fn,
                    tokenizer=self.dataset.tokenizer,
                    timeout_s=self.timeout_s,
                )
            except RewardError as exc:
                failures += 1
                _log.warning("eval prompt %d: %s", out.prompt_index, exc)
                continue
            rewards.append(scored.rewards[0])
        return EvalResult(
            rewards=tuple(rewards),
            lengths=tuple(lengths),
            failures=failures,
            seconds=time.perf_counter() - t0,
            weight_versions=tuple(sorted({o.weight_version for o in outputs})),
        )
