"""Float tolerances for equivalence tests, derived from what is compared (public, for the
test suites of ppo-trainer and of the packages that drive it).

Two computations of the same value that differ only in rounding (another summation
order: chunks vs one batch, another kernel, another rank layout, a KV cache) agree to a
bound that follows from the float format, the number of rounded terms accumulated and
their magnitude, never to a constant that happened to hold on one CPU:

* ``rounding_bound``: the classical bound for a sum of ``n`` rounded terms (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4):
  ``|fl(sum) - sum| <= gamma_n * sum|a_i|``, ``gamma_n = n*u / (1 - n*u) <= n*eps`` for
  ``n*u <= 1/2`` (``u = eps/2``). Two such evaluations differ by at most twice that.
* ``model_terms``: for a model's gradients, logits or values, ``n`` is the longest chain
  of accumulations (first-order error model: the errors of successive products add; the
  tiny randomly initialised test models are well conditioned).
* ``head_magnitude``: the scale a logit's (or value's) rounding error is relative to.
* ``norm_bound``: how far two reported gradient norms may be apart.
* ``clipped_grad_bound``: the same for gradients after norm clipping.
* ``adam_step_bound``: weights after one Adam step. Adam divides every element by its
  own RMS, so an element whose gradient is within rounding of 0 may move by anything up
  to ``2 * lr``; the bound is per element, from the gradient bound.
* ``adam_update_cap``: the most one Adam step can move an element, whatever the
  gradients (for comparisons after several steps).
* ``assert_within``: elementwise check against such bounds, naming the worst element.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch

__all__ = [
    "EPS32",
    "EPS64",
    "adam_step_bound",
    "adam_update_cap",
    "assert_within",
    "clipped_grad_bound",
    "head_magnitude",
    "model_terms",
    "norm_bound",
    "norm_of_bounds",
    "rounding_bound",
]

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 ~ 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2**-52 ~ 2.22e-16


class ModelShape(Protocol):
    """What ``model_terms`` reads: a ``ModelSpec`` or a transformers config."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...


def rounding_bound(*, terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """Largest ``|a - b|`` for two evaluations in ``dtype`` of one value that accumulate at
    most ``terms`` rounded terms whose absolute values sum to at most ``magnitude``:
    ``2 * gamma_terms * magnitude <= 2 * terms * eps * magnitude`` (module docstring)."""
    eps = torch.finfo(dtype).eps
    if not terms * eps / 2 <= 0.5:
        raise ValueError(f"terms={terms} is too many for {dtype}: the bound needs n*u <= 1/2")
    return 2.0 * terms * eps * float(magnitude)


def model_terms(spec: ModelShape, *, tokens: int, seq_len: int, backward: bool = True) -> int:
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


def norm_of_bounds(bounds: Mapping[str, torch.Tensor]) -> float:
    """Bound on the Euclidean norm of the difference of two gradients."""
    return math.sqrt(sum(float(b.double().square().sum()) for b in bounds.values()))


def norm_bound(grads: Mapping[str, torch.Tensor], bounds: Mapping[str, torch.Tensor]) -> float:
    """How far two reported gradient norms may be apart: the triangle inequality gives
    ``|N_a - N_b| <= ||g_a - g_b||`` (at most the norm of the elementwise bounds), plus
    the rounding of each norm (sums of squares per tensor, then over the tensors; the
    squared sum's relative error halves under the square root)."""
    diff = norm_of_bounds(bounds)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    terms = max(g.numel() for g in grads.values()) + len(grads)
    return diff + rounding_bound(terms=terms, magnitude=norm)


def clipped_grad_bound(
    *,
    grads: Mapping[str, torch.Tensor],
    grad_bound: Mapping[str, torch.Tensor],
    grad_norm: float,
    max_grad_norm: float | None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """The clip coefficient ``c = min(1, max_norm / (norm + 1e-6))`` of ``grads`` (total
    norm ``grad_norm`` as the step reported it) and, per element, how far two runs'
    CLIPPED gradients ``c * g`` may be apart when the unclipped ones differ by at most
    ``grad_bound``: ``c * grad_bound + |dc| * |g|`` with ``|dc| <= c * D / (N - D)``,
    ``D`` the bound on the norms' difference (``norm_of_bounds``); ``dc = 0`` when the
    norm stays below ``max_norm`` in both runs."""
    dnorm = norm_of_bounds(grad_bound)
    clip = 1.0
    dclip = 0.0
    if max_grad_norm is not None and grad_norm + dnorm > max_grad_norm:
        clip = min(1.0, max_grad_norm / (grad_norm + 1e-6))
        dclip = clip * dnorm / max(grad_norm - dnorm, 1e-30)
    out = {
        name: clip * grad_bound[name].double() + dclip * g.double().abs()
        for name, g in grads.items()
    }
    return clip, out


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
    clip, clipped = clipped_grad_bound(
        grads=grads, grad_bound=grad_bound, grad_norm=grad_norm, max_grad_norm=max_grad_norm
    )
    out: dict[str, torch.Tensor] = {}
    for name, g in grads.items():
        d = clipped[name]
        x = (clip * g.double()).abs()
        lipschitz = adam_eps / ((x - d).clamp(min=0.0) + adam_eps) ** 2
        move = lr * torch.minimum(d * lipschitz, torch.full_like(x, 2.0))
        out[name] = move + lr * 8 * EPS32 + 2 * EPS32 * params[name].double().abs()
    return out


def adam_update_cap(step: int, betas: tuple[float, float]) -> float:
    """The largest ``|m_hat / (sqrt(v_hat) + eps)|`` of Adam's ``step``-th update (1-based),
    for any gradients: with ``a_s = (1-b1) b1^(t-s)`` and ``c_s = (1-b2) b2^(t-s)``,
    ``m_t = sum a_s g_s`` and ``v_t = sum c_s g_s^2``, Cauchy-Schwarz gives ``|m_t| <=
    sqrt(sum a_s^2 / c_s) * sqrt(v_t)``; the bias corrections multiply by ``sqrt(1 -
    b2^t) / (1 - b1^t)``. It is exactly 1 at step 1 and ~1.0-1.1 for the default betas.
    An element therefore moves by at most ``lr * adam_update_cap(t)`` at step ``t``."""
    if step < 1:
        raise ValueError(f"step={step}: Adam steps count from 1")
    b1, b2 = betas
    ratio = b1 * b1 / b2
    total = sum(ratio**k for k in range(step)) * (1 - b1) ** 2 / (1 - b2)
    return math.sqrt(total) * math.sqrt(1 - b2**step) / (1 - b1**step)


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
        weight = head.get_parameter("weight")
        return float((hidden.abs() @ weight.abs().T).max())
