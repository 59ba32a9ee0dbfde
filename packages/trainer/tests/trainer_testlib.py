"""Test helpers of ppo-trainer: tiny model spec, configs per backend, random PPO batches,
and the float tolerances the equivalence tests derive from what they compare.

(A uniquely named module, not ``conftest``: the packages' tests are collected together.)

Tolerances. Two computations of the same value that differ only in rounding (another
summation order: chunks vs one batch, another kernel, another rank layout) agree to a
bound that follows from the float format, the number of rounded terms accumulated and
their magnitude, never to a constant that happened to hold on one CPU:

* ``rounding_bound``: the classical bound for a sum of ``n`` rounded terms (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4):
  ``|fl(sum) - sum| <= gamma_n * sum|a_i|``, ``gamma_n = n*u / (1 - n*u) <= n*eps`` for
  ``n*u <= 1/2`` (``u = eps/2``). Two such evaluations differ by at most twice that.
* ``model_terms``: for a model's gradients, logits or values, ``n`` is the longest chain
  of accumulations (first-order error model: the errors of successive products add; the
  tiny randomly initialised models are well conditioned). It is ~600-1000 here while
  the differences seen are 1-3 ``eps * magnitude``, so the bound does not depend on a
  CPU's summation order, and it is still 100x below what a real defect moves (a wrong
  denominator or a dropped chunk changes gradients by >= 1e-2 relative).
* ``adam_step_bound``: weights after an Adam step. Adam divides every element by its
  own RMS, so an element whose gradient is within rounding of 0 may move by anything up
  to ``2 * lr``; the bound is per element, from the gradient bound (see there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ppo_trainer import ActorConfig, CriticConfig, ModelSpec

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 ~ 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2**-52 ~ 2.22e-16


def rounding_bound(*, terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Largest ``|a - b|`` for two evaluations in ``dtype`` of one value that accumulate at
    most ``terms`` rounded terms whose absolute values sum to at most ``magnitude``:
    ``2 * gamma_terms * magnitude <= 2 * terms * eps * magnitude`` (module docstring)."""
    eps = torch.finfo(dtype).eps
    if not terms * eps / 2 <= 0.5:
        raise ValueError(f"terms={terms} is too many for {dtype}: the bound needs n*u <= 1/2")
    return 2.0 * terms * eps * float(magnitude)


def model_terms(spec: ModelSpec, *, tokens: int, seq_len: int, backward: bool = True) -> int:
    """The longest chain of accumulated terms behind a gradient element (``backward``) or a
    logit / value (forward only) of a ``spec`` model on ``tokens`` tokens of length
    ``seq_len``.

    Each layer accumulates over the hidden size (q/k/v/o projections, RMS norm), the
    intermediate size (MLP down projection) and the keys of attention (``seq_len``); the
    head over the hidden size, the log-softmax over the vocabulary. Backward runs the same
    chain again, and a weight gradient finally sums over the ``tokens``.
    """
    per_layer = spec.hidden_size + spec.intermediate_size + seq_len
    chain = spec.num_hidden_layers * per_layer + spec.hidden_size + spec.vocab_size
    return 2 * chain + tokens if backward else chain


