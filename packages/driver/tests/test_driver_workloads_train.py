"""``ppo-driver train`` on a user's own workload, through the real command line.

One ``python -m ppo_driver.cli train`` process (its own local Ray cluster) trains the
tiny Hugging Face model of ``workload_testlib`` (its own BPE tokenizer and chat
template) on JSONL prompts with a reward from a plain Python file, streaming, for 3
steps, and evaluates the held-out prompts greedily every 2 steps (and after the last).
Only what the run writes is read: ``metrics.jsonl`` and its stderr.

``slow``: one process start (Ray, three model builds, engines) is most of a minute on
the 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workload_testlib import make_workload, workload_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_STEPS = 3
EVAL_EVERY = 2
OVERRIDES = [
    f"run.num_steps={NUM_STEPS}",
    "run.checkpoint_every=0",
    "ppo.num_prompts_per_step=4",
    "ppo.num_generations_per_prompt=2",
    "ppo.critic_mini_batch_size=8",
    "async_rl.min_groups_for_streaming_train=2",  # streaming: up to 2 chunks per step
    "async_rl.sampler.max_lookahead_versions=0",
    "rollout.max_new_tokens=8",
    "rollout.decode_delay_s=0.02",
    "rollout.apply_chat_template=true",
]


def test_cli_trains_a_user_workload_and_evaluates_it(tmp_path: Path) -> None:
    files = make_workload(tmp_path / "workload")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--no-progress", *workload_overrides(files, eval_every=EVAL_EVERY), *OVERRIDES]
    env = {k: v for k, v in os.environ.items() if k != "PPO_DRIVER_FAIL_AT"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> exit {proc.returncode}\n{proc.stderr[-6000:]}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(NUM_STEPS))  # every step once
    for row in rows:
        done = row["step"] + 1
        # the engine generated with the weights the trainer computes log-probs with
        # (the HF checkpoint at first, then each step's refit)
        assert abs(row["rollout/kl_engine_trainer"]) < 1e-6, row
        # every record reached the reward (it reads record["answer"]): no group failed
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0
        due = done % EVAL_EVERY == 0 or done == NUM_STEPS
        assert ("eval/reward_mean" in row) == due, row
        if due:
            assert row["eval/prompts"] == 6 and row["eval/reward_failures"] == 0
            assert 0.0 <= row["eval/reward_mean"] <= 1.0 and math.isfinite(row["eval/reward_mean"])
            assert row["eval/weight_version"] == done  # the policy this step trained
    assert f"eval after step {EVAL_EVERY}: reward mean" in proc.stderr
