"""``ppo-driver train`` on a user's own workload, through the real command line.

``python -m ppo_driver.cli train`` (its own local Ray cluster) trains the tiny Hugging
Face model of ``workload_testlib`` (its own BPE tokenizer and chat template) on JSONL
prompts with a reward from a plain Python file, streaming (fixed chunks), for 2 steps, then
``--resume``s to 3, evaluating the held-out prompts greedily every 2 steps (and after
the last); the trained policy exported to ``<run>/hf/`` loads back with transformers.
Only what the runs write is read: ``metrics.jsonl``, ``hf/`` and their stderr.

``slow``: one process start (Ray, three model builds, engines) is most of a minute on
the 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from workload_testlib import make_workload, workload_overrides

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_STEPS = 3
EVAL_EVERY = 2
OVERRIDES = [
    "run.checkpoint_every=1",
    "ppo.num_prompts_per_step=4",
    "ppo.num_generations_per_prompt=2",
    "ppo.critic_mini_batch_size=8",
    "async_rl.min_groups_for_streaming_train=2",
    # fixed blocks of 2 groups: every step streams in exactly 2 chunks, whatever the load
    # (arrival-cut chunks could all be whole steps on a busy machine), and the resume
    # goes through the dispatch-order filing of groups held back at the checkpoint
    "async_rl.deterministic_chunks=true",
    "async_rl.merge_ready_blocks=false",
    "async_rl.sampler.max_lookahead_versions=0",
    "rollout.max_new_tokens=8",
    "rollout.decode_delay_s=0.02",
    "rollout.apply_chat_template=true",
]


def _train(run_dir: Path, files: dict[str, Path], *extra: str) -> str:
    cmd = [sys.executable, "-m", "ppo_driver.cli", "train", "--run-dir", str(run_dir)]
    cmd += ["--no-progress", *workload_overrides(files, eval_every=EVAL_EVERY), *OVERRIDES]
    cmd += list(extra)
    env = {k: v for k, v in os.environ.items() if k != "PPO_DRIVER_FAIL_AT"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> exit {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc.stderr


def test_cli_trains_a_user_workload_resumes_and_exports_it(tmp_path: Path) -> None:
    files = make_workload(tmp_path / "workload")
    run_dir = tmp_path / "run"
    first = _train(run_dir, files, f"run.num_steps={NUM_STEPS - 1}")
    # the same files written another way: the checkpoint's fingerprints say they are
    # the same inputs (before, --resume compared the strings and refused)
    respelled = tmp_path / "workload" / ".." / "workload"
    second = _train(
        run_dir,
        files,
        f"run.num_steps={NUM_STEPS}",
        f"policy.model_path={respelled / files['model'].name}",
        f"rollout.dataset_path={respelled / files['train'].name}",
        "--resume",
    )
    assert "resumed from step_000002" in second
    closing = [int(m) for m in re.findall(r"closing on (\d+) chunk", first + second)]
    assert closing == [2] * NUM_STEPS, closing  # streaming, in the fixed blocks

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
    assert f"eval after step {EVAL_EVERY}: reward mean" in first

    # the trained policy, exported at the end, loads back with transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = run_dir / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    ids = tokenizer("1+2=", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
