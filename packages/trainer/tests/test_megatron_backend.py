"""The megatron backend in one process (world size 1, gloo, CPU shim when no CUDA).

Needs the ``megatron`` extra (``uv sync --extra megatron``); skipped without it.
Tolerances: float32 everywhere, each derived from what is compared (trainer_testlib):
logits / values of megatron-core vs transformers within ``rounding_bound`` over the
forward chain and the head's magnitude; gradients of chunked vs full-batch runs (or of
the two backends) within the gradient bound; weights after one Adam step within
``adam_step_bound``; the same computation repeated (checkpoint restore) bit for bit.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

mg = pytest.importorskip("ppo_trainer.megatron", reason="needs the megatron extra")

from ppo_lifecycle import KEEP_GRADIENTS  # noqa: E402
from ppo_trainer import (  # noqa: E402
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ModelSpec,
    get_backend,
    loss_denominator,
)
from ppo_trainer._torch_backend import build_causal_lm, build_value_model  # noqa: E402
from ppo_trainer.megatron import _convert  # noqa: E402
from ppo_trainer.megatron._build import _layout  # noqa: E402
from trainer_testlib import (  # noqa: E402
    adam_step_bound,
    assert_within,
    grad_bounds,
    head_magnitude,
    hf_named,
    model_terms,
    rounding_bound,
)

SPEC = ModelSpec(seed=3)  # Qwen2: 2 layers, hidden 64, 4 heads, 2 kv heads, vocab 128


def _forward_bound(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Megatron-core vs transformers on the same weights: rounding along the forward chain,
    relative to the head's magnitude."""
    b, t = batch["input_ids"].shape
    terms = model_terms(SPEC, tokens=b * t, seq_len=t, backward=False)
    return rounding_bound(terms=terms, magnitude=head_magnitude(model, batch))


def _step_terms(batch: dict[str, torch.Tensor]) -> int:
    b, t = batch["input_ids"].shape
    return model_terms(SPEC, tokens=b * t, seq_len=t)


def _batch(seed: int = 0, b: int = 4, t: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SPEC.vocab_size, (b, t), generator=g)
    lengths = torch.tensor([t, t - 2, t - 1, t - 3][:b])
    attn = (torch.arange(t)[None, :] < lengths[:, None]).long()
    ids = ids * attn  # right padding with pad id 0
    loss_mask = attn.float()
    loss_mask[:, :4] = 0.0  # prompt of 4 tokens
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask}


def _rows(batch: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {k: v[lo:hi] for k, v in batch.items()}


# --- pure conversion ---------------------------------------------------------------------------


def _random_hf(
    lay: _convert.Layout, *, inter: int = 24, vocab: int = 16
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d = lay.hidden_size, lay.head_dim
    nq, nkv = lay.num_attention_heads * d, lay.num_key_value_heads * d

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    hf = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": r(h)}
    for i in range(lay.num_layers):
        p = f"model.layers.{i}."
        hf |= {
            p + "input_layernorm.weight": r(h),
            p + "post_attention_layernorm.weight": r(h),
            p + "self_attn.q_proj.weight": r(nq, h),
            p + "self_attn.k_proj.weight": r(nkv, h),
            p + "self_attn.v_proj.weight": r(nkv, h),
            p + "self_attn.o_proj.weight": r(h, nq),
            p + "mlp.gate_proj.weight": r(inter, h),
            p + "mlp.up_proj.weight": r(inter, h),
            p + "mlp.down_proj.weight": r(h, inter),
        }
        if lay.qkv_bias:
            hf |= {
                p + "self_attn.q_proj.bias": r(nq),
                p + "self_attn.k_proj.bias": r(nkv),
                p + "self_attn.v_proj.bias": r(nkv),
            }
    if lay.critic:
        hf |= {"score.weight": r(1, h), "score.bias": r(1)}
    else:
        hf["lm_head.weight"] = (
            hf["model.embed_tokens.weight"] if lay.tie_word_embeddings else r(vocab, h)
        )
    return hf


LAYOUTS = [
    pytest.param(dict(qkv_bias=True), id="qwen2"),
    pytest.param(dict(qkv_bias=False), id="llama"),
    pytest.param(dict(qkv_bias=True, te_norm_names=True), id="qwen2-te-names"),
    pytest.param(dict(qkv_bias=False, tie_word_embeddings=True), id="llama-tied"),
    pytest.param(dict(qkv_bias=True, critic=True), id="critic"),
]


@pytest.mark.parametrize("extra", LAYOUTS)
def test_hf_megatron_hf_round_trip_is_exact(extra: dict[str, bool]) -> None:
    lay = _convert.Layout(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **extra
    )
    hf = _random_hf(lay)
    meg = _convert.hf_to_megatron(hf, lay)
    back = _convert.megatron_to_hf(meg, lay)
    assert set(back) == set(hf)
    for name, value in hf.items():
        assert torch.equal(back[name], value), name
    if lay.te_norm_names:
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in meg


def test_qkv_is_grouped_by_key_value_head() -> None:
    # 4 query heads, 2 kv groups, head_dim 2: rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    lay = _convert.Layout(
        num_layers=1, hidden_size=8, num_attention_heads=4, num_key_value_heads=2, qkv_bias=True
    )
    hf = _random_hf(lay)
    qkv = _convert.hf_to_megatron(hf, lay)["decoder.layers.0.self_attention.linear_qkv.bias"]
    q = hf["model.layers.0.self_attn.q_proj.bias"].view(4, 2)
    k = hf["model.layers.0.self_attn.k_proj.bias"].view(2, 2)
    v = hf["model.layers.0.self_attn.v_proj.bias"].view(2, 2)
    expected = torch.cat([q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]])
    assert torch.equal(qkv, expected)


