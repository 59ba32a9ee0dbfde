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
import functools
import importlib
import inspect
import json
import math
import queue
import random
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._tokenizer import Tokenizer
from ._types import GroupOutput

RewardFn = Callable[..., float | Awaitable[float]]
"""``reward_fn(*, response: str, record: Mapping[str, Any], finish_reason: str)``, sync
or async, returning a real number: an int or a float (not a bool), finite."""

TASK_LETTERS = "abcdefgh"
TASK_ALPHABET = TASK_LETTERS + "0123456789:"
"""Every character of the built-in task's prompts and answers (its character tokenizer's
alphabet)."""


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
    """A group's reward failed: the function raised, timed out, or returned something
    that is not a real finite number. The group is not trained on."""


class RewardFailure(RuntimeError):
    """The run cannot go on: ``rollout.max_consecutive_group_failures`` prompt groups
    failed in a row (the message carries the first one's traceback)."""


REAL_NUMBER = "a reward must return a real number (int or float, not bool, finite)"


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


def reward_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of a reward function, for messages."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def _checked(value: Any, *, name: str, prompt: int, sample: int) -> float:
    """``value`` as a float, or :class:`RewardError` unless it is a real finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"reward {name} returned {value!r} ({type(value).__name__}) for prompt {prompt} "
            f"sample {sample}; {REAL_NUMBER}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise RewardError(
            f"reward {name} returned {value!r} for prompt {prompt} sample {sample}; {REAL_NUMBER}"
        )
    return number


class _Overran(Exception):
    """A reward call did not return before its deadline."""


class _Job:
    __slots__ = ("call", "done", "error", "value")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        try:
            job.value = job.call()
        except BaseException as exc:  # handed to the caller, raised there
            job.error = exc
        job.done.set()


class _RewardThread:
    """Makes the sync reward calls of one calling thread on a daemon thread, so that a
    call can be given up after its deadline. Python cannot kill a thread: a call that
    overruns is abandoned and runs on in the background (it never keeps the process
    from exiting), and the next call gets a new thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def call(self, fn: Callable[[], Any], *, timeout_s: float) -> Any:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="reward", daemon=True).start()
        job = _Job(fn)
        self._jobs.put(job)
        if not job.done.wait(timeout_s):
            self._jobs.put(None)  # the stuck thread ends after its call, if it ever returns
            self._jobs = None
            raise _Overran
        if job.error is not None:
            raise job.error
        return job.value


_THREADS = threading.local()


def _reward_thread() -> _RewardThread:
    runner = getattr(_THREADS, "runner", None)
    if runner is None:
        runner = _THREADS.runner = _RewardThread()
    return runner


async def _await_all(
    pending: Mapping[int, Awaitable[Any]], timeout_s: float | None
) -> dict[int, asyncio.Future[Any]]:
    """Run the awaitables together for at most ``timeout_s``; those not done by then
    are cancelled (check ``cancelled()``)."""
    tasks: dict[int, asyncio.Future[Any]] = {
        j: asyncio.ensure_future(aw) for j, aw in pending.items()
    }
    _, late = await asyncio.wait(tasks.values(), timeout=timeout_s)
    for task in late:
        task.cancel()
    return tasks


def score_group(
    output: GroupOutput,
    *,
    record: Mapping[str, Any],
    reward_fn: RewardFn,
    tokenizer: Tokenizer,
    timeout_s: float | None = None,
) -> ScoredGroup:
    """Reward every sample of ``output``; any failure fails the whole group with a
    :class:`RewardError` naming the reward, the prompt and the sample: the function
    raised, returned something that is not a real number (int or float, not bool,
    finite), or overran ``timeout_s``.

    ``timeout_s`` (``None`` or 0: no limit) bounds each call. A sync reward then runs on
    a worker thread, and one that overruns is abandoned: a thread cannot be killed, so
    it runs on in the background until it returns (if it ever does). Async rewards are
    awaited together, all within ``timeout_s``, and the late ones are cancelled (an
    async reward that blocks the event loop without awaiting cannot be interrupted).
    """
    name = reward_name(reward_fn)
    prompt = output.prompt_index
    limit = timeout_s or None
    rewards: list[float] = []
    pending: dict[int, Awaitable[Any]] = {}
    try:
        for j, sample in enumerate(output.samples):
            ids = list(sample.token_ids)
            if sample.finish_reason == "stop" and ids:
                ids = ids[:-1]
            call = functools.partial(
                reward_fn,
                response=tokenizer.decode(ids),
                record=record,
                finish_reason=sample.finish_reason,
            )
            try:
                result = call() if limit is None else _reward_thread().call(call, timeout_s=limit)
            except _Overran:
                raise RewardError(
                    f"reward {name} did not return within {limit:g} s for prompt {prompt} "
                    f"sample {j} (rollout.reward_timeout_s); the call is abandoned and runs "
                    "on in the background (a thread cannot be killed)"
                ) from None
            except Exception as exc:
                raise RewardError(
                    f"reward {name} failed for prompt {prompt} sample {j}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if inspect.isawaitable(result):
                pending[j] = result
                rewards.append(math.nan)  # filled in below
            else:
                rewards.append(_checked(result, name=name, prompt=prompt, sample=j))
        if pending:
            tasks = asyncio.run(_await_all(pending, limit))
            pending = {}
            for j, task in tasks.items():
                if task.cancelled():
                    late = f"did not return within {limit:g} s" if limit else "was cancelled"
                    raise RewardError(
                        f"reward {name} {late} for prompt {prompt} sample {j} "
                        "(rollout.reward_timeout_s); the call was cancelled"
                    )
                error = task.exception()
                if error is not None:
                    raise RewardError(
                        f"reward {name} failed for prompt {prompt} sample {j}: "
                        f"{type(error).__name__}: {error}"
                    ) from error
                rewards[j] = _checked(task.result(), name=name, prompt=prompt, sample=j)
    finally:
        for aw in pending.values():  # never awaited: a bad value or error came first
            if inspect.iscoroutine(aw):
                aw.close()
    return ScoredGroup(output=output, rewards=tuple(rewards))
