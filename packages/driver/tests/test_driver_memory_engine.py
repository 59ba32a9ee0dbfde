"""Colocated generation gives its memory back while the models train, seen from outside
the engine's process (like the trainers' RSS test, ``test_driver_memory_process.py``).

One real ``ppo_driver.run.train`` (local Ray, CPU, the embedded engine, full batch,
``cluster.colocate=true``) with a policy large enough (hidden 512, 4 layers: ~38 MB of
fp32 parameters) that its bytes dominate the noise of a process's resident set. The
engine's process is found through its Ray handle; a thread samples its RSS
(``/proc/<pid>/statm``) every few milliseconds, and every actor call is timed.

* The engine starts released: when the actor is built, it holds less than its resident
  self by at least 80 % of its weights.
* While the actor trains (its backward and its optimizer update) the engine's RSS stays
  that far below what it holds once it generates again after the step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from driver_testlib import MEMORY_MODELS, RssSampler, rss_bytes
from ppo_driver import run as run_module
from ppo_driver.config import load_config
from ppo_driver.workers import TrainGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: The trainers' test's threshold (not tuned to this machine).
RELEASED = 0.8
TRAINING = ("train_chunk", "finish_step")  # the actor's backward and update

OVERRIDES = [
    "run.num_steps=1",
    "run.progress=false",
    "run.checkpoint_every=0",
    "cluster.colocate=true",
    "rollout.num_engines=1",
    "ppo.num_prompts_per_step=4",
    "ppo.num_generations_per_prompt=2",
    "ppo.critic_mini_batch_size=8",
    "ppo.critic_ppo_epochs=1",
    "async_rl.min_groups_for_streaming_train=4",  # full batch (colocated)
    "async_rl.sampler.max_lookahead_versions=0",
    "rollout.max_new_tokens=6",
    *MEMORY_MODELS,
]


# Ray's workers cannot import this test module: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _weight_bytes(engine: Any) -> int:
    """The engine's parameter bytes (sizes: a released tensor keeps its shape)."""
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


class _Timed:
    """A started worker call whose ``result()`` records when it ended."""

    def __init__(self, pending: Any, method: str, windows: list[tuple[str, float, float]]):
        self.pending, self.method, self.windows = pending, method, windows
        self.start = time.monotonic()
        self.refs = pending.refs

    def result(self) -> Any:
        out = self.pending.result()
        self.windows.append((self.method, self.start, time.monotonic()))
        return out


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The engine (its handle and pid, its state when the actor is built) and the
    actor's calls (method, start, end)."""
    seen: dict[str, Any] = {"windows": [], "engines": []}
    sampler = RssSampler()
    seen["sampler"] = sampler
    original_launch = run_module._launch_engines

    def launch(*args: Any, **kwargs: Any) -> list[Any]:
        engines: list[Any] = original_launch(*args, **kwargs)
        seen["engines"] = engines
        sampler.pids["engine"] = int(ray.get(engines[0].health.remote()).extra["pid"])
        return engines

    class RecordedGroup(TrainGroup):
        def build(self) -> None:
            if self.role == "actor":  # the engine as the actor's model arrives
                (engine,) = seen["engines"]
                seen["at_actor_build"] = (
                    ray.get(engine.health.remote()).memory_released,
                    rss_bytes(sampler.pids["engine"]),
                )
            super().build()

        def _start(self, options: Any, method: Any, *args: Any) -> Any:
            pending = super()._start(options, method, *args)  # every call of the group
            if self.role != "actor":
                return pending
            return _Timed(pending, method.__name__, seen["windows"])

    monkeypatch.setattr(run_module, "_launch_engines", launch)
    monkeypatch.setattr(run_module, "TrainGroup", RecordedGroup)
    with sampler:
        yield seen


def test_colocated_engine_releases_its_memory_while_the_actor_trains(
    observed: dict[str, Any], tmp_path: Path
) -> None:
    cfg, report = load_config(None, OVERRIDES)
    assert report.ok and not cfg.streaming
    after_step: dict[str, Any] = {}

    def on_step(_report: Any) -> None:  # after the refit: the engine generates again
        (engine,) = observed["engines"]
        health = ray.get(engine.health.remote())
        after_step.update(
            released=health.memory_released,
            rss=rss_bytes(observed["sampler"].pids["engine"]),
            weights=ray.get(engine.__ray_call__.remote(_weight_bytes)),
        )

    result = run_module.train(cfg, run_dir=tmp_path / "run", on_step=on_step)
    assert result.completed_steps == 1
    weights, resident = after_step["weights"], after_step["rss"]
    assert not after_step["released"] and weights > 30 * 2**20

    # started released: the actor is built while the engine holds no weights
    released_at_build, rss_at_build = observed["at_actor_build"]
    assert released_at_build
    assert resident - rss_at_build >= RELEASED * weights, (resident, rss_at_build, weights)

    # while the actor trains, the engine's RSS stays low throughout
    windows = [(m, t0, t1) for m, t0, t1 in observed["windows"] if m in TRAINING]
    assert {m for m, _, _ in windows} == set(TRAINING), observed["windows"]
    rows = observed["sampler"].rows
    for method, t0, t1 in windows:
        during = [row["engine"] for t, row in rows if t0 <= t <= t1]
        assert during, (method, t0, t1)
        print(
            f"actor {method}: engine RSS {max(during) / 2**20:.0f} MiB at most, "
            f"{resident / 2**20:.0f} MiB resident, weights {weights / 2**20:.0f} MiB"
        )
        assert resident - max(during) >= RELEASED * weights, (method, max(during), resident)