def test_tensor_parallel_shards_round_trip() -> None:
    lay = _convert.Layout(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, qkv_bias=True
    )
    meg = _convert.hf_to_megatron(_random_hf(lay), lay)
    for name, full in meg.items():
        shards = [_convert.shard(name, full, rank=r, size=2) for r in range(2)]
        assert torch.equal(_convert.unshard(name, shards), full), name
        # what the pipeline stages announce before they broadcast a gathered tensor
        assert _convert.full_shape(name, tuple(shards[0].shape), size=2) == full.shape, name
    # the critic's value head is replicated, the policy's output layer vocab-parallel
    assert _convert.full_shape("output_layer.weight", (1, 16), size=2, critic=True) == (1, 16)
    assert _convert.full_shape("output_layer.weight", (8, 16), size=2) == (16, 16)
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    rank1 = _convert.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, rank=1, size=2)
    assert torch.equal(rank1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert _convert.local_name("decoder.layers.3.mlp.linear_fc2.weight", offset=2) == (
        "decoder.layers.1.mlp.linear_fc2.weight"
    )


# --- set-up rejections -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "key"),
    [
        pytest.param(
            {"use_megatron_fsdp": True}, "policy.megatron_cfg.use_megatron_fsdp", id="fsdp"
        ),
        pytest.param(
            {
                "fp8_param": True,
                "fp8_recipe": "mxfp8",
                "optimizer": {"use_distributed_optimizer": True},
            },
            "policy.megatron_cfg.optimizer.use_distributed_optimizer",
            id="mxfp8-distopt",
        ),
        pytest.param(
            {"optimizer": {"overlap_param_gather": True}},
            "policy.megatron_cfg.optimizer.overlap_param_gather",
            id="overlap-param-gather",
        ),
        pytest.param(
            {"optimizer": {"overlap_param_gather": True, "use_distributed_optimizer": True}},
            "policy.megatron_cfg.optimizer.overlap_param_gather",
            id="overlap-param-gather-distopt",
        ),
        pytest.param(
            {"tensor_model_parallel_size": 0},
            "policy.megatron_cfg.tensor_model_parallel_size",
            id="tp0",
        ),
        pytest.param(
            {"sequence_parallel": True}, "policy.megatron_cfg.sequence_parallel", id="unknown"
        ),
        pytest.param(
            {"tensor_model_parallel_size": 3},
            "policy.megatron_cfg.tensor_model_parallel_size",
            id="tp3-world1",
        ),
    ],
)
def test_set_up_rejects(options: dict[str, object], key: str) -> None:
    config = ActorConfig(model=SPEC, backend="megatron", backend_options=options)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        get_backend("megatron")(config=config, rank=0, world_size=1, dist_init_method=None)


