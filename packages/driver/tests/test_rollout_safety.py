"""Rewards that misbehave fail their group with a clear message instead of hanging the run
or being taken for a number: wrong types, non-finite values, timeouts (sync and async).
The rollout manager's side (failure streaks, restarted engines) is in test_engine_ray.py."""

from __future__ import annotations

import asyncio
import copy
import fractions
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from ppo_driver.rollout import (
    CharTokenizer,
    GroupOutput,
    RewardError,
    SampleOutput,
    score_group,
)

TOK = CharTokenizer()
REAL_NUMBER = r"a reward must return a real number \(int or float, not bool, finite\)"


def _output(n: int = 3) -> GroupOutput:
    s = SampleOutput(
        token_ids=(3, 3, TOK.eos_id), logprobs=(-1.0, -1.0, -0.5), finish_reason="stop"
    )
    return GroupOutput(prompt_index=9, prompt_ids=(1, 3, 6, 21), samples=(s,) * n, weight_version=2)


def _constant(value: Any) -> Any:
    def reward(**_: Any) -> Any:
        return value

    return reward


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("0.75", id="numeric-string"),
        pytest.param(True, id="bool"),
        pytest.param(False, id="bool-false"),
        pytest.param(None, id="none"),
        pytest.param(torch.tensor(0.5), id="tensor"),
        pytest.param(np.array(0.5), id="numpy-0d-array"),
        pytest.param(np.bool_(True), id="numpy-bool"),
        pytest.param(np.complex64(1), id="numpy-complex"),
        pytest.param(np.float32("nan"), id="numpy-nan"),
        pytest.param([0.5], id="list"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("-inf"), id="inf"),
        pytest.param(10**400, id="int-beyond-float"),
    ],
)
@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-limit", "limit"])
def test_a_reward_that_is_not_a_real_number_fails_the_group(
    value: Any, timeout_s: float | None
) -> None:
    with pytest.raises(RewardError, match=REAL_NUMBER) as info:
        score_group(
            _output(), record={}, reward_fn=_constant(value), tokenizer=TOK, timeout_s=timeout_s
        )
    assert "for prompt 9 sample 0" in str(info.value)
    assert "_constant.<locals>.reward" in str(info.value)  # names the reward


@pytest.mark.parametrize(
    ("value", "want"),
    [
        pytest.param(1, 1.0, id="int"),
        pytest.param(0.75, 0.75, id="float"),
        pytest.param(-3, -3.0, id="negative"),
        pytest.param(1e30, 1e30, id="huge-but-finite"),
        # what numpy code returns: numpy.float64 subclasses float, float32 does not
        pytest.param(np.float32(0.25), 0.25, id="numpy-float32"),
        pytest.param(np.float16(-1.5), -1.5, id="numpy-float16"),
        pytest.param(np.int64(7), 7.0, id="numpy-int64"),
        pytest.param(np.float32(0.1), float(np.float32(0.1)), id="float32-exact"),
        pytest.param(fractions.Fraction(3, 4), 0.75, id="fraction"),
    ],
)
@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-limit", "limit"])
def test_real_numbers_are_rewards(value: Any, want: float, timeout_s: float | None) -> None:
    scored = score_group(
        _output(), record={}, reward_fn=_constant(value), tokenizer=TOK, timeout_s=timeout_s
    )
    assert scored.rewards == (want,) * 3 and all(type(r) is float for r in scored.rewards)


def test_an_async_reward_may_return_a_numpy_scalar() -> None:
    async def reward(**_: Any) -> Any:
        return np.float32(0.5)

    scored = score_group(_output(2), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=5)
    assert scored.rewards == (0.5, 0.5)