def hf_named(worker: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors shaped like a worker's parameters (its ``grads()``) under the Hugging Face
    names of ``export_weights()`` (megatron keeps its own names and fused layouts)."""
    if worker.config.backend != "megatron":
        return dict(tensors)
    from ppo_trainer.megatron import _convert

    model = worker._policy if hasattr(worker, "_policy") else worker._critic
    return {k: v.clone() for k, v in _convert.megatron_to_hf(tensors, model.layout).items()}


def grad_bounds(
    magnitude: Mapping[str, torch.Tensor], *, terms: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Per element: ``rounding_bound`` with the tensor's largest accumulated magnitude
    (``magnitude[name]``: the elementwise sum of the absolute chunk contributions; the
    errors of a layer's products mix its elements, so the tensor's scale is the one that
    counts), and exactly 0 where nothing was accumulated (an embedding row of a token that
    never occurs is exactly 0 in every run)."""
    out = {}
    for name, m in magnitude.items():
        bound = rounding_bound(terms=terms, magnitude=float(m.abs().max()), dtype=dtype)
        out[name] = torch.where(m == 0, 0.0, bound).double()
    return out


def norm_of_bounds(bounds: Mapping[str, torch.Tensor]) -> float:
    """Bound on the Euclidean norm of the difference of two gradients."""
    return math.sqrt(sum(float(b.square().sum()) for b in bounds.values()))


def assert_within(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    bound: Mapping[str, float | torch.Tensor],
) -> None:
    """``|actual - expected| <= bound`` elementwise for every tensor (same keys)."""
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        diff = (actual[name].double() - want.double()).abs()
        limit = torch.as_tensor(bound[name], dtype=torch.float64).expand_as(diff)
        over = diff > limit
        if bool(over.any()):
            worst = int((diff - limit).flatten().argmax())
            raise AssertionError(
                f"{name}: {int(over.sum())} of {diff.numel()} elements differ by more than "
                f"the derived bound (worst: {float(diff.flatten()[worst]):.3g} against "
                f"{float(limit.flatten()[worst]):.3g})"
            )


def norm_bound(grads: Mapping[str, torch.Tensor], bounds: Mapping[str, torch.Tensor]) -> float:
    """How far two reported gradient norms may be apart: the triangle inequality gives
    ``|N_a - N_b| <= ||g_a - g_b||`` (at most the norm of the elementwise bounds), plus
    the rounding of each norm (sums of squares per tensor, then over the tensors; the
    squared sum's relative error halves under the square root)."""
    diff = norm_of_bounds(bounds)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    terms = max(g.numel() for g in grads.values()) + len(grads)
    return diff + rounding_bound(terms=terms, magnitude=norm)


def adam_step_bound(
    *,
    grads: Mapping[str, torch.Tensor],
    grad_bound: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    lr: float,
    adam_eps: float,
    grad_norm: float,
    max_grad_norm: float | None,
) -> dict[str, torch.Tensor]:
    """Per element: how far two runs' weights may be apart after ONE Adam(W) step from the
    same weights, when their gradients differ by at most ``grad_bound`` per tensor.

    ``grads``: one run's (unclipped, summed) gradients; ``grad_norm``: its total norm as
    the step reported it; ``lr``: the step's learning rate; ``params``: the weights after
    the step (their rounding). The first step moves an element by ``lr * f(c * g)`` with
    ``f(x) = x / (|x| + eps)`` (bias-corrected moments are ``c*g`` and ``(c*g)^2``; weight
    decay scales the equal start weights identically) and ``c = min(1, max_norm /
    (norm + 1e-6))`` the clip coefficient. ``|f| < 1`` and ``|f'(x)| = eps / (|x| +
    eps)^2``, so by the mean value theorem two gradients ``d`` apart move it by at most
    ``lr * min(2, d * eps / (max(|x| - d, 0) + eps)^2)``: tight where ``|g| >> d``, up to
    ``2 * lr`` where the gradient is within rounding of 0. ``d`` includes the clip
    coefficient's own difference (``|dc| <= c * D / (N - D)``, ``D`` the bound on the
    gradients' norm difference). Plus the rounding of Adam's few operations
    (``lr * 8 * eps32``) and of the new weight (at most one ulp, ``eps32 * |theta|``, in
    each run).
    """
    dnorm = norm_of_bounds(grad_bound)
    clip = 1.0
    dclip = 0.0
    if max_grad_norm is not None and grad_norm + dnorm > max_grad_norm:
        clip = min(1.0, max_grad_norm / (grad_norm + 1e-6))
        dclip = clip * dnorm / max(grad_norm - dnorm, 1e-30)
    out: dict[str, torch.Tensor] = {}
    for name, g in grads.items():
        g = g.double()
        d = clip * grad_bound[name] + dclip * g.abs()
        x = (clip * g).abs()
        lipschitz = adam_eps / ((x - d).clamp(min=0.0) + adam_eps) ** 2
        move = lr * torch.minimum(d * lipschitz, torch.full_like(x, 2.0))
        out[name] = move + lr * 8 * EPS32 + 2 * EPS32 * params[name].double().abs()
    return out


def head_magnitude(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> float:
    """The scale of a transformers model's outputs for rounding bounds: the largest
    ``sum_j |W_vj| * |h_j|`` of its head (``lm_head`` or the critic's ``score``) over the
    real positions of ``batch``, ``h`` the final hidden states. A logit's (or value's)
    float32 error is relative to this sum, not to the logit itself, which can cancel."""
    head = model.get_submodule("score" if hasattr(model, "score") else "lm_head")
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1][batch["attention_mask"].bool()]
        return float((hidden.abs() @ head.weight.abs().T).max())


TINY = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    seed=1234,
)