def test_critic_rejections_name_the_critic_key() -> None:
    config = CriticConfig(
        model=SPEC, backend="megatron", backend_options={"use_megatron_fsdp": True}
    )
    with pytest.raises(ValueError, match=r"critic\.megatron_cfg\.use_megatron_fsdp"):
        get_backend("megatron")(config=config, rank=0, world_size=1, dist_init_method=None)


def test_fp8_parameters_are_refused_whatever_the_optimizer() -> None:
    """Not supported yet (TE's FP8 matmuls need token counts in multiples of 8, FP8
    weights do not sleep, the export would ship TE's quantized tensors): refused with
    the distributed optimizer or without, where MXFP8 with it is refused for the
    streaming document's reason as well."""
    for optimizer in ({}, {"use_distributed_optimizer": True}):
        options = {"fp8_param": True, "fp8_recipe": "tensorwise", "optimizer": optimizer}
        with pytest.raises(ValueError, match=r"policy\.megatron_cfg\.fp8_param.*not supported"):
            mg.parse_options(options, role="policy")


def test_fp8_recipe_is_handed_to_megatron_in_its_lowercase_spelling() -> None:
    """The rules accept a recipe in any case (``Delayed``); megatron-core compares its
    lowercase names, so the parsed options carry those."""
    assert mg.parse_options({"fp8_recipe": "Delayed"}, role="policy").fp8_recipe == "delayed"
    assert mg.parse_options({}, role="policy").fp8_recipe is None


# --- the real GPTModel vs transformers ----------------------------------------------------------


@pytest.fixture(scope="module")
def backend() -> object:
    return get_backend("megatron")(
        config=ActorConfig(model=SPEC, backend="megatron"),
        rank=0,
        world_size=1,
        dist_init_method=None,
    )


def test_hf_megatron_hf_gives_same_weights_and_logits(backend: object) -> None:
    policy = backend.build_policy()  # type: ignore[attr-defined]
    assert type(policy.gpt).__name__ == "GPTModel"
    hf = build_causal_lm(SPEC)
    exported = policy.export_hf()
    hf_state = hf.state_dict()
    assert set(exported) == set(hf_state)
    for name, value in hf_state.items():
        assert torch.equal(exported[name], value), name
    batch = _batch()
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    (logits,) = policy.forward([batch], fn=lambda out, mb: out)
    assert logits.shape == (4, 10, SPEC.vocab_size)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real], ref[real], atol=_forward_bound(hf, batch), rtol=0)
    # load_hf is the inverse: loading perturbed weights exports them unchanged
    perturbed = {k: v + 0.01 for k, v in hf_state.items()}
    policy.load_hf(perturbed)
    again = policy.export_hf()
    for name, value in perturbed.items():
        torch.testing.assert_close(again[name], value, atol=0, rtol=0)


def test_critic_is_gpt_model_with_value_head(backend: object) -> None:
    critic_backend = get_backend("megatron")(
        config=CriticConfig(model=SPEC, backend="megatron"),
        rank=0,
        world_size=1,
        dist_init_method=None,
    )
    critic = critic_backend.build_critic()
    assert type(critic.gpt.output_layer).__name__ == "ValueHead"
    hf = build_value_model(SPEC)
    batch = _batch(1)
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    (values,) = critic.forward([batch], fn=lambda out, mb: out)
    real = batch["attention_mask"].bool()
    bound = _forward_bound(hf, batch)
    torch.testing.assert_close(values[real], ref.squeeze(-1)[real], atol=bound, rtol=0)
    exported = critic.export_hf()
    assert set(exported) == set(hf.state_dict())


# --- workers on the megatron backend ------------------------------------------------------------


def _actor(**kw: object) -> ActorWorker:
    return ActorWorker(
        ActorConfig(model=SPEC, backend="megatron", lr=1e-3, micro_batch_size=2, **kw)
    )


