"""Prompts (JSONL or the built-in synthetic task) and pluggable rewards.

The built-in task, *repeat*: the prompt ``"c7:"`` asks for the letter ``c`` written
exactly 7 times and then the end-of-sequence token. Counts vary per prompt (1 to
``max_count``) and sampling varies lengths within a group, so response lengths have a
real long tail. The reward is rule-based with partial credit, so a random policy earns a
small but non-zero reward and every sample carries signal:

    0.5 * (fraction of the first N characters that are c)
  + 0.3 * (1 - |L - N| / N, floored at 0; only when the sample stopped by itself)
  + 0.2 * (exactly c * N and stopped)
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._tokenizer import Tokenizer
from ._types import GroupOutput

RewardFn = Callable[..., float | Awaitable[float]]
"""``reward_fn(*, response: str, record: Mapping[str, Any], finish_reason: str)``, sync
or async, returning a finite float."""

TASK_LETTERS = "abcdefgh"


def repeat_reward(*, response: str, record: Mapping[str, Any], finish_reason: str) -> float:
    """The built-in task's reward in [0, 1] (see the module docstring)."""
    char = str(record["char"])
    count = int(record["count"])
    length = len(response)
    match = sum(1 for ch in response[:count] if ch == char) / count
    stopped = finish_reason == "stop"
    length_score = max(0.0, 1.0 - abs(length - count) / count) if stopped else 0.0
    exact = 1.0 if stopped and response == char * count else 0.0
    return 0.5 * match + 0.3 * length_score + 0.2 * exact


def synthetic_records(*, num_prompts: int, seed: int, max_count: int = 12) -> list[dict[str, Any]]:
    """``num_prompts`` records ``{"prompt", "char", "count"}`` of the repeat task, counts
    uniform in [1, max_count], reproducible from ``seed``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts}: use at least 1")
    if not 1 <= max_count <= 99:
        raise ValueError(f"max_count={max_count}: use a value in [1, 99]")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(num_prompts):
        char = rng.choice(TASK_LETTERS)
        count = rng.randint(1, max_count)
        out.append({"prompt": f"{char}{count}:", "char": char, "count": count})
    return out


def load_jsonl(path: str | Path, *, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Records from a JSONL file, one JSON object per line, each with ``prompt_key``
    (a string) plus whatever fields the reward needs. Blank lines are skipped."""
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get(prompt_key), str):
            raise ValueError(
                f"{path}:{lineno}: each line must be a JSON object with a string "
                f"{prompt_key!r} field"
            )
        records.append(obj)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class PromptDataset:
    """Prompt records addressed by a global prompt index (wrapping around epochs).
    Prompt text is encoded with ``tokenizer.encode``."""

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
    ) -> None:
        if not records:
            raise ValueError("PromptDataset needs at least one record")
        self.records = [dict(r) for r in records]
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self._ids = [tuple(tokenizer.encode(str(r[prompt_key]))) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def record(self, prompt_index: int) -> dict[str, Any]:
        return self.records[prompt_index % len(self.records)]

    def prompt_ids(self, prompt_index: int) -> tuple[int, ...]:
        return self._ids[prompt_index % len(self._ids)]


def load_reward_fn(path: str) -> RewardFn:
    """Resolve ``"package.module:function"``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r}: use the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward function {path!r}: cannot import {module_name!r} ({exc})"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward function {path!r}: {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


class RewardError(RuntimeError):
    """A group's reward failed (exception or non-finite value); the group is not trained on."""


@dataclass(frozen=True, slots=True)
class ScoredGroup:
    """A generated group with one reward per sample."""

    output: GroupOutput
    rewards: tuple[float, ...]

    @property
    def prompt_index(self) -> int:
        return self.output.prompt_index

    @property
    def weight_version(self) -> int:
        return self.output.weight_version


async def _gather(results: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*results))


def score_group(
    output: GroupOutput, *, record: Mapping[str, Any], reward_fn: RewardFn, tokenizer: Tokenizer
) -> ScoredGroup:
    """Reward every sample of ``output``. Async reward functions are awaited together.
    Raises :class:`RewardError` naming the prompt and sample on an exception or a
    non-finite reward."""
    raw: list[Any] = []
    try:
        for sample in output.samples:
            ids = list(sample.token_ids)
            if sample.finish_reason == "stop" and ids:
                ids = ids[:-1]
            raw.append(
                reward_fn(
                    response=tokenizer.decode(ids),
                    record=record,
                    finish_reason=sample.finish_reason,
                )
            )
        if any(inspect.isawaitable(r) for r in raw):
            pending = [r if inspect.isawaitable(r) else _const(r) for r in raw]
            raw = asyncio.run(_gather(pending))
    except Exception as exc:
        for r in raw:
            if inspect.iscoroutine(r):
                r.close()
        raise RewardError(
            f"reward failed for prompt {output.prompt_index}: {type(exc).__name__}: {exc}"
        ) from exc
    rewards: list[float] = []
    for i, r in enumerate(raw):
        try:
            value = float(r)
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"reward for prompt {output.prompt_index} sample {i} is {r!r}, not a number"
            ) from exc
        if not math.isfinite(value):
            raise RewardError(
                f"reward for prompt {output.prompt_index} sample {i} is {value}; rewards must be finite"
            )
        rewards.append(value)
    return ScoredGroup(output=output, rewards=tuple(rewards))


async def _const(value: Any) -> Any:
    return value