def actor_config(backend: str, **overrides: Any) -> ActorConfig:
    kwargs: dict[str, Any] = {
        "model": TINY,
        "backend": backend,
        "device": "cpu",
        "lr": 1e-3,
        "micro_batch_size": 2,
        "max_grad_norm": 1.0,
    }
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


def critic_config(backend: str, **overrides: Any) -> CriticConfig:
    kwargs: dict[str, Any] = {
        "model": TINY,
        "backend": backend,
        "device": "cpu",
        "lr": 1e-3,
        "micro_batch_size": 2,
        "max_grad_norm": 1.0,
        "value_clip": 0.2,
    }
    kwargs.update(overrides)
    return CriticConfig(**kwargs)


@dataclass
class PPOData:
    """A right-padded batch plus the per-token inputs of the losses (all ``[B, T]``)."""

    batch: dict[str, torch.Tensor]
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor

    def rows(self, index: list[int] | slice) -> PPOData:
        return PPOData(
            batch={k: v[index] for k, v in self.batch.items()},
            old_logprobs=self.old_logprobs[index],
            advantages=self.advantages[index],
            returns=self.returns[index],
            old_values=self.old_values[index],
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"batch.{k}": v for k, v in self.batch.items()}
        out.update(
            old_logprobs=self.old_logprobs,
            advantages=self.advantages,
            returns=self.returns,
            old_values=self.old_values,
        )
        return out

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> PPOData:
        return PPOData(
            batch={k.removeprefix("batch."): v for k, v in t.items() if k.startswith("batch.")},
            old_logprobs=t["old_logprobs"],
            advantages=t["advantages"],
            returns=t["returns"],
            old_values=t["old_values"],
        )


def make_data(b: int = 6, t: int = 14, *, seed: int = 0, vocab: int = 64) -> PPOData:
    """Random prompts + responses of different lengths, right padded with id 0.

    ``old_logprobs`` is a perturbation of zero-centred values (the tests replace it with
    the model's own log-probs plus noise), so ratios are away from 1 and clipping fires.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    for i in range(b):
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        resp = int(torch.randint(1, t - prompt + 1, (1,), generator=g))
        attention[i, : prompt + resp] = 1
        loss_mask[i, prompt : prompt + resp] = 1.0
    ids = ids * attention
    return PPOData(
        batch={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask},
        old_logprobs=torch.zeros(b, t),
        advantages=torch.randn(b, t, generator=g) * loss_mask,
        returns=torch.randn(b, t, generator=g) * loss_mask,
        old_values=torch.zeros(b, t),
    )


def with_model_inputs(data: PPOData, logprobs: torch.Tensor, values: torch.Tensor) -> PPOData:
    """Old log-probs near the model's (noise 0.3: ratios clip), old values from the critic."""
    g = torch.Generator().manual_seed(99)
    mask = data.batch["loss_mask"]
    noise = torch.randn(logprobs.shape, generator=g) * 0.3
    return PPOData(
        batch=data.batch,
        old_logprobs=(logprobs + noise) * mask,
        advantages=data.advantages,
        returns=data.returns,
        old_values=values,
    )