def _actor_step(
    actor: ActorWorker, chunks: list[dict[str, torch.Tensor]], full: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``train_chunk`` per chunk; returns the accumulated gradients and their magnitude (the
    sum of the chunks' absolute contributions), both under HF names."""
    old = actor.compute_logprobs(full)
    adv = torch.linspace(-1.0, 1.0, full["input_ids"].numel()).view_as(old) * full["loss_mask"]
    denom = loss_denominator(loss_mask=full["loss_mask"], loss_agg="token")
    grads: dict[str, torch.Tensor] = {}
    magnitude: dict[str, torch.Tensor] = {}
    lo = 0
    for chunk in chunks:
        n = chunk["input_ids"].shape[0]
        actor.train_chunk(
            chunk,
            old_logprobs=old[lo : lo + n],
            advantages=adv[lo : lo + n],
            loss_denominator=denom,
        )
        lo += n
        now = hf_named(actor, actor.grads())
        for k, g in now.items():
            added = (g - grads[k]).abs() if k in grads else g.abs()
            magnitude[k] = magnitude[k] + added if k in magnitude else added
        grads = now
    return grads, magnitude


def test_chunked_training_equals_full_batch_and_survives_sleep() -> None:
    batch = _batch(2)
    full = _actor()
    full_grads, full_magnitude = _actor_step(full, [batch], batch)
    m_full = full.finish_step()

    chunked = _actor()
    old = chunked.compute_logprobs(batch)
    adv = torch.linspace(-1.0, 1.0, batch["input_ids"].numel()).view_as(old) * batch["loss_mask"]
    denom = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
    before = {k: torch.zeros_like(g) for k, g in full_grads.items()}
    magnitude = {k: torch.zeros_like(g) for k, g in full_grads.items()}
    for lo, hi in ((0, 1), (1, 4)):
        chunked.train_chunk(
            _rows(batch, lo, hi),
            old_logprobs=old[lo:hi],
            advantages=adv[lo:hi],
            loss_denominator=denom,
        )
        chunked.sleep(parts=KEEP_GRADIENTS)  # parameters + optimizer leave, gradients stay
        chunked.wake_up()
        now = hf_named(chunked, chunked.grads())
        magnitude = {k: magnitude[k] + (now[k] - before[k]).abs() for k in now}
        before = now
    grads = before
    assert any(g.abs().sum() > 0 for g in grads.values())
    # Chunks vs one batch: rounding only (gradient bound, magnitude of both runs).
    both = {k: torch.maximum(magnitude[k], full_magnitude[k]) for k in magnitude}
    bounds = grad_bounds(both, terms=_step_terms(batch))
    assert_within(grads, full_grads, bounds)
    chunked.finish_step()
    a, b = full.export_weights(), chunked.export_weights()
    start = build_causal_lm(SPEC).state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the step changed the weights
    # Adam divides each element by its own RMS: where a gradient is within rounding of 0
    # the update can differ by up to 2 * lr; elsewhere the bound is tight.
    moved = adam_step_bound(
        grads=full_grads,
        grad_bound=bounds,
        params=a,
        lr=m_full["actor/lr"],
        adam_eps=full.config.adam_eps,
        grad_norm=m_full["actor/grad_norm"],
        max_grad_norm=full.config.max_grad_norm,
    )
    assert_within(b, a, moved)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="classic"),
        pytest.param({"optimizer": {"use_distributed_optimizer": True}}, id="distopt"),
    ],
)
def test_checkpoint_round_trip(tmp_path: object, options: dict[str, object]) -> None:
    batch = _batch(4)
    actor = _actor(kl_loss_coef=0.1, backend_options=options)
    for _ in range(2):  # two steps, so the optimizer has state
        old = actor.compute_logprobs(batch)
        ref = actor.compute_ref_logprobs(batch)
        denom = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
        actor.train_chunk(
            batch,
            old_logprobs=old,
            advantages=batch["loss_mask"],
            ref_logprobs=ref,
            loss_denominator=denom,
        )
        actor.finish_step()
    actor.save_checkpoint(tmp_path)  # type: ignore[arg-type]
    other = _actor(kl_loss_coef=0.1, backend_options=options)
    other.load_checkpoint(tmp_path)  # type: ignore[arg-type]
    for name, value in actor.export_weights().items():
        assert torch.equal(other.export_weights()[name], value), name
    # the same next step from the restored state (optimizer moments included)
    for worker in (actor, other):
        old = worker.compute_logprobs(batch)
        ref = worker.compute_ref_logprobs(batch)
        denom = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
        worker.train_chunk(
            batch,
            old_logprobs=old,
            advantages=-batch["loss_mask"],
            ref_logprobs=ref,
            loss_denominator=denom,
        )
        worker.finish_step()
    a, b = actor.export_weights(), other.export_weights()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)


