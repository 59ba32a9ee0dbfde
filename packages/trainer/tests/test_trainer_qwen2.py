"""The built-in model (``ppo_trainer._qwen2``) against transformers' own Qwen2 classes,
the independent reference: the same state dict and initial values under a seed, the
same logits, values and hidden states (padded batches, the KV cache and its row
selection), and no transformers import on the built-in path."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_trainer import ModelSpec, build_causal_lm, build_value_model
from ppo_trainer._qwen2 import Qwen2CausalLM, Qwen2Spec, Qwen2TokenValue
from trainer_testlib import (
    TINY,
    assert_within,
    grad_bounds,
    head_magnitude,
    model_terms,
    rounding_bound,
)

transformers = pytest.importorskip("transformers")


def _hf_causal(spec: ModelSpec, seed: int, **extra: Any) -> Any:
    config = transformers.Qwen2Config(**spec.hf_config_kwargs(), use_cache=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config, **extra).eval()


def _hf_value(spec: ModelSpec, seed: int, **extra: Any) -> Any:
    config = transformers.Qwen2Config(
        **spec.hf_config_kwargs(), use_cache=False, num_labels=1, classifier_dropout=0.0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForTokenClassification.from_config(config, **extra).eval()


def _spec(tie: bool = False) -> ModelSpec:
    return ModelSpec(**{**TINY.__dict__, "tie_word_embeddings": tie})


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_initial_weights_are_transformers_bit_for_bit(tie: bool, dtype: str) -> None:
    spec = ModelSpec(**{**_spec(tie).__dict__, "dtype": dtype})
    torch_dtype = getattr(torch, dtype)
    pairs = [
        (build_causal_lm(spec, plain_torch=True), _hf_causal(spec, spec.seed, dtype=torch_dtype)),
        (
            build_value_model(spec, plain_torch=True),
            _hf_value(spec, spec.seed + 1, dtype=torch_dtype),
        ),
    ]
    for ours, theirs in pairs:
        mine, ref = ours.state_dict(), theirs.state_dict()
        assert list(mine) == list(ref)  # names and order: exports load with transformers
        for name, value in ref.items():
            assert mine[name].dtype == value.dtype, name
            assert torch.equal(mine[name], value), name
    # and the global generator is left where it was (both builders fork it)
    before = torch.random.get_rng_state()
    build_causal_lm(spec, plain_torch=True)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_generator_advances_as_transformers_construction_does() -> None:
    """Drawn in the same order and amount, tied head included: what follows a build in a
    caller's stream (a user seeding once for several models) stays the same."""
    for tie in (False, True):
        spec = _spec(tie)
        arch = Qwen2Spec(**spec.hf_config_kwargs())
        config = transformers.Qwen2Config(**spec.hf_config_kwargs(), use_cache=False)
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(config)
        after_theirs = torch.rand(4)
        torch.manual_seed(7)
        Qwen2CausalLM(arch)
        assert torch.equal(torch.rand(4), after_theirs)
        torch.manual_seed(7)
        value = Qwen2TokenValue(Qwen2Spec(**spec.hf_config_kwargs(), num_labels=1))
        after_ours = torch.rand(4)
        torch.manual_seed(7)
        transformers.AutoModelForTokenClassification.from_config(
            transformers.Qwen2Config(**spec.hf_config_kwargs(), num_labels=1)
        )
        assert torch.equal(torch.rand(4), after_ours)
        assert value.score.bias is not None


