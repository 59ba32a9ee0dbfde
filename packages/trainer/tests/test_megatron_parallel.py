"""The megatron backend with two ranks (gloo on CPU): tensor parallel 2, pipeline parallel
2, and data parallel 2 with the distributed optimizer, each against one process.

Plain data parallel 2 (classic DDP) runs in the contract suite
(``test_contract.py::test_two_data_parallel_ranks_match_single_process[megatron]``).
Both ranks run every layout in turn in one pair of spawned processes (megatron's
``parallel_state`` is re-initialised between layouts), so megatron is imported twice,
not six times. The children are always joined; one that fails or hangs past 480 s
fails the test and both are terminated. Tolerances as in ``test_megatron_backend.py``: log-probs ``atol=1e-5``,
weights after one Adam step ``atol=2e-5``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from ppo_trainer import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ModelSpec,
    loss_denominator,
)
from safetensors.torch import load_file, save_file

pytest.importorskip("ppo_trainer.megatron", reason="needs the megatron extra")

SPEC = ModelSpec(seed=7)
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2-distopt": {"optimizer": {"use_distributed_optimizer": True}},
}


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    b, t = 4, 12
    ids = torch.randint(1, SPEC.vocab_size, (b, t), generator=g)
    lengths = torch.tensor([12, 9, 11, 7])
    attn = (torch.arange(t)[None, :] < lengths[:, None]).long()
    loss_mask = attn.float()
    loss_mask[:, :3] = 0.0
    return {
        "input_ids": ids * attn,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "advantages": torch.randn(b, t, generator=g) * loss_mask,
        "returns": torch.randn(b, t, generator=g) * loss_mask,
    }


def _run(
    data: dict[str, torch.Tensor], rows: slice, options: dict[str, Any], **dist: Any
) -> dict[str, torch.Tensor]:
    """One actor step and one critic epoch on ``rows``; returns what the test compares."""
    shard = {k: v[rows] for k, v in data.items()}
    batch = {k: shard[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    den = loss_denominator(loss_mask=data["loss_mask"], loss_agg="token")
    actor = ActorWorker(
        ActorConfig(model=SPEC, backend="megatron", lr=1e-3, backend_options=options), **dist
    )
    logprobs = actor.compute_logprobs(batch)
    old = (logprobs - 0.1 * shard["advantages"]) * shard["loss_mask"]
    actor.backward(batch, old_logprobs=old, advantages=shard["advantages"], loss_denominator=den)
    stats = actor.finish_step()
    critic = CriticWorker(
        CriticConfig(model=SPEC, backend="megatron", lr=1e-3, backend_options=options), **dist
    )
    values = critic.compute_values(batch)
    critic.train(
        batch,
        returns=shard["returns"],
        old_values=values,
        epochs=1,
        mini_batch_size=rows.stop - rows.start,
    )
    out = {f"actor.{k}": v for k, v in actor.export_weights().items()}
    out |= {f"critic.{k}": v for k, v in critic.export_weights().items()}
    out |= {
        "logprobs": logprobs,
        "values": values,
        "grad_norm": torch.tensor(stats["actor/grad_norm"]),
    }
    return out


def _rank_main(rank: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a small CPU machine
    from megatron.core import parallel_state as ps

    data = _data()
    for name, options in LAYOUTS.items():
        dp = "dp2" in name
        rows = slice(2 * rank, 2 * rank + 2) if dp else slice(0, 4)
        out = _run(data, rows, options, rank=rank, world_size=2, dist_init_method=init)
        save_file({k: v.contiguous() for k, v in out.items()}, f"{out_dir}/{name}.{rank}.st")
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron2")
    context = mp.start_processes(
        _rank_main,
        args=(f"file://{out / 'pg'}", str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 480.0
    try:
        # join() re-raises a child's exception (and then terminates the other child)
        while not context.join(timeout=5.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the two megatron ranks did not finish within 480 s")
    finally:
        for process in context.processes:  # never leave a rank behind (hang, failure)
            if process.is_alive():
                process.terminate()
            process.join()
    return out


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    data = _data()
    return _run(data, slice(0, 4), {})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process(
    layout: str, two_rank_results: Path, single: dict[str, torch.Tensor]
) -> None:
    ranks = [load_file(str(two_rank_results / f"{layout}.{r}.st")) for r in (0, 1)]
    for rank, got in enumerate(ranks):
        rows = slice(2 * rank, 2 * rank + 2) if "dp2" in layout else slice(0, 4)
        torch.testing.assert_close(got["logprobs"], single["logprobs"][rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["values"], single["values"][rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["grad_norm"], single["grad_norm"], atol=1e-5, rtol=1e-5)
        weights = [k for k in single if k.startswith(("actor.", "critic."))]
        assert sorted(weights) == sorted(k for k in got if k.startswith(("actor.", "critic.")))
        for name in weights:
            torch.testing.assert_close(got[name], single[name], atol=2e-5, rtol=0, msg=name)