def test_critic_values_and_training() -> None:
    critic = CriticWorker(CriticConfig(model=SPEC, backend="megatron", lr=1e-3, micro_batch_size=2))
    batch = _batch(5)
    old_values = critic.compute_values(batch)
    assert old_values.shape == (4, 10)
    returns = old_values + batch["loss_mask"]
    before = critic.export_weights()
    critic.train(batch, returns=returns, old_values=old_values, epochs=2, mini_batch_size=2)
    after = critic.export_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    new_values = critic.compute_values(batch)
    mask = batch["loss_mask"].bool()
    # training moved the values toward the returns
    assert (new_values - returns)[mask].abs().mean() < (old_values - returns)[mask].abs().mean()


def test_one_step_matches_the_torch_backend() -> None:
    """Same spec, data and hyper-parameters (weight decay on every parameter, clipping,
    warm-up): megatron-core and transformers + torch AdamW land on the same weights."""
    batch = _batch(6)
    weights, grads, magnitude, metrics = {}, {}, {}, {}
    config: ActorConfig | None = None
    for name in ("torch", "megatron"):
        config = ActorConfig(
            model=SPEC,
            backend=name,
            device="cpu",
            lr=1e-3,
            weight_decay=0.1,
            max_grad_norm=0.5,
            warmup_steps=1,
            micro_batch_size=2,
        )
        actor = ActorWorker(config)
        chunks = [_rows(batch, 0, 3), _rows(batch, 3, 4)]
        grads[name], magnitude[name] = _actor_step(actor, chunks, batch)
        metrics[name] = actor.finish_step()
        weights[name] = actor.export_weights()
    assert config is not None
    # Two implementations of the same maths: rounding only.
    both = {
        k: torch.maximum(magnitude["torch"][k], magnitude["megatron"][k]) for k in grads["torch"]
    }
    bounds = grad_bounds(both, terms=_step_terms(batch))
    assert_within(grads["megatron"], grads["torch"], bounds)
    moved = adam_step_bound(
        grads=grads["torch"],
        grad_bound=bounds,
        params=weights["torch"],
        lr=metrics["torch"]["actor/lr"],
        adam_eps=config.adam_eps,
        grad_norm=metrics["torch"]["actor/grad_norm"],
        max_grad_norm=config.max_grad_norm,
    )
    assert metrics["megatron"]["actor/lr"] == metrics["torch"]["actor/lr"]
    assert_within(weights["megatron"], weights["torch"], moved)


# --- float16 loss scaling -----------------------------------------------------------------------


def _probable_bound(*, terms: int, magnitude: float, dtype: torch.dtype) -> float:
    """Two evaluations of one value in ``dtype`` over ``terms`` rounded terms: float16's
    worst-case bound (``rounding_bound``) exceeds 1 for these models (``terms * u > 1``),
    so the probabilistic one (Higham & Mary 2019, Thm. 3.1): each side is within
    ``gamma(lam) = exp(lam * sqrt(n) * u + n * u**2 / (1 - u)) - 1`` relative, with
    probability at least ``1 - 2n exp(-lam**2 (1 - u)**2 / 2)``; lam = 6 gives ~1 - 4e-5
    for n ~ 1200."""
    u = torch.finfo(dtype).eps / 2
    gamma = math.exp(6.0 * math.sqrt(terms) * u + terms * u * u / (1 - u)) - 1
    return 2 * gamma * magnitude