def _padded_batch(b: int = 6, t: int = 14, *, vocab: int, left: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    lengths = torch.tensor([t, t - 1, t - 5, 3, t - 2, 7])[:b]
    pos = torch.arange(t)[None, :]
    valid = pos >= t - lengths[:, None] if left else pos < lengths[:, None]
    return {"input_ids": ids, "attention_mask": valid.long()}


def _bound(model: Any, batch: dict[str, Any], spec: ModelSpec) -> float:
    """Two evaluations of one logit: rounding along the forward chain (the magnitude of
    its head's sum, ``ppo_trainer.testing``)."""
    b, t = batch["input_ids"].shape
    terms = model_terms(spec, tokens=b * t, seq_len=t, backward=False)
    return rounding_bound(terms=terms, magnitude=head_magnitude(model, batch))


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_logits_values_and_hidden_states_match_transformers(left: bool) -> None:
    spec = _spec()
    batch = _padded_batch(vocab=spec.vocab_size, left=left)
    valid = batch["attention_mask"].bool()
    for ours, theirs in (
        (build_causal_lm(spec, plain_torch=True), _hf_causal(spec, spec.seed)),
        (build_value_model(spec, plain_torch=True), _hf_value(spec, spec.seed + 1)),
    ):
        bound = _bound(theirs, batch, spec)
        with torch.no_grad():
            a = ours(**batch, output_hidden_states=True)
            b = theirs(**batch, output_hidden_states=True)
        # every real position; with right padding the padding positions too (they see
        # the real keys before them, as in transformers)
        where = valid if left else torch.ones_like(valid)
        torch.testing.assert_close(a.logits[where], b.logits[where], rtol=0, atol=bound)
        assert len(a.hidden_states) == len(b.hidden_states) == spec.num_hidden_layers + 1
        for mine, ref in zip(a.hidden_states, b.hidden_states, strict=True):
            torch.testing.assert_close(mine[where], ref[where], rtol=0, atol=bound)
        # without a mask: plain causal attention
        plain = {"input_ids": batch["input_ids"]}
        with torch.no_grad():
            torch.testing.assert_close(
                ours(**plain).logits, theirs(**plain).logits, rtol=0, atol=bound
            )


def test_gradients_match_transformers() -> None:
    spec = _spec()
    batch = _padded_batch(vocab=spec.vocab_size)
    valid = batch["attention_mask"].bool()

    def grads(model: Any, rows: slice) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        part = {k: v[rows] for k, v in batch.items()}
        logp = torch.log_softmax(model(**part).logits.float(), -1)
        (-(logp[..., 0] * valid[rows]).sum() / valid.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours, theirs = build_causal_lm(spec, plain_torch=True), _hf_causal(spec, spec.seed)
    whole = slice(None)
    b, t = batch["input_ids"].shape
    # the magnitude a gradient element accumulates: the sum of its samples' |parts|
    # (grad_bounds' convention, one sample per chunk)
    magnitude = {n: torch.zeros_like(p) for n, p in theirs.named_parameters()}
    for i in range(b):
        for n, g in grads(theirs, slice(i, i + 1)).items():
            magnitude[n] += g.abs()
    bounds = grad_bounds(magnitude, terms=model_terms(spec, tokens=b * t, seq_len=t))
    assert_within(grads(ours, whole), grads(theirs, whole), bounds)


def test_kv_cache_decoding_matches_transformers() -> None:
    """The embedded engine's use: a prompt forward, one token at a time with the cache,
    rows leaving the batch (``batch_select_indices``)."""
    spec = _spec()
    ours, theirs = build_causal_lm(spec, plain_torch=True), _hf_causal(spec, spec.seed)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, spec.vocab_size, (6, 5), generator=g)
    with torch.no_grad():
        a = ours(input_ids=prompt, use_cache=True)
        b = theirs(input_ids=prompt, use_cache=True)
        bound = _bound(
            theirs, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, spec
        )
        for step in range(6):
            torch.testing.assert_close(a.logits[:, -1], b.logits[:, -1], rtol=0, atol=bound)
            if step == 2:
                keep = torch.tensor([0, 2, 3, 5])
                a.past_key_values.batch_select_indices(keep)
                b.past_key_values.batch_select_indices(keep)
            rows = a.past_key_values.keys[0].shape[0]
            nxt = torch.randint(0, spec.vocab_size, (rows, 1), generator=g)
            a = ours(input_ids=nxt, past_key_values=a.past_key_values, use_cache=True)
            b = theirs(input_ids=nxt, past_key_values=b.past_key_values, use_cache=True)
        assert a.past_key_values.get_seq_length() == 5 + 6


def test_workers_build_the_plain_model_without_importing_transformers() -> None:
    """What the plain model is for: a trainer rank (actor and critic workers, reference
    model included) or engine process on the built-in model never imports
    transformers, about 2.4 CPU-seconds of start-up per process; and what they build is
    the plain model with transformers' weights."""
    code = (
        "import sys\n"
        "import torch\n"
        "from ppo_trainer import ActorConfig, ActorWorker, CriticConfig, CriticWorker, ModelSpec\n"
        "from ppo_trainer._qwen2 import Qwen2CausalLM, Qwen2TokenValue\n"
        f"spec = ModelSpec(**{dict(TINY.__dict__)!r})\n"  # the tests' tiny model
        "common = dict(model=spec, device='cpu', lr=1e-3)\n"
        "actor = ActorWorker(ActorConfig(**common, kl_loss_coef=0.1))\n"
        "critic = CriticWorker(CriticConfig(**common))\n"
        "try:\n"
        "    import ppo_driver.workers, ppo_driver.run  # noqa: the driver's modules\n"
        "    from ppo_driver.rollout._model import build_model\n"
        "    engine = build_model(spec)\n"
        "    assert isinstance(engine, Qwen2CausalLM), type(engine)\n"
        "except ImportError:\n"
        "    pass  # ppo-trainer alone\n"
        "kinds = sorted({type(m).__name__ for m in (actor._policy.module, actor._reference.module,\n"
        "                                         critic._critic.module)})\n"
        "print(kinds, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
        "torch.save(actor.export_weights(), sys.argv[1])\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "w.pt"
        out = subprocess.run(
            [sys.executable, "-c", code, str(weights)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == "['Qwen2CausalLM', 'Qwen2TokenValue'] []", out.stdout
        exported = torch.load(weights)
    reference = _hf_causal(TINY, TINY.seed).state_dict()
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(exported[name], value), name


def test_spec_converts_to_transformers_config() -> None:
    spec = _spec(tie=True)
    hf = Qwen2Spec(**spec.hf_config_kwargs(), num_labels=1).to_hf()
    assert isinstance(hf, transformers.Qwen2Config)
    for key, value in spec.hf_config_kwargs().items():
        if key == "rope_theta":  # transformers 5 keeps it in rope_parameters
            assert hf.rope_parameters["rope_theta"] == value
        else:
            assert getattr(hf, key) == value, key
    assert hf.num_labels == 1 and hf.classifier_dropout == 0.0
