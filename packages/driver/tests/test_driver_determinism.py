"""Same seed + same config + same mode -> the same run: identical rewards in
``metrics.jsonl`` and a bitwise identical final actor and critic (weights, Adam moments,
step counts, scheduler), full-batch and streaming, one and two data-parallel ranks.

Each row trains the same config twice on one local Ray cluster and compares:

* every step's ``rollout/reward_mean``, ``rollout/reward_max`` and
  ``rollout/response_len_mean`` in ``metrics.jsonl``, exactly;
* every file of the final checkpoint's ``actor/`` and ``critic/`` (all ranks), byte for
  byte (the manifest's sha256); a difference names the tensors that differ and by how
  much. The driver's own part of the checkpoint (``driver.json``, ``tensors.safetensors``)
  is not compared: it holds the replay rows the NEXT step had already generated when the
  checkpoint was taken, which depends on timing and not on the training.

What makes a run reproducible: per-sample sampling seeds (``sample_seed``), generation
whose every row is bitwise independent of the rows sharing its batch (the embedded
engine, tested in ``test_rollout_units.py``), and a training batch whose rows are in the
same order in every run. The last one is what failed: the replay buffer built each
chunk's rows in the order the groups ARRIVED from the engine (the sampler's claim order),
so two runs summed the same per-sample gradients in different orders; float32 addition
is not associative, the weights differed in their last bits after the first update
(grad norm ~1e-7 apart), and a few steps later a sampled token flipped and the runs went
apart. Fixed by claiming every chunk's groups in prompt-index order
(``RolloutManager.claim``).

Streaming: with ``async_rl.deterministic_chunks=false`` a chunk is whatever is ready when
the pump polls, so where a chunk boundary falls depends on when groups finish, i.e. on
timing, and the boundaries change the update (the per-chunk gradients are summed in
another grouping): two such runs agree only while their steps were cut alike.
``async_rl.deterministic_chunks=true`` (the default) cuts every step at fixed positions
of its dispatch order (``ppo_sampler.fixed_chunk_sizes``: here 8 groups, minimum 2 ->
four blocks of 2) and trains a block once all its groups are done, in order, the blocks
that are ready together in one chunk, each its own micro-batch. The streaming
rows use it and make timing differ on purpose: the second run generates at another pace
(``rollout.decode_delay_s`` 0.15 s vs 0.05 s per decode step: the same samples, finished
at other times, in other waves), and still both runs must match exactly, every step and
the final checkpoints. The second streaming run also asks for every block that is ready
in one chunk (``async_rl.merge_ready_blocks``, the default) where the first trains one
block per chunk: that must change no bit either, with one data-parallel rank or two (each
rank gets its share of every block; the last test here forces the merge on two ranks).
The full-batch rows get the same change of pace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from driver_testlib import TINY_MODELS
from ppo_driver.config import load_config
from ppo_driver.run import train
from safetensors.torch import load_file

pytestmark = pytest.mark.timeout(1800)

TINY = [
    "run.progress=false",
    "run.checkpoint_every=0",  # one checkpoint, at the end
    "ppo.num_prompts_per_step=8",
    "ppo.num_generations_per_prompt=4",
    "ppo.critic_mini_batch_size=16",
    "async_rl.sampler.max_lookahead_versions=0",
    *TINY_MODELS,
]
FULL_BATCH = ["async_rl.min_groups_for_streaming_train=8", "ppo.ppo_epochs=2"]
STREAMING = [
    "async_rl.min_groups_for_streaming_train=2",
    "async_rl.deterministic_chunks=true",
    "rollout.max_new_tokens=8",
]
# The two runs' generation paces (seconds per decode step): a step's groups finish over
# about a second in the first run, a third of it in the second, in waves (a group
# finishes at the decode step of its longest sample), so arrival-driven cuts would differ.
PACES = ("rollout.decode_delay_s=0.15", "rollout.decode_delay_s=0.05")
COMPARED = ("rollout/reward_mean", "rollout/reward_max", "rollout/response_len_mean")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    from ppo_placement import shutdown_local_ray, start_local_ray

    start_local_ray(num_gpus=3, num_cpus=6)  # two actor ranks + one engine, logical GPUs
    yield
    shutdown_local_ray()


def _train(run_dir: Path, overrides: list[str]) -> list[dict[str, object]]:
    cfg, _ = load_config(None, [*TINY, *overrides])
    train(cfg, run_dir=run_dir, keep_ray=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _model_files(run_dir: Path, steps: int) -> dict[str, str]:
    """sha256 of every actor and critic file of the final checkpoint (from its manifest)."""
    ckpt = run_dir / "checkpoints" / f"step_{steps:06d}"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    return {
        name: entry["sha256"]
        for name, entry in files.items()
        if name.startswith(("actor/", "critic/"))
    }


def _describe(a: Path, b: Path, steps: int, names: list[str]) -> str:
    """Which tensors differ, and by how much (for the failure message)."""
    out = []
    for name in names:
        if not name.endswith(".safetensors"):
            out.append(f"{name}: contents differ")
            continue
        ta = load_file(str(a / "checkpoints" / f"step_{steps:06d}" / name))
        tb = load_file(str(b / "checkpoints" / f"step_{steps:06d}" / name))
        for key in sorted(ta):
            if not torch.equal(ta[key], tb[key]):
                diff = (ta[key].double() - tb[key].double()).abs().max()
                out.append(f"{name} {key}: max |diff| {float(diff):.3g}")
    return "\n".join(out[:20])


def _assert_same_run(root: Path, overrides: list[str], steps: int, *, streaming: bool) -> None:
    a, b = root / "a", root / "b"
    # streaming: run a trains one block per chunk, run b every ready block in one chunk
    merge = ("async_rl.merge_ready_blocks=false", "async_rl.merge_ready_blocks=true")
    ra, rb = (
        _train(run, [*overrides, pace, *([m] if streaming else [])])
        for run, pace, m in zip((a, b), PACES, merge, strict=True)
    )
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(steps))
    chunks_a = [r["train/chunk_groups"] for r in ra]
    chunks_b = [r["train/chunk_groups"] for r in rb]
    # the fixed plan in every step of run a (several chunks: it does stream); run b's
    # chunks are whole blocks of it, as many as were ready together
    plan = [2, 2, 2, 2] if streaming else [8]
    assert chunks_a == [plan] * steps, chunks_a
    assert all(sum(c) == 8 and all(g % plan[0] == 0 for g in c) for c in chunks_b), chunks_b
    for key in COMPARED:
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    fa, fb = _model_files(a, steps), _model_files(b, steps)
    assert sorted(fa) == sorted(fb)
    differ = sorted(name for name in fa if fa[name] != fb[name])
    assert not differ, "final checkpoints differ:\n" + _describe(a, b, steps, differ)


def _rows() -> Iterator[object]:
    yield pytest.param(FULL_BATCH, 1, 3, id="full-batch-dp1")
    yield pytest.param(FULL_BATCH, 2, 3, id="full-batch-dp2", marks=pytest.mark.slow)
    yield pytest.param(STREAMING, 1, 3, id="streaming-dp1", marks=pytest.mark.slow)
    yield pytest.param(STREAMING, 2, 3, id="streaming-dp2", marks=pytest.mark.slow)


@pytest.mark.parametrize(("mode", "dp", "steps"), list(_rows()))
def test_same_seed_same_config_same_run(
    mode: list[str], dp: int, steps: int, tmp_path: Path
) -> None:
    overrides = [*mode, f"cluster.actor_gpus={dp}", f"run.num_steps={steps}", "run.seed=3"]
    _assert_same_run(tmp_path, overrides, steps, streaming=mode is STREAMING)


@pytest.mark.parametrize(
    "backend",
    ["torch", pytest.param("megatron", marks=pytest.mark.slow)],
)
def test_merged_blocks_leave_the_bits_of_one_block_per_chunk_on_two_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Two data-parallel ranks, fixed blocks of 2 groups, all 8 groups of a step sent
    to the engine in ONE call (``rollout.groups_per_call=8``), so they are all ready at
    once: with ``merge_ready_blocks`` every step is one chunk of the 4 blocks, without
    it 4 chunks of one block. Each rank gets its share of every block, in block order
    (``Rows(blocks=...)``), so both runs leave the same bits after two steps (actor and
    critic: parameters, Adam moments, steps). With the chunk split into one contiguous
    share per rank instead (what the driver did before), the merged run puts other
    rows on each rank and must come out different. The Megatron row (slow) runs both
    models on Megatron-core over gloo."""
    from driver_testlib import assert_identical_checkpoint
    from ppo_driver.workers import Rows, shard_rows

    megatron = [f"{m}.megatron_cfg.enabled=true" for m in ("policy", "critic")]
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    common = [
        *STREAMING,
        "cluster.actor_gpus=2",
        "run.num_steps=2",
        "rollout.groups_per_call=8",
        *(megatron if backend == "megatron" else []),
    ]
    runs = {
        "one block per chunk": "async_rl.merge_ready_blocks=false",
        "merged": "async_rl.merge_ready_blocks=true",
    }
    chunks = {
        name: [r["train/chunk_groups"] for r in _train(tmp_path / name, [*common, merge])]
        for name, merge in runs.items()
    }
    assert chunks == {"one block per chunk": [[2, 2, 2, 2]] * 2, "merged": [[8]] * 2}
    assert_identical_checkpoint(tmp_path / "one block per chunk", tmp_path / "merged", 2)

    monkeypatch.setattr(Rows, "split", lambda self, dp: shard_rows(self.size, dp))
    monkeypatch.setattr(Rows, "order", lambda self, dp: None)
    contiguous = tmp_path / "merged, contiguous shares"
    assert [r["train/chunk_groups"] for r in _train(contiguous, [*common, runs["merged"]])] == [
        [8]
    ] * 2
    with pytest.raises(AssertionError, match="differ"):
        assert_identical_checkpoint(tmp_path / "one block per chunk", contiguous, 2)