def _one_step(dtype: str, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One Adam step of a bare policy model (no clipping, no weight decay): the weights
    before and after, the unscaled gradients, and the norms the model reported."""
    spec = ModelSpec(seed=3, dtype=dtype)
    config = ActorConfig(model=spec, backend="megatron", lr=1e-3, max_grad_norm=None)
    backend = get_backend("megatron")(config=config, rank=0, world_size=1, dist_init_method=None)
    model = backend.build_policy()
    before = model.export_hf()

    def loss_fn(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> Any:
        return (out.logsumexp(-1) * mb["loss_mask"]).sum() / mb["loss_mask"].sum(), {}

    model.zero_grad()
    model.forward_backward([batch], loss_fn=loss_fn)
    model.all_reduce_grads()
    scale = float(model.optimizer.get_loss_scale())
    grads = {k: g.double() / scale for k, g in model.grads().items()}
    norm = model.grad_norm()
    info = model.step()
    return {
        "before": before,
        "after": model.export_hf(),
        "grads": _convert.megatron_to_hf(grads, model.layout),
        "grad_norm": norm,
        "step": info,
        "scale": scale,
        "lr": config.lr,
        "eps": config.adam_eps,
    }


def test_float16_one_step_moves_the_weights_like_float32() -> None:
    """float16 scales the loss by megatron's loss scale before backward and reports the
    unscaled gradient norm; the Adam step then moves every weight as float32's does."""
    batch = _batch(7)
    f32, f16 = _one_step("float32", batch), _one_step("float16", batch)
    assert f16["scale"] > 1.0  # a dynamic loss scaler is in use
    terms = _step_terms(batch)
    norm32 = f32["step"]["grad_norm"]
    norm_tol = _probable_bound(terms=terms, magnitude=norm32, dtype=torch.float16)
    assert norm_tol < 0.5 * norm32  # the check can tell a wrongly scaled norm
    for got in (f16["grad_norm"], f16["step"]["grad_norm"]):
        assert abs(got - norm32) <= norm_tol, (got, norm32)
    # Per tensor, float16's gradients are within the probable bound of the tensor's
    # largest float32 gradient; Adam's first step is -lr * g / (|g| + eps), so where g is
    # clear of that bound both runs move by ~lr with its sign (adam_step_bound), plus
    # float16's rounding of the new weight (u16 * |w|, at least half a subnormal step).
    u16 = torch.finfo(torch.float16).eps / 2
    g32 = f32["grads"]
    bound = {
        k: torch.full_like(
            g,
            _probable_bound(terms=terms, magnitude=float(g.abs().max()), dtype=torch.float16),
        )
        for k, g in g32.items()
    }
    moved = adam_step_bound(
        grads=g32,
        grad_bound=bound,
        params=f32["after"],
        lr=f32["lr"],
        adam_eps=f32["eps"],
        grad_norm=norm32,
        max_grad_norm=None,
    )
    delta32 = {k: f32["after"][k].double() - f32["before"][k].double() for k in g32}
    delta16 = {k: f16["after"][k].double() - f16["before"][k].double() for k in g32}
    # (below float16's smallest normal the spacing is fixed: tiny * eps)
    tiny = torch.finfo(torch.float16).tiny
    limit = {k: moved[k] + u16 * f16["after"][k].double().abs().clamp(min=tiny) for k in g32}
    assert_within(delta16, delta32, limit)
    clear = sum(int((g.abs() > 2 * bound[k]).sum()) for k, g in g32.items())
    # the bound is tight (|delta16 - delta32| << lr) on enough elements to see a step
    # that does not move the weights (float16's unscaled loss moved them by ~1e-6)
    assert clear > 0.01 * sum(g.numel() for g in g32.values())


def test_float16_overflow_is_reported_and_backs_off_the_loss_scale() -> None:
    """Gradients that overflow float16 under the loss scale: the gradient norm reads inf
    (the worker refuses the step on every rank), the scale halves, and a direct step()
    raises instead of counting a skipped update as a step."""
    spec = ModelSpec(seed=3, dtype="float16")
    config = ActorConfig(model=spec, backend="megatron", lr=1e-3, max_grad_norm=None)
    backend = get_backend("megatron")(config=config, rank=0, world_size=1, dist_init_method=None)
    model = backend.build_policy()
    before = model.export_hf()
    scale = float(model.optimizer.get_loss_scale())
    batch = _batch(10)

    def huge(out: torch.Tensor, mb: dict[str, torch.Tensor]) -> Any:
        return 1e6 * out.logsumexp(-1).mean(), {}  # x 2**16: past float16's range

    model.zero_grad()
    model.forward_backward([batch], loss_fn=huge)
    model.all_reduce_grads()
    assert model.grad_norm() == float("inf")
    assert float(model.optimizer.get_loss_scale()) == scale / 2
    with pytest.raises(FloatingPointError, match="loss scale"):
        model.step()
    after = model.export_hf()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert model._steps == 0  # the scheduler did not advance
    # the next clean step trains normally at the lower scale
    model.forward_backward([batch], loss_fn=lambda out, mb: (out.logsumexp(-1).mean(), {}))
    model.all_reduce_grads()
    assert math.isfinite(model.grad_norm())
    model.step()
    assert model._steps == 1


# --- checkpoints: param groups and the loss scaler ---------------------------------------------


def _trained_actor(spec: ModelSpec, options: dict[str, object]) -> ActorWorker:
    actor = ActorWorker(
        ActorConfig(model=spec, backend="megatron", lr=1e-3, backend_options=options)
    )
    batch = _batch(8)
    old = actor.compute_logprobs(batch)
    denom = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
    actor.train_chunk(
        batch, old_logprobs=old, advantages=batch["loss_mask"], loss_denominator=denom
    )
    actor.finish_step()
    return actor


def _groups(actor: ActorWorker) -> list[dict[str, object]]:
    return [
        {k: v for k, v in g.items() if k != "params"}
        for inner in actor._policy._inner_optimizers()
        for g in inner.param_groups
    ]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="classic"),
        pytest.param({"optimizer": {"use_distributed_optimizer": True}}, id="distopt"),
    ],
)
def test_checkpoint_restores_param_groups_and_the_loss_scaler(
    tmp_path: object, options: dict[str, object]
) -> None:
    """A group-level step counter (TE's FusedAdam keeps Adam's step in
    ``param_group["step"]``, emulated here) and float16's dynamic loss scaler survive a
    checkpoint; a checkpoint without them (the earlier format) still loads."""
    spec = ModelSpec(seed=3, dtype="float16")
    actor = _trained_actor(spec, options)
    policy = actor._policy
    for i, inner in enumerate(policy._inner_optimizers()):
        for j, group in enumerate(inner.param_groups):
            group["step"] = torch.tensor(float(7 + i + j))  # as FusedAdam: a tensor
            group["betas"] = (0.8, 0.95)
    (scaler,) = [opt.grad_scaler for opt in policy.optimizer.chained_optimizers]
    scaler.update(True)  # halve the scale, reset the growth tracker
    scaler.update(False)  # one clean step since
    saved_scaler = scaler.state_dict()
    actor.save_checkpoint(tmp_path)  # type: ignore[arg-type]

    other = ActorWorker(
        ActorConfig(model=spec, backend="megatron", lr=1e-3, backend_options=options)
    )
    other.load_checkpoint(tmp_path)  # type: ignore[arg-type]
    want, got = _groups(actor), _groups(other)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(b[k], v), k  # type: ignore[arg-type]
            else:
                assert b[k] == v, k
    (restored,) = [opt.grad_scaler for opt in other._policy.optimizer.chained_optimizers]
    now = restored.state_dict()
    assert torch.equal(now["scale"].cpu(), saved_scaler["scale"].cpu())
    assert now["scale"] == scaler.scale and float(now["scale"]) < 2.0**16
    assert (now["growth_tracker"], now["hysteresis_tracker"]) == (
        saved_scaler["growth_tracker"],
        saved_scaler["hysteresis_tracker"],
    )

    # the format before param groups and the scaler were saved: loads as it did
    state = policy.checkpoint_state()
    for entry in state["optimizer"]:
        del entry["param_groups"], entry["grad_scaler"]
    fresh = ActorWorker(
        ActorConfig(model=spec, backend="megatron", lr=1e-3, backend_options=options)
    )
    fresh._policy.load_checkpoint_state(state)
    assert all("step" not in g for g in _groups(fresh))
    assert float(fresh._policy.optimizer.get_loss_scale()) == 2.0**16
    for name, value in actor.export_weights().items():
        assert torch.equal(fresh.export_weights()[name], value), name


