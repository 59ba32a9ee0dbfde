"""The PPO math against a peer: verl's numbers on the same inputs.

``data/verl_reference.json`` holds small float64 inputs (3 samples x 5 tokens, masks with
a short row, a hole and an empty row, masked positions filled with 5.0) and what verl
computed from them (``source``: repository, commit and files; the calls are in each case's
``verl_call``). verl ran outside this repository; only its outputs are kept. The cases
cover the conventions the two share: GAE (with a hole in a row), whitening, the
token-mean and seq-mean-token-mean aggregations (= ``loss_agg`` token and sample), the
clipped policy loss with its asymmetric and dual clips, the clipped value loss, the k1 /
k2 / k3 KL estimators, log-probabilities and entropy, each with its gradient where the
loss has one. Where the two differ on purpose they are not compared (documented in
``_math``): verl fills masked positions with values (the project writes 0, so only
valid positions are compared where ``compare_where`` names a mask), clamps k3 to
``[-10, 10]`` (the project keeps the exact value; the k3 case stays below the clamp),
reports k1 as ``approx_kl`` (the project k3) and always applies its dual clip.

Tolerance, from what is compared: verl divides its masked means by ``count + 1e-8``
(the project by ``max(count, 1)``), a relative change of at most 1e-8 that whitening
carries into values of order ``|mean| / std`` (the inputs are O(1), at most 5), and the
stored outputs are rounded to 12 significant digits (5e-12 relative); float64 rounding of
15-term sums is far below both. So ``rtol = 1e-7`` and ``atol = 5e-8`` (1e-8 relative
times the inputs' scale of 5) hold with a margin of about 10x over the differences seen
(at most 8e-10 with 5e-9 on a masked mean), while a change of convention (a biased
variance, a missing 0.5, a clip on the wrong side) moves the results by percents.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_trainer import _math

DATA = json.loads((Path(__file__).parent / "data" / "verl_reference.json").read_text())
RTOL, ATOL = 1e-7, 5e-8


def _inputs() -> dict[str, torch.Tensor]:
    return {
        k: torch.tensor(v, dtype=torch.long if k == "labels" else torch.float64)
        for k, v in DATA["inputs"].items()
    }


def _project(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The project's function on the case's inputs, its outputs under verl's names."""
    inputs = _inputs()
    tensors = {arg: inputs[name] for arg, name in case["tensors"].items()}
    grad_of = case.get("grad_of")
    if grad_of is not None:
        tensors[grad_of] = tensors[grad_of].clone().requires_grad_(True)
    fn, options = case["fn"], case["options"]
    out = getattr(_math, fn)(**tensors, **options)
    if fn == "gae":
        advantages, returns = out
        whitened = _math.masked_whiten(values=advantages, mask=tensors["mask"])
        return {"advantages_raw": advantages, "returns": returns, "advantages_whitened": whitened}
    if fn == "policy_loss":
        out.pg_loss.backward()
        return {
            "pg_loss": out.pg_loss,
            "pg_clipfrac": out.clipfrac,
            "grad_logprobs": tensors[grad_of].grad,
        }
    if fn == "value_loss":
        out.v_loss.backward()
        return {
            "vf_loss": out.v_loss,
            "vf_clipfrac": out.clipfrac,
            "grad_vpreds": tensors[grad_of].grad,
        }
    (name,) = case["expected"]  # a single output
    return {name: out}


@pytest.mark.parametrize("case", DATA["cases"], ids=[c["name"] for c in DATA["cases"]])
def test_math_matches_verl(case: dict[str, Any]) -> None:
    got = _project(case)
    where = case["compare_where"]
    valid = None if where is None else _inputs()[where].bool()
    for name, expected in case["expected"].items():
        ours = got[name].detach().to(torch.float64)
        theirs = torch.tensor(expected, dtype=torch.float64)
        if valid is not None:
            ours, theirs = ours[valid], theirs[valid]
        torch.testing.assert_close(
            ours, theirs, rtol=RTOL, atol=ATOL, msg=f"{case['name']}: {name}"
        )


def test_the_reference_exercises_every_clip_branch() -> None:
    """The inputs reach what the cases claim to compare: the asymmetric and the dual clip
    each change the policy loss, and the value clip is active on some tokens."""
    x = _inputs()
    kw = dict(
        logprobs=x["logprobs"],
        old_logprobs=x["old_logprobs"],
        advantages=x["advantages"],
        mask=x["mask"],
        eps_clip=0.2,
    )
    plain = float(_math.policy_loss(**kw).pg_loss)
    high = float(_math.policy_loss(**kw, eps_clip_high=0.28).pg_loss)
    dual = float(_math.policy_loss(**kw, eps_clip_high=0.28, dual_clip=3.0).pg_loss)
    assert abs(plain - high) > 1e-3 and abs(high - dual) > 1e-3
    v = _math.value_loss(
        values=x["vpreds"],
        old_values=x["values"],
        returns=x["returns"],
        mask=x["mask"],
        value_clip=0.2,
    )
    assert 0 < float(v.clipfrac) < 1