# One sample per prompt, so the groups' lengths differ (a group of 4 random samples
# nearly always runs to max_new_tokens) and the length order is not the prompt order.
BY_LENGTH = [
    "ppo.num_generations_per_prompt=1",
    "ppo.critic_mini_batch_size=4",
    "rollout.max_new_tokens=8",
    "run.num_steps=2",
    "run.seed=5",
]


def test_blocks_in_length_order_stream_early_and_equal_the_full_batch(tmp_path: Path) -> None:
    """Generation on devices of its own (a decode delay): ``deterministic_chunks`` and
    ``block_order`` null resolve to fixed blocks of 2 groups in the order of their
    longest response, each group placed once the engine reports that every group still
    out has drawn more tokens. So the blocks are the same whatever the pace: a run at
    0.05 s per decode step, one block per chunk, and a run at 0.15 s, every ready block
    in one chunk (and it streams: some step has several chunks), leave the same bits;
    a full batch with the blocks as micro-batches (rows in the same length order)
    leaves them too. A full batch in prompt order (``block_order=dispatch``) sums other
    micro-batches, and must differ."""
    from driver_testlib import assert_identical_checkpoint

    micro = [f"{m}.train_micro_batch_size=2" for m in ("policy", "critic")]
    runs = {
        "streamed": [
            "async_rl.min_groups_for_streaming_train=2",
            PACES[1],
            "async_rl.merge_ready_blocks=false",
        ],
        "streamed, slower, merged": ["async_rl.min_groups_for_streaming_train=2", PACES[0]],
        "full batch": ["async_rl.min_groups_for_streaming_train=8", PACES[1], *micro],
        "full batch, prompt order": [
            "async_rl.min_groups_for_streaming_train=8",
            PACES[1],
            *micro,
            "async_rl.block_order=dispatch",
            "async_rl.deterministic_chunks=true",
        ],
    }
    rows = {name: _train(tmp_path / name, [*BY_LENGTH, *o]) for name, o in runs.items()}
    lengths = [r["rollout/group_len_max"] for r in rows["streamed"]]
    assert any(step != sorted(step) for step in lengths), lengths  # not the prompt order
    assert [r["train/chunk_groups"] for r in rows["streamed"]] == [[2, 2, 2, 2]] * 2
    merged = [r["train/chunk_groups"] for r in rows["streamed, slower, merged"]]
    assert any(len(c) > 1 for c in merged), merged
    assert [r["train/chunk_groups"] for r in rows["full batch"]] == [[8]] * 2
    for name in ("streamed, slower, merged", "full batch"):
        for key in COMPARED:
            assert [r[key] for r in rows[name]] == [r[key] for r in rows["streamed"]], (name, key)
        assert_identical_checkpoint(tmp_path / "streamed", tmp_path / name, 2)
    with pytest.raises(AssertionError, match="differ"):
        assert_identical_checkpoint(tmp_path / "streamed", tmp_path / "full batch, prompt order", 2)