class _GroupStepAdam(torch.optim.Optimizer):
    """Adam's counter kept as Transformer Engine's (and apex's) FusedAdam keeps it: one
    ``step`` per param group, none per parameter (the update itself is left out)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1e-3})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                state = self.state[p]
                assert "step" not in state, "a per-parameter counter in a fused optimizer"
                state.setdefault("exp_avg", torch.zeros_like(p))


def test_adams_step_counter_carries_between_torch_and_fused_optimizers() -> None:
    """megatron-core builds TE's FusedAdam where it imports (step per param group) and
    torch's AdamW otherwise (step per parameter): a checkpoint of one, restored into the
    other, keeps counting from its step, and torch's counter stays on the host."""
    from ppo_trainer.megatron._checkpoint import load_optimizer_state, optimizer_state

    def chained(inner: torch.optim.Optimizer) -> Any:
        return SimpleNamespace(optimizer=inner, grad_scaler=None)

    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]

    adamw = torch.optim.AdamW(params())
    for _ in range(3):
        for p in adamw.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        adamw.step()
    fused = _GroupStepAdam(params())
    fused.step()  # its own state exists: the restore replaces it
    load_optimizer_state([chained(fused)], optimizer_state([chained(adamw)]))
    assert [g["step"] for g in fused.param_groups] == [3]
    fused.step()  # no per-parameter counter left (asserted inside)
    assert fused.param_groups[0]["step"] == 4

    back = torch.optim.AdamW(params())
    load_optimizer_state([chained(back)], optimizer_state([chained(fused)]))
    for p in back.param_groups[0]["params"]:
        assert back.state[p]["step"].device.type == "cpu"
        assert float(back.state[p]["step"]) == 4.0
        p.grad = torch.ones_like(p)
    back.step()  # a missing counter raised KeyError: 'step' here
    assert all(float(s["step"]) == 5.0 for s in back.state.values())