@pytest.mark.parametrize("timeout_s", [None, 5.0], ids=["no-limit", "limit"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_reward_that_edits_its_record_changes_nothing_outside_the_call(
    timeout_s: float | None, kind: str
) -> None:
    record = {"prompt": "a3:", "meta": {"tags": ["x"], "seen": 0}}
    original = copy.deepcopy(record)
    seen: list[dict[str, Any]] = []

    def edit(record: dict[str, Any]) -> float:
        seen.append(copy.deepcopy(record))
        record["meta"]["tags"].append("edited")  # nested: a shallow copy would leak it
        record["meta"]["seen"] += 1
        record["prompt"] = "changed"
        record.pop("meta")
        return 1.0

    def sync_reward(*, record: dict[str, Any], **_: Any) -> float:
        return edit(record)

    async def async_reward(*, record: dict[str, Any], **_: Any) -> float:
        return edit(record)

    fn = sync_reward if kind == "sync" else async_reward
    for _ in range(2):  # two groups of 4 on the same stored record
        score_group(_output(4), record=record, reward_fn=fn, tokenizer=TOK, timeout_s=timeout_s)
    assert record == original  # the data set's record is untouched
    assert seen == [original] * 8  # every call saw the record as stored


def test_the_first_bad_value_refuses_the_rest() -> None:
    calls: list[str] = []

    def reward(*, response: str, **_: Any) -> Any:
        calls.append(response)
        return "0.75"

    with pytest.raises(RewardError, match=r"returned '0.75' \(str\)"):
        score_group(_output(), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=5)
    assert len(calls) == 1


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown: lets an abandoned reward thread finish."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hung_sync_reward_times_out_and_the_next_call_works(release: threading.Event) -> None:
    threads: list[str] = []

    def reward(*, response: str, **_: Any) -> float:
        threads.append(threading.current_thread().name)
        if len(threads) == 2:
            release.wait()  # hangs until the test ends
        return float(len(response))

    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        score_group(_output(), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=0.3)
    assert time.monotonic() - start < 10
    msg = str(info.value)
    assert "did not return within 0.3 s for prompt 9 sample 1" in msg
    assert "rollout.reward_timeout_s" in msg and ".<locals>.reward" in msg
    assert len(threads) == 2  # the rest of the group was not called
    # the caller's next group gets a fresh worker thread; the stuck one is left behind
    scored = score_group(_output(1), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=5)
    assert scored.rewards == (2.0,)
    assert threads[0] == threads[1] == threads[2] == "reward"
    assert threading.main_thread().name not in threads


def test_the_limit_bounds_each_call_and_a_group_is_one_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The group's sync calls go to the reward thread as ONE job (a thread hand-over per
    sample cost 0.3 ms each), yet ``timeout_s`` still bounds each call from its own
    start: three calls of 0.15 s pass a 0.25 s limit although the group takes 0.45 s."""
    from ppo_driver.rollout import _task

    jobs: list[int] = []
    run = _task._RewardThread.run

    def counted(self: Any, calls: Any, *, timeout_s: float) -> Any:
        jobs.append(len(calls))
        return run(self, calls, timeout_s=timeout_s)

    monkeypatch.setattr(_task._RewardThread, "run", counted)

    def reward(*, response: str, **_: Any) -> float:
        time.sleep(0.15)
        return float(len(response))

    start = time.monotonic()
    scored = score_group(_output(3), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=0.25)
    assert scored.rewards == (2.0, 2.0, 2.0)
    assert time.monotonic() - start >= 0.45
    assert jobs == [3]


def test_a_hung_async_reward_is_cancelled() -> None:
    cancelled: list[int] = []

    async def reward(*, response: str, record: Any, finish_reason: str) -> float:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return 1.0

    start = time.monotonic()
    with pytest.raises(RewardError, match=r"did not return within 0.2 s for prompt 9 sample 0"):
        score_group(_output(2), record={}, reward_fn=reward, tokenizer=TOK, timeout_s=0.2)
    assert time.monotonic() - start < 10 and cancelled


def test_without_a_limit_sync_rewards_run_in_the_callers_thread() -> None:
    seen: list[threading.Thread] = []

    def reward(**_: Any) -> float:
        seen.append(threading.current_thread())
        return 0.5

    assert score_group(_output(2), record={}, reward_fn=reward, tokenizer=TOK).rewards == (0.5, 0.5)
    assert seen == [threading.current_thread()] * 2


def test_an_exception_names_the_reward_and_sample() -> None:
    def grader(**_: Any) -> float:
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"grader failed for prompt 9 sample 0: KeyError") as info:
        score_group(_output(), record={}, reward_fn=grader, tokenizer=TOK, timeout_s=5)
    assert isinstance(info.value.__cause__, KeyError)
