"""The megatron backend with two ranks (gloo on CPU): tensor parallel 2, pipeline parallel
2, and data parallel 2 with the distributed optimizer, each against one process; and a
tied-embedding model over two pipeline stages against transformers.

Plain data parallel 2 (classic DDP) runs in the contract suite
(``test_contract.py::test_two_data_parallel_ranks_match_single_process[megatron]``).
Both ranks run every layout in turn in one pair of spawned processes (megatron's
``parallel_state`` is re-initialised between layouts), so megatron is imported twice,
not six times. The children are always joined; one that fails or hangs past 480 s
fails the test and both are terminated. Tolerances derived as in the other suites
(trainer_testlib): log-probs and values within ``rounding_bound`` over the forward chain
and the head's magnitude; gradients (captured before the data-parallel reduction and
reassembled from the tensor / pipeline ranks) within the gradient bound; the gradient
norm within ``norm_bound``; weights after the one Adam step within ``adam_step_bound``.
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
    build_causal_lm,
    build_value_model,
    loss_denominator,
)
from safetensors.torch import load_file, save_file
from trainer_testlib import (
    adam_step_bound,
    assert_within,
    grad_bounds,
    head_magnitude,
    model_terms,
    norm_bound,
    rounding_bound,
)

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


def _capture_before_reduce(model: Any) -> dict[str, torch.Tensor]:
    """Record a megatron model's local gradients when the worker reduces them (the step's
    gradients before the data-parallel sum; megatron's global names, local TP slices)."""
    captured: dict[str, torch.Tensor] = {}
    reduce = model.all_reduce_grads

    def all_reduce_grads() -> None:
        captured.update(model.grads())
        reduce()

    model.all_reduce_grads = all_reduce_grads
    return captured


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
    actor_grads = _capture_before_reduce(actor._policy)  # test instrumentation
    logprobs = actor.compute_logprobs(batch)
    old = (logprobs - 0.1 * shard["advantages"]) * shard["loss_mask"]
    actor.train_chunk(batch, old_logprobs=old, advantages=shard["advantages"], loss_denominator=den)
    stats = actor.finish_step()
    critic = CriticWorker(
        CriticConfig(model=SPEC, backend="megatron", lr=1e-3, backend_options=options), **dist
    )
    critic_grads = _capture_before_reduce(critic._critic)
    values = critic.compute_values(batch)
    critic_stats = critic.train(
        batch,
        returns=shard["returns"],
        old_values=values,
        epochs=1,
        mini_batch_size=rows.stop - rows.start,
    )
    assert critic_stats["critic/optimizer_steps"] == 1  # one Adam step: adam_step_bound
    # export_weights is a collective: every rank calls it, rank 0 alone gets the weights;
    # each rank's own full copy (export_hf, the same collective) is test instrumentation.
    exported = actor.export_weights()
    weights = actor._policy.export_hf()
    rank = dist.get("rank", 0)
    assert (exported is None) == (rank != 0)
    if exported is not None:
        assert exported.keys() == weights.keys()
        assert all(torch.equal(exported[k], v) for k, v in weights.items())
    mesh = actor.mesh()
    assert mesh == critic.mesh()
    out = {f"actor.{k}": v for k, v in weights.items()}
    out |= {f"critic.{k}": v for k, v in critic.export_weights().items()}
    out |= {f"grad.actor.{k}": v for k, v in actor_grads.items()}
    out |= {f"grad.critic.{k}": v for k, v in critic_grads.items()}
    out |= {
        "logprobs": logprobs,
        "values": values,
        "grad_norm": torch.tensor(stats["actor/grad_norm"]),
        "critic_grad_norm": torch.tensor(critic_stats["critic/grad_norm"]),
        "mesh": torch.tensor(
            [
                mesh.rank,
                mesh.world_size,
                mesh.dp_rank,
                mesh.dp_size,
                mesh.tp_rank,
                mesh.tp_size,
                mesh.pp_rank,
                mesh.pp_size,
            ]
        ),
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
    _tied_rank(rank, init, out_dir)  # in the same processes: megatron is imported once
    ps.destroy_model_parallel()


def _spawn_two_ranks(main: Any, out: Path, *, timeout: float = 480.0) -> None:
    """``main(rank, init, out_dir)`` in two spawned ranks, always joined."""
    context = mp.start_processes(
        main,
        args=(f"file://{out / 'pg'}", str(out)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        # join() re-raises a child's exception (and then terminates the other child)
        while not context.join(timeout=5.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the two megatron ranks did not finish within {timeout} s")
    finally:
        for process in context.processes:  # never leave a rank behind (hang, failure)
            if process.is_alive():
                process.terminate()
            process.join()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron2")
    _spawn_two_ranks(_rank_main, out)
    return out


@pytest.fixture(scope="module")
def single() -> dict[str, torch.Tensor]:
    data = _data()
    return _run(data, slice(0, 4), {})


@pytest.fixture(scope="module")
def layouts() -> dict[str, Any]:
    """The megatron layouts of the actor and the critic (for the HF names of gradients)."""
    from ppo_trainer.megatron._build import _layout

    return {
        "actor": _layout(build_causal_lm(SPEC).config, te=False, critic=False),
        "critic": _layout(build_value_model(SPEC).config, te=False, critic=True),
    }


def _grads(out: dict[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    prefix = f"grad.{role}."
    return {k.removeprefix(prefix): v for k, v in out.items() if k.startswith(prefix)}


def _assemble(
    layout: str, ranks: list[dict[str, torch.Tensor]], role: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full megatron-named gradient of the two ranks, and its accumulated magnitude:
    data parallel sums the local gradients, tensor parallel concatenates the slices,
    pipeline parallel joins the stages."""
    from ppo_trainer.megatron import _convert

    local = [_grads(r, role) for r in ranks]
    critic = role == "critic"
    if "dp2" in layout:
        full = {k: local[0][k] + local[1][k] for k in local[0]}
        return full, {k: local[0][k].abs() + local[1][k].abs() for k in local[0]}
    if layout == "tp2":
        full = {
            k: _convert.unshard(k, [local[0][k], local[1][k]], critic=critic)
            if _convert.is_tensor_parallel(k, critic=critic)
            else local[0][k]
            for k in local[0]
        }
    else:
        assert not local[0].keys() & local[1].keys()  # two pipeline stages
        full = local[0] | local[1]
    return full, {k: v.abs() for k, v in full.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process(
    layout: str,
    two_rank_results: Path,
    single: dict[str, torch.Tensor],
    layouts: dict[str, Any],
) -> None:
    from ppo_trainer.megatron import _convert

    data = _data()
    b, t = data["input_ids"].shape
    batch = {k: data[k] for k in ("input_ids", "attention_mask")}
    forward_terms = model_terms(SPEC, tokens=b * t, seq_len=t, backward=False)
    # a log-prob z_y - logsumexp(z) carries twice the logits' error
    lp_bound = rounding_bound(
        terms=forward_terms, magnitude=2 * head_magnitude(build_causal_lm(SPEC), batch)
    )
    value_bound = rounding_bound(
        terms=forward_terms, magnitude=head_magnitude(build_value_model(SPEC), batch)
    )
    # +1: the sum over the two ranks (data parallel) or of two partial products (tensor
    # parallel row-parallel layers) adds a term
    step_terms = model_terms(SPEC, tokens=b * t, seq_len=t) + 1
    ranks = [load_file(str(two_rank_results / f"{layout}.{r}.st")) for r in (0, 1)]
    for rank, got in enumerate(ranks):
        # Mesh(rank, world_size, dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size) as
        # megatron's parallel_state lays out two ranks (tensor ranks adjacent)
        sizes = {"tp2": (1, 2, 1), "pp2": (1, 1, 2), "dp2-distopt": (2, 1, 1)}[layout]
        index = [rank if size == 2 else 0 for size in sizes]
        mesh = [rank, 2, index[0], sizes[0], index[1], sizes[1], index[2], sizes[2]]
        assert got["mesh"].tolist() == mesh
        rows = slice(2 * rank, 2 * rank + 2) if "dp2" in layout else slice(0, 4)
        torch.testing.assert_close(got["logprobs"], single["logprobs"][rows], atol=lp_bound, rtol=0)
        torch.testing.assert_close(got["values"], single["values"][rows], atol=value_bound, rtol=0)
    for role, norm_key in (("actor", "grad_norm"), ("critic", "critic_grad_norm")):
        lay = layouts[role]
        expected = _grads(single, role)
        got_grads, magnitude = _assemble(layout, ranks, role)
        assert got_grads.keys() == expected.keys()
        both = {k: torch.maximum(magnitude[k], expected[k].abs()) for k in expected}
        bounds = grad_bounds(both, terms=step_terms)
        assert_within(got_grads, expected, bounds)
        grads_hf = _convert.megatron_to_hf(expected, lay)
        bounds_hf = _convert.megatron_to_hf(bounds, lay)
        norm = float(single[norm_key])
        config = ActorConfig(model=SPEC, backend="megatron", lr=1e-3)  # what _run trains with
        weights = {
            k.removeprefix(f"{role}."): v for k, v in single.items() if k.startswith(f"{role}.")
        }
        moved = adam_step_bound(
            grads=grads_hf,
            grad_bound=bounds_hf,
            params=weights,
            lr=config.lr,
            adam_eps=config.adam_eps,
            grad_norm=norm,
            max_grad_norm=config.max_grad_norm,
        )
        for got in ranks:
            assert abs(float(got[norm_key]) - norm) <= norm_bound(grads_hf, bounds_hf)
            got_weights = {
                k.removeprefix(f"{role}."): v for k, v in got.items() if k.startswith(f"{role}.")
            }
            assert_within(got_weights, weights, moved)


# --- tied embeddings, pipeline parallel 2 ----------------------------------------------------

TIED = ModelSpec(seed=5, tie_word_embeddings=True)


def _own_logit(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per token (the shape the pipeline broadcasts): the logit of the token itself."""
    return out.gather(-1, mb["input_ids"].unsqueeze(-1)).squeeze(-1)


def _log_normaliser(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per token: the logsumexp over the vocabulary (every row of the tied output layer)."""
    return out.logsumexp(-1)


def _tied_rank(rank: int, init: str, out_dir: str) -> None:
    from ppo_trainer import get_backend

    config = ActorConfig(
        model=TIED,
        backend="megatron",
        lr=1e-3,
        backend_options={"pipeline_model_parallel_size": 2},
    )
    backend = get_backend("megatron")(config=config, rank=rank, world_size=2, dist_init_method=init)
    policy = backend.build_policy()  # load_hf: the last stage's output layer too
    loaded = policy.export_hf()
    data = _data()
    batch = {k: data[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    (own,) = policy.forward([batch], fn=_own_logit)
    (lse,) = policy.forward([batch], fn=_log_normaliser)

    def loss_fn(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> Any:
        loss = (out.logsumexp(-1) * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
        return loss, {}

    policy.zero_grad()
    policy.forward_backward([batch], loss_fn=loss_fn)
    policy.all_reduce_grads()
    policy.step()
    stepped = policy.export_hf()
    local = dict(policy._named_params())
    out = {f"loaded.{k}": v for k, v in loaded.items()}
    out |= {f"stepped.{k}": v for k, v in stepped.items()}
    out["own"], out["lse"] = own, lse
    if "output_layer.weight" in local:  # the last stage's own copy of the embedding
        out["output_layer"] = local["output_layer.weight"].detach().clone()
    save_file({k: v.contiguous() for k, v in out.items()}, f"{out_dir}/tied.{rank}.st")


def test_tied_embeddings_with_two_pipeline_stages(two_rank_results: Path) -> None:
    """A tied model split over two pipeline stages: the last stage's separate output layer
    is loaded from the HF embedding, export gives exactly the HF weights (no second
    lm_head), the logits match transformers on the same weights, and after one step the
    output layer still equals the (updated) embedding."""
    ranks = [load_file(str(two_rank_results / f"tied.{r}.st")) for r in (0, 1)]
    hf = build_causal_lm(TIED)
    hf_state = hf.state_dict()
    data = _data()
    batch = {k: data[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = hf(**batch).logits
    b, t = batch["input_ids"].shape
    terms = model_terms(TIED, tokens=b * t, seq_len=t, backward=False)
    # the log-normaliser carries the logits' error (its softmax weights sum to 1)
    bound = rounding_bound(terms=terms, magnitude=head_magnitude(hf, batch))
    real = batch["attention_mask"].bool()
    for got in ranks:
        loaded = {k.removeprefix("loaded."): v for k, v in got.items() if k.startswith("loaded.")}
        assert loaded.keys() == hf_state.keys()  # exactly the HF keys
        for name, value in hf_state.items():
            assert torch.equal(loaded[name], value), name
        for key, fn in (("own", _own_logit), ("lse", _log_normaliser)):
            expected = fn(logits, batch)
            torch.testing.assert_close(got[key][real], expected[real], atol=bound, rtol=0)
    assert "output_layer" in ranks[1] and "output_layer" not in ranks[0]
    stepped = {k.removeprefix("stepped."): v for k, v in ranks[1].items() if "stepped." in k}
    embedding = stepped["model.embed_tokens.weight"]  # gathered from the first stage
    assert not torch.equal(embedding, hf_state["model.embed_tokens.weight"])  # it moved
    # both copies got the same summed gradient and the same Adam update: bit for bit
    assert torch.equal(ranks[1]["output_layer"], embedding)