# --- sleep: the fp32 main parameters -----------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="classic"),
        pytest.param({"optimizer": {"use_distributed_optimizer": True}}, id="distopt"),
    ],
)
def test_sleep_offloads_the_fp32_main_params(options: dict[str, object]) -> None:
    """bfloat16: the mixed-precision optimizer's fp32 main parameters leave the device
    with the optimizer (the host-copy backend empties their storages), and training
    after sleep / wake_up is bit for bit training without."""
    spec = ModelSpec(seed=3, dtype="bfloat16")
    slept, awake = _trained_actor(spec, options), _trained_actor(spec, options)
    mains = [
        p
        for inner in slept._policy._inner_optimizers()
        for g in inner.param_groups
        for p in g["params"]
    ]
    assert mains and all(p.dtype == torch.float32 for p in mains)
    slept.sleep()
    # every storage the inner optimizer steps is empty: its own (main params) or the
    # model's (the local spec's float32 RMSNorm weights are the model parameters)
    assert all(p.untyped_storage().nbytes() == 0 for p in mains)
    slept.wake_up()
    assert all(p.untyped_storage().nbytes() >= p.numel() * 4 for p in mains)
    for worker in (slept, awake):
        batch = _batch(9)
        old = worker.compute_logprobs(batch)
        denom = loss_denominator(loss_mask=batch["loss_mask"], loss_agg="token")
        worker.train_chunk(
            batch, old_logprobs=old, advantages=-batch["loss_mask"], loss_denominator=denom
        )
        worker.finish_step()
    a, b = awake.export_weights(), slept.export_weights()
    for name in a:
        assert torch.equal(b[name], a[name]), name


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
    ],
)
def test_a_llama_variant_the_backend_cannot_build_is_named(
    config: dict[str, Any], words: str
) -> None:
    hf = LlamaConfig(hidden_size=32, num_attention_heads=4, **config)
    assert [p for p in mg.model_config_problems(hf) if words in p]
    with pytest.raises(ValueError, match=words):
        _layout(hf, te=False, critic=False)
    assert mg.model_config_problems(LlamaConfig(hidden_size=32, num_attention_heads=4)) == []
