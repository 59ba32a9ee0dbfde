"""Rollout pieces that need no Ray: sampling loop, tokenizer, task and rewards, batch
layout, bucket plan, replay buffer checkpoints."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from driver_testlib import gloo_refit_pair
from ppo_driver.rollout import (
    CharTokenizer,
    EmbeddedEngine,
    GroupOutput,
    GroupRequest,
    PromptDataset,
    ReplayBuffer,
    RewardError,
    SampleOutput,
    SamplingParams,
    ScoredGroup,
    build_batch,
    build_model,
    generate_group,
    generate_rows,
    load_jsonl,
    load_reward_fn,
    load_tokenizer,
    plan_buckets,
    repeat_reward,
    sample_seed,
    score_group,
    synthetic_records,
    tiny_qwen2_config,
)
from ppo_driver.rollout._sampling import _UNIFORM_BLOCK, _forward, _top_p_filter, draw_tokens
from ppo_trainer.testing import head_magnitude, model_terms, rounding_bound

TOK = CharTokenizer()
PARAMS = SamplingParams(n=4, max_new_tokens=12, stop_token_ids=(TOK.eos_id,))


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return build_model(tiny_qwen2_config(vocab_size=TOK.vocab_size), seed=3)


@pytest.fixture(scope="module")
def dataset() -> PromptDataset:
    return PromptDataset(synthetic_records(num_prompts=16, seed=0, max_count=12), TOK)


# -- sampling ---------------------------------------------------------------------------


def test_sample_seed_depends_on_every_field() -> None:
    base = {"run_seed": 1, "prompt_index": 2, "sample_index": 3, "weight_version": 4}
    seeds = {sample_seed(**base)}
    for key in base:
        seeds.add(sample_seed(**{**base, key: base[key] + 1}))
    assert len(seeds) == 5
    assert sample_seed(**base) == sample_seed(**base) < 2**63


def test_batched_rows_are_bitwise_identical_to_single_groups(
    model: Any, dataset: PromptDataset
) -> None:
    """A sample never depends on which rows shared its batch (incl. fewer than 4 rows)."""
    length = len(dataset.prompt_ids(0))
    idx = [i for i in range(len(dataset)) if len(dataset.prompt_ids(i)) == length][:6]
    prompts, seeds = [], []
    for i in idx:
        for j in range(PARAMS.n):
            prompts.append(dataset.prompt_ids(i))
            seeds.append(sample_seed(run_seed=7, prompt_index=i, sample_index=j, weight_version=0))
    batched = generate_rows(model, prompts, params=[PARAMS] * len(prompts), seeds=seeds)
    for k, i in enumerate(idx):
        alone = generate_group(
            model, dataset.prompt_ids(i), params=PARAMS, seeds=seeds[4 * k : 4 * k + 4]
        )
        assert batched[4 * k : 4 * k + 4] == alone
    one = generate_rows(model, prompts[:1], params=[PARAMS], seeds=seeds[:1])
    assert one[0] == batched[0]


def test_decoding_matches_a_loop_drawing_once_per_step(model: Any, dataset: PromptDataset) -> None:
    """generate_rows over a batch of mixed settings (greedy, top-p, temperatures, stop
    tokens, lengths past one block of uniforms and past the token buffer's first width)
    equals, bit for bit, a plain loop per row: its KV cache in a batch of 4 copies, one
    ``draw_tokens`` call per step (one uniform from the row's generator per step),
    stopping at a stop token or the length."""
    kinds = [
        SamplingParams(n=1, max_new_tokens=12, stop_token_ids=(TOK.eos_id,)),
        SamplingParams(n=1, max_new_tokens=5, temperature=0.0),
        SamplingParams(n=1, max_new_tokens=2 * _UNIFORM_BLOCK + 3, top_p=0.7, temperature=0.8),
        SamplingParams(n=1, max_new_tokens=_UNIFORM_BLOCK + 1, temperature=1.3),
        SamplingParams(n=1, max_new_tokens=9, stop_token_ids=(TOK.eos_id, 5)),
        SamplingParams(n=1, max_new_tokens=150),  # past the first 64-step token buffer
    ]
    length = len(dataset.prompt_ids(0))
    prompts = [p for i in range(len(dataset)) if len(p := dataset.prompt_ids(i)) == length][:10]
    params = [kinds[r % len(kinds)] for r in range(len(prompts))]
    seeds = [
        sample_seed(run_seed=5, prompt_index=r, sample_index=0, weight_version=2)
        for r in range(len(prompts))
    ]
    finished: list[int] = []
    batched = generate_rows(
        model, prompts, params=params, seeds=seeds, on_finish=lambda r, _s: finished.append(r)
    )
    assert sorted(finished) == list(range(len(prompts)))
    for r, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        gen = torch.Generator().manual_seed(seeds[r])
        with torch.inference_mode():
            past, logits = _forward(model, torch.tensor([list(prompt)] * 4), None)
            tokens: list[int] = []
            lps: list[float] = []
            while True:
                (tok,), (lp,) = draw_tokens(logits[:1], params=[p], generators=[gen])
                tokens.append(tok)
                lps.append(lp)
                if tok in p.stop_token_ids or len(tokens) == p.max_new_tokens:
                    break
                past, logits = _forward(model, torch.tensor([[tok]] * 4), past)
        reason = "stop" if tok in p.stop_token_ids else "length"
        assert batched[r] == SampleOutput(tuple(tokens), tuple(lps), reason), r


def test_engine_logprobs_match_a_full_forward(model: Any, dataset: PromptDataset) -> None:
    """KV-cache decoding log-probs equal a plain full-sequence forward, within the float32
    rounding of the forward: ``rounding_bound`` over the forward chain of the model
    (``model_terms``) at twice the head's magnitude (a log-prob ``z_y - logsumexp(z)``
    carries the logits' error twice); see ``ppo_trainer.testing``."""
    prompt = dataset.prompt_ids(1)
    seeds = [
        sample_seed(run_seed=0, prompt_index=1, sample_index=j, weight_version=0) for j in range(4)
    ]
    samples = generate_group(model, prompt, params=PARAMS, seeds=seeds)
    for s in samples:
        ids = torch.tensor([list(prompt) + list(s.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        want = logp[0, len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0]
        terms = model_terms(model.config, tokens=ids.numel(), seq_len=ids.shape[1], backward=False)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        bound = rounding_bound(terms=terms, magnitude=2 * head_magnitude(model, batch))
        diff = float((torch.tensor(s.logprobs).double() - want.double()).abs().max())
        print(f"KV-cache vs full forward log-probs: |diff| {diff:.3g}, bound {bound:.3g}")
        assert diff <= bound
        assert s.finish_reason == ("stop" if s.token_ids[-1] == TOK.eos_id else "length")
        assert (s.finish_reason == "length") == (len(s.token_ids) == PARAMS.max_new_tokens) or (
            s.token_ids[-1] == TOK.eos_id
        )


def test_greedy_is_seed_independent(model: Any, dataset: PromptDataset) -> None:
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    a = generate_group(model, dataset.prompt_ids(2), params=greedy, seeds=[1, 2])
    assert a[0].token_ids == a[1].token_ids


def _generators(rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 + i) for i in range(rows)]


@pytest.mark.parametrize("vocab", [22, 1000])
def test_a_drawn_row_does_not_depend_on_the_other_rows(vocab: int) -> None:
    """Every row of a batched draw (mixed temperatures, top-p and greedy rows) equals
    the same row drawn alone with a generator in the same state: token AND log-prob,
    bitwise, for batches of 1..300 rows."""
    g = torch.Generator().manual_seed(0)
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.3),
    ]
    for rows in (1, 5, 37, 300):
        logits = torch.randn(rows, vocab, generator=g) * 3
        params = [kinds[i % len(kinds)] for i in range(rows)]

        tokens, lps = draw_tokens(logits, params=params, generators=_generators(rows))
        for i, gen in enumerate(_generators(rows)):
            tok, lp = draw_tokens(logits[i : i + 1].clone(), params=[params[i]], generators=[gen])
            assert (tok[0], lp[0]) == (tokens[i], lps[i]), (rows, i)


def test_draws_follow_the_distribution_and_skip_filtered_tokens() -> None:
    """Inverse-transform sampling from each row's own generator: 20,000 draws of
    p = (0.1, 0.2, 0.7) land within 5 binomial standard deviations of p; with top-p 0.75
    the 0.1 token (outside the smallest prefix reaching 0.75) is never drawn, and the
    others follow the renormalised (0.2, 0.7) / 0.9."""
    n = 20_000
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7]])).repeat(n, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    for top_p, want in ((1.0, [0.1, 0.2, 0.7]), (0.75, [0.0, 0.2 / 0.9, 0.7 / 0.9])):
        tokens, _ = draw_tokens(logits, params=SamplingParams(top_p=top_p), generators=gens)
        freq = torch.bincount(torch.tensor(tokens), minlength=3).double() / n
        p = torch.tensor(want, dtype=torch.float64)
        bound = 5 * torch.sqrt(p * (1 - p) / n)
        assert torch.all((freq - p).abs() <= bound), (top_p, freq)
        if top_p < 1.0:
            assert freq[0] == 0.0


def test_top_p_keeps_the_smallest_prefix() -> None:
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    out = _top_p_filter(probs, 0.7)
    # renormalised in float32: a sum of 4 kept probabilities (<= 1) and one division
    atol = rounding_bound(terms=4 + 1, magnitude=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.625, 0.375, 0.0]), rtol=0, atol=atol)
    assert torch.equal(_top_p_filter(probs, 0.01), torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        pytest.param({"n": 0}, "n", id="n"),
        pytest.param({"temperature": -1.0}, "temperature", id="temperature"),
        pytest.param({"top_p": 0.0}, "top_p", id="top_p"),
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max_new_tokens"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)


def test_embedded_engine_in_process_tags_version_and_pauses(dataset: PromptDataset) -> None:
    engine = EmbeddedEngine(model=tiny_qwen2_config(vocab_size=TOK.vocab_size), run_seed=1)
    req = GroupRequest(prompt_index=3, prompt_ids=dataset.prompt_ids(3), params=PARAMS)
    (out,) = engine.generate([req])
    assert out.weight_version == 0 and len(out.samples) == PARAMS.n
    engine.pause_generation()
    assert engine.health().paused
    engine.continue_generation()
    engine.release_memory()
    engine.release_memory()  # idempotent
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate([req])
    engine.resume_memory()
    new = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
    assert engine.update_weights(new, version=5) == 5
    (out5,) = engine.generate([req])
    assert out5.weight_version == 5 and out5.samples != out.samples
    with pytest.raises(ValueError, match="twice"):
        engine.generate([req, req])


def test_embedded_engine_refuses_a_refit_that_does_not_fit_before_any_copy() -> None:
    """A wrong name or shape changes nothing: the check runs before the first copy (a
    shape that broadcasts, say a one-element tensor for a norm's weight, would otherwise
    be copied into every element, and a later mismatch would stop the copy half way)."""
    engine = EmbeddedEngine(model=tiny_qwen2_config(vocab_size=TOK.vocab_size), run_seed=1)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.01 for k, v in before.items()}
    broadcast = {**new, "model.norm.weight": torch.ones(1)}
    with pytest.raises(ValueError, match=r"shape 1: model\.norm\.weight \[1\]"):
        engine.update_weights(broadcast, version=1)
    renamed = {("x." + k if k.startswith("lm_head") else k): v for k, v in new.items()}
    with pytest.raises(ValueError, match=r"unknown 1: x\.lm_head\.weight; missing 1: lm_head"):
        engine.update_weights(renamed, version=1)
    after = engine.model.state_dict()
    assert engine.weight_version == 0
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing was written


def test_embedded_engine_starts_released_and_takes_a_refit_while_released(
    dataset: PromptDataset,
) -> None:
    """Colocated engines start released and paused; a weight update while released
    lands (the engine stays released), and after resuming it generates exactly what an
    engine that took the same update while resident generates."""
    config = tiny_qwen2_config(vocab_size=TOK.vocab_size)
    req = GroupRequest(prompt_index=3, prompt_ids=dataset.prompt_ids(3), params=PARAMS)
    resident = EmbeddedEngine(model=config, run_seed=1)
    new = {k: v + 0.01 for k, v in resident.model.state_dict().items()}
    resident.update_weights(new, version=5)
    (expected,) = resident.generate([req])

    engine = EmbeddedEngine(model=config, run_seed=1, released=True)
    health = engine.health()
    assert health.memory_released and health.paused
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    assert engine.update_weights(new, version=5) == 5
    assert engine.health().memory_released  # the update did not leave it resident
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.resume_memory()
    engine.continue_generation()
    (out,) = engine.generate([req])
    assert out.weight_version == 5 and out.samples == expected.samples


def test_embedded_engine_paces_decode_steps(
    dataset: PromptDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step_delay_s`` is the period of a decode step: the engine sleeps only what the
    step's compute left of it (an emulated device whose speed does not depend on the
    host's load), and not at all when the compute took longer."""
    import ppo_driver.rollout._embedded as embedded

    clock = [100.0]
    slept: list[float] = []
    compute = iter([0.01, 0.05, 0.03] + [0.0] * 64)  # seconds each decode step computes
    pacing = threading.local()  # set while this engine paces a step
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if not getattr(pacing, "on", False):  # e.g. a finalizer of an earlier test's
            real_sleep(seconds)  # engine that the round's thread happens to run
            return
        slept.append(round(seconds, 9))
        clock[0] += seconds

    real_between = EmbeddedEngine._between_steps

    def between(self: EmbeddedEngine) -> None:
        clock[0] += next(compute)
        pacing.on = True
        try:
            real_between(self)
        finally:
            pacing.on = False

    monkeypatch.setattr(embedded.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(embedded.time, "sleep", sleep)
    monkeypatch.setattr(EmbeddedEngine, "_between_steps", between)
    engine = EmbeddedEngine(
        model=tiny_qwen2_config(vocab_size=TOK.vocab_size), run_seed=1, step_delay_s=0.04
    )
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, stop_token_ids=())
    req = GroupRequest(prompt_index=3, prompt_ids=dataset.prompt_ids(3), params=params)
    engine.generate([req])
    assert slept[:3] == [0.03, 0.0, 0.01]  # 0.04 - compute, never negative


def test_embedded_engine_gathers_calls_sent_one_after_another(dataset: PromptDataset) -> None:
    """A dispatcher sends one call per group, one after another: each arrival keeps the
    round open, so calls spread over more than one gather window still decode as one
    round (with a fixed window from the first call, the later ones waited for a second
    round: a step's generation took two round lengths)."""
    engine = EmbeddedEngine(
        model=tiny_qwen2_config(vocab_size=TOK.vocab_size), run_seed=1, gather_s=0.2
    )
    width = len(dataset.prompt_ids(0))  # a round holds prompts of one length
    ids = [i for i in range(len(dataset)) if len(dataset.prompt_ids(i)) == width][:5]
    assert len(ids) == 5
    params = SamplingParams(n=2, max_new_tokens=3, stop_token_ids=())
    calls = []
    for i in ids:  # 5 calls 0.1 s apart: 0.4 s in all, more than one 0.2 s window
        req = GroupRequest(prompt_index=i, prompt_ids=dataset.prompt_ids(i), params=params)
        calls.append(threading.Thread(target=engine.generate, args=([req],)))
        calls[-1].start()
        time.sleep(0.1)
    for call in calls:
        call.join(timeout=60)
    assert engine.groups_served == 5
    assert engine.rounds == 1


def test_the_call_that_starts_a_round_returns_when_its_own_groups_are_done(
    dataset: PromptDataset,
) -> None:
    """The first call of a round (the one that starts it) comes back as soon as its
    group is done, while a longer group of the same round still decodes. When that call
    decoded the round on its own thread, its group came back only with the round's
    last, and with length-order blocks a group not back holds every group after it (a
    traced step at 0.04 s per decode step: 34 of 64 groups filed only at the end)."""
    engine = EmbeddedEngine(
        model=tiny_qwen2_config(vocab_size=TOK.vocab_size),
        run_seed=1,
        step_delay_s=0.05,
        gather_s=0.1,
    )
    width = len(dataset.prompt_ids(0))  # a round holds prompts of one length
    short, long = [i for i in range(len(dataset)) if len(dataset.prompt_ids(i)) == width][:2]

    def request(i: int, tokens: int) -> GroupRequest:
        params = SamplingParams(n=2, max_new_tokens=tokens, stop_token_ids=())
        return GroupRequest(prompt_index=i, prompt_ids=dataset.prompt_ids(i), params=params)

    first = threading.Thread(target=engine.generate, args=([request(short, 1)],))
    second = threading.Thread(target=engine.generate, args=([request(long, 30)],))
    first.start()  # arrives first: it starts the round
    second.start()  # within the gather window: the same round
    first.join(timeout=60)
    running = engine.progress()  # 30 decode steps of >= 0.05 s: far from done
    second.join(timeout=60)
    assert engine.rounds == 1
    assert list(running) == [long] and running[long] >= 0, running  # still decoding
    assert engine.groups_served == 2


# -- tokenizer ------------------------------------------------------------------------------


def test_char_tokenizer_round_trip(tmp_path: Path) -> None:
    ids = TOK.encode("c12:")
    assert ids[0] == TOK.bos_id and TOK.decode([*ids, TOK.eos_id]) == "c12:"
    assert TOK.decode([3, 200]) == "a?"
    with pytest.raises(ValueError, match="outside the alphabet"):
        TOK.encode("z")
    with pytest.raises(ValueError, match="vocab_size"):
        CharTokenizer(vocab_size=5)
    padded = CharTokenizer(vocab_size=32)
    padded.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 32 and loaded.encode("ab") == padded.encode("ab")
    assert load_tokenizer(None, vocab_size=40).vocab_size == 40


# -- task and rewards ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "finish", "want"),
    [
        pytest.param("ccc", "stop", 1.0, id="exact"),
        pytest.param("ccc", "length", 0.5, id="right-chars-not-stopped"),
        pytest.param("cc", "stop", 0.5 * 2 / 3 + 0.3 * 2 / 3, id="short"),
        pytest.param("cccccc", "stop", 0.5, id="twice-too-long"),
        pytest.param("ab", "stop", 0.3 * 2 / 3, id="wrong-chars"),
        pytest.param("", "length", 0.0, id="nothing"),
    ],
)
def test_repeat_reward(response: str, finish: str, want: float) -> None:
    got = repeat_reward(response=response, record={"char": "c", "count": 3}, finish_reason=finish)
    # float64 on values in [0, 1]: the reward takes <= 8 rounded operations, ``want`` fewer
    assert math.isclose(
        got, want, rel_tol=0, abs_tol=rounding_bound(terms=8, magnitude=1.0, dtype=torch.float64)
    )


def test_random_policy_reward_is_low_but_not_zero(model: Any, dataset: PromptDataset) -> None:
    rewards: list[float] = []
    lengths: list[int] = []
    for i in range(len(dataset)):
        seeds = [
            sample_seed(run_seed=0, prompt_index=i, sample_index=j, weight_version=0)
            for j in range(4)
        ]
        samples = generate_group(model, dataset.prompt_ids(i), params=PARAMS, seeds=seeds)
        out = GroupOutput(
            prompt_index=i,
            prompt_ids=dataset.prompt_ids(i),
            samples=tuple(samples),
            weight_version=0,
        )
        scored = score_group(out, record=dataset.record(i), reward_fn=repeat_reward, tokenizer=TOK)
        rewards += scored.rewards
        lengths += [len(s.token_ids) for s in samples]
    mean = sum(rewards) / len(rewards)
    assert 0.0 < mean < 0.4
    assert sum(r > 0 for r in rewards) >= len(rewards) // 4
    assert max(lengths) >= 4 * min(lengths)  # a real spread of response lengths


def test_synthetic_records_vary_and_repeat() -> None:
    a = synthetic_records(num_prompts=50, seed=1, max_count=12)
    assert a == synthetic_records(num_prompts=50, seed=1, max_count=12)
    counts = {r["count"] for r in a}
    assert min(counts) <= 3 and max(counts) >= 10
    assert all(r["prompt"] == f"{r['char']}{r['count']}:" for r in a)


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a2:", "char": "a", "count": 2}) + "\n\n")
    assert load_jsonl(path)[0]["count"] == 2
    path.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="'prompt'"):
        load_jsonl(path)
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match=":1: not valid JSON"):
        load_jsonl(path)


def test_load_reward_fn() -> None:
    assert load_reward_fn("ppo_driver.rollout:repeat_reward") is repeat_reward
    for bad, msg in [
        ("nocolon", "form"),
        ("no_such_mod_xyz:f", "cannot import"),
        ("math:nope", "no callable"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_reward_fn(bad)


def _output(n: int = 2) -> GroupOutput:
    s = SampleOutput(
        token_ids=(3, 3, TOK.eos_id), logprobs=(-1.0, -1.0, -0.5), finish_reason="stop"
    )
    return GroupOutput(prompt_index=9, prompt_ids=(1, 3, 6, 21), samples=(s,) * n, weight_version=2)


def _raises(**_: Any) -> float:
    raise KeyError("answer")


async def _async_reward(*, response: str, **_: Any) -> float:
    await asyncio.sleep(0)
    return float(len(response))


@pytest.mark.parametrize(
    ("fn", "msg"),
    [
        pytest.param(_raises, "_raises failed for prompt 9 sample 0: KeyError", id="exception"),
        pytest.param(lambda **_: float("nan"), "returned nan for prompt 9 sample 0", id="nan"),
        pytest.param(lambda **_: float("inf"), "returned inf for prompt 9 sample 0", id="inf"),
        pytest.param(lambda **_: "high", r"returned 'high' \(str\)", id="not-a-number"),
    ],
)
def test_bad_rewards_fail_the_group(fn: Any, msg: str) -> None:
    with pytest.raises(RewardError, match=msg):
        score_group(_output(), record={}, reward_fn=fn, tokenizer=TOK)


def test_async_reward() -> None:
    scored = score_group(_output(), record={}, reward_fn=_async_reward, tokenizer=TOK)
    assert scored.rewards == (2.0, 2.0)


# -- batch layout ---------------------------------------------------------------------------------


def test_build_batch_layout() -> None:
    long = SampleOutput(token_ids=(3, 3, 2), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop")
    short = SampleOutput(token_ids=(4,), logprobs=(-0.4,), finish_reason="length")
    g = ScoredGroup(
        output=GroupOutput(
            prompt_index=5, prompt_ids=(1, 3, 9), samples=(long, short), weight_version=3
        ),
        rewards=(1.0, 0.25),
    )
    b = build_batch([g], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 3, 9, 3, 3, 2], [1, 3, 9, 4, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]]
    assert b["rewards"].tolist() == [[0, 0, 0, 0, 0, 1.0], [0, 0, 0, 0.25, 0, 0]]
    # a copy into float32: exactly the float32 roundings of the engine's values
    assert torch.equal(b["engine_logprobs"][0, 3:], torch.tensor([-0.1, -0.2, -0.3]))
    assert b["engine_logprobs"][1].tolist()[3] == float(torch.tensor(-0.4))
    assert b["sample_rewards"].tolist() == [1.0, 0.25]
    assert b["weight_versions"].tolist() == [3, 3] and b["prompt_indices"].tolist() == [5, 5]
    assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.float32


@pytest.mark.parametrize(
    ("sizes", "bound", "want"),
    [
        pytest.param([4, 4, 4, 10, 1], 8, [[0, 1], [2], [3], [4]], id="mixed"),
        pytest.param([1, 1, 1], 100, [[0, 1, 2]], id="one-bucket"),
        pytest.param([50, 50], 10, [[0], [1]], id="oversized-alone"),
        pytest.param([], 10, [], id="empty"),
    ],
)
def test_plan_buckets(sizes: list[int], bound: int, want: list[list[int]]) -> None:
    assert plan_buckets(sizes, bucket_bytes=bound) == want


def test_a_bucket_of_mixed_dtypes_round_trips_over_gloo() -> None:
    # One byte bucket holds the tensors back to back: a bfloat16[5] ends at byte 10, so
    # the float32 after it starts at an offset that is not a multiple of 4 (a bf16 policy
    # with float32 norms, as megatron's local spec keeps them).
    sent = {
        "b": torch.arange(5, dtype=torch.bfloat16),
        "f": torch.tensor([1.5, -2.0, 3.25]),
        "h": torch.tensor([0.5], dtype=torch.float16),
        "i": torch.tensor([[7, -8]], dtype=torch.int64),
    }
    with gloo_refit_pair() as send:
        version, got, stats = send(sent, 3)
    assert version == 3 and stats["buckets"] == 1
    assert got.keys() == sent.keys()
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# -- replay buffer -------------------------------------------------------------------------------


def _scored(gid: int, version: int = 0) -> ScoredGroup:
    samples = tuple(
        SampleOutput(
            token_ids=tuple(range(3, 3 + k + 1)),
            logprobs=tuple(-0.1 * (i + 1) / 3 for i in range(k + 1)),
            finish_reason="stop" if k % 2 else "length",
        )
        for k in range(3)
    )
    out = GroupOutput(
        prompt_index=gid,
        prompt_ids=(1, 3 + gid % 5),
        samples=samples,
        weight_version=version,
        engine_id="e0",
    )
    return ScoredGroup(output=out, rewards=(0.1 * gid, 1 / 3, -2.5))


def test_replay_buffer_lifecycle_and_round_trip(tmp_path: Path) -> None:
    buf = ReplayBuffer()
    for gid in range(5):
        buf.add(_scored(gid, version=gid // 2), step=gid // 3)
    with pytest.raises(ValueError, match="already buffered"):
        buf.add(_scored(0), step=0)
    claimed = buf.claim([1, 0])
    assert [g.prompt_index for g in claimed] == [1, 0]
    with pytest.raises(ValueError, match="not ready"):
        buf.claim([0])
    with pytest.raises(ValueError, match="not claimed"):
        buf.release([2])
    buf.release([1])
    assert 1 not in buf and len(buf) == 4

    buf.save(tmp_path)
    restored = ReplayBuffer.load(tmp_path)
    assert sorted(restored.ready_ids()) == [0, 2, 3, 4]  # the claimed row is ready again
    for gid in (0, 2, 3, 4):
        assert restored.get(gid) == buf.get(gid)  # bit-exact, floats included
        assert restored.step_of(gid) == buf.step_of(gid)
    assert not any(p.suffix == ".pkl" for p in tmp_path.iterdir())


def test_local_hf_tokenizer_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<unk>": 5}
    raw = RawTokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    fast_cls: Any = PreTrainedTokenizerFast
    fast = fast_cls(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello world") == [3, 4]
    assert tok.decode([3, 4, 2]) == "hello world"
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 2, 6)
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_confirm_weights_only_vouches_for_the_version_held() -> None:
    """The driver may clear a restarted engine's ``needs_weights`` only for the version the
    engine really holds; another version must be pushed, not vouched for."""
    engine = EmbeddedEngine(
        model=tiny_qwen2_config(vocab_size=TOK.vocab_size), run_seed=1, weight_version=2
    )
    with pytest.raises(ValueError, match="holds version 2, not 3; push the weights"):
        engine.confirm_weights(version=3)
    assert engine.confirm_weights(version=2) == 2
    assert not engine.health().needs_weights


# -- the rollout manager's filing order (no Ray: calls are answered in a chosen order) ------


class _Calls:
    """An engine handle whose ``generate.remote`` returns a ref; ``ray.get`` answers it."""

    def __init__(self) -> None:
        self.sent: dict[int, list[GroupRequest]] = {}
        self.generate = self

    def remote(self, requests: list[GroupRequest]) -> int:
        ref = requests[0].prompt_index
        self.sent[ref] = requests
        return ref

    def answer(self, ref: int) -> list[GroupOutput]:
        sample = SampleOutput(token_ids=(TOK.eos_id,), logprobs=(0.0,), finish_reason="stop")
        return [
            GroupOutput(
                prompt_index=r.prompt_index,
                prompt_ids=r.prompt_ids,
                samples=(sample,) * PARAMS.n,
                weight_version=0,
            )
            for r in self.sent.pop(ref)
        ]


def _fails_for_2(*, response: str, record: Any, finish_reason: str) -> float:
    if record["index"] == 2:
        raise ZeroDivisionError("the grader crashed")
    return 0.0


@pytest.mark.parametrize("in_order", [True, False], ids=["dispatch-order", "arrival-order"])
def test_manager_files_groups_in_dispatch_order(
    in_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from ppo_driver.rollout import RolloutManager
    from ppo_sampler import InOrderSampler

    records = [dict(r, index=i) for i, r in enumerate(synthetic_records(num_prompts=8, seed=0))]
    data = PromptDataset(records, TOK)
    engine = _Calls()
    monkeypatch.setattr(ray, "get", engine.answer)
    sampler = InOrderSampler(max_lookahead_versions=0, fixed_chunks=in_order)
    m = RolloutManager(
        engines=[engine],
        dataset=data,
        sampler=sampler,
        reward_fn=_fails_for_2,
        params=PARAMS,
        prompts_per_step=4,
        max_in_flight=4,
        reward_timeout_s=None,
        file_in_dispatch_order=in_order,
    )
    m._dispatch(0)  # prompts 0..3, one call each
    filed = [m._collect(ref) for ref in (3, 1, 2)]  # 2 fails: prompt 4 is dispatched
    meta, _ = m.state_dict()  # a checkpoint now: groups held back are generated again
    assert sorted(g for g, _ in meta["to_dispatch"]) == ([0, 1, 3] if in_order else [0])
    m._dispatch(0)
    filed += [m._collect(ref) for ref in (4, 0)]
    if in_order:  # each once all before it are filed or failed
        assert filed == [[], [], [], [], [0, 1, 3, 4]]
    else:
        assert filed == [[3], [1], [], [4], [0]]
    ready = list(sampler.state_dict()["ready"])
    assert [g for g, _, _ in ready] == [g for ids in filed for g in ids]
    assert m.idle() and not m._held


class _Progress:
    """An engine handle: ``generate`` answers group ``g`` with samples of
    ``LENGTHS[g]`` tokens; ``progress`` answers with :attr:`report` as it is then."""

    LENGTHS: ClassVar[dict[int, int]] = {0: 5, 1: 2, 2: 7, 3: 2, 4: 4, 5: 9}

    def __init__(self) -> None:
        self.report: dict[int, int] = {}
        self.asked = 0
        self.generate = _Remote(lambda requests: ("generate", tuple(requests)))
        self.progress = _Remote(self._ask)

    def _ask(self) -> tuple[str, int]:
        self.asked += 1
        return ("progress", self.asked)

    def answer(self, ref: Any) -> Any:
        kind, value = ref
        if kind == "progress":
            return dict(self.report)
        outputs = []
        for r in value:
            n = self.LENGTHS[r.prompt_index]
            tokens = (5,) * (n - 1) + (TOK.eos_id,)
            sample = SampleOutput(token_ids=tokens, logprobs=(0.0,) * n, finish_reason="stop")
            outputs.append(
                GroupOutput(
                    prompt_index=r.prompt_index,
                    prompt_ids=r.prompt_ids,
                    samples=(sample,) * PARAMS.n,
                    weight_version=0,
                )
            )
        return outputs


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def test_manager_files_groups_by_length_once_no_group_out_can_come_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group is filed once every group still out has drawn at least its length (by
    the engine's report; a group finished in the engine but not back is not in it and
    holds the others), in the order of the longest response, prompt index among equals.
    ``claim`` keeps that order."""
    import ray
    from ppo_driver.rollout import RolloutManager
    from ppo_sampler import InOrderSampler

    data = PromptDataset(synthetic_records(num_prompts=6, seed=0), TOK)
    engine = _Progress()
    monkeypatch.setattr(ray, "get", engine.answer)
    monkeypatch.setattr(ray, "wait", lambda refs, **_: (list(refs), []))
    sampler = InOrderSampler(max_lookahead_versions=0, fixed_chunks=True)

    def manager(**filing: Any) -> RolloutManager:
        return RolloutManager(
            engines=[engine],
            dataset=data,
            sampler=sampler,
            reward_fn=lambda **_: 0.0,
            params=PARAMS,
            prompts_per_step=6,
            max_in_flight=6,
            file_by_length=True,
            **filing,
        )

    m = manager(reward_timeout_s=None, progress_interval_s=0.0)
    m._dispatch(0)
    calls = {c.groups[0][0]: ref for ref, c in m._in_flight.items()}

    def back(gid: int) -> list[int]:
        return m._collect(calls[gid])

    def report(drawn: dict[int, int]) -> list[int]:
        engine.report = drawn
        m._ask_progress()
        m._read_progress()
        return m._file_held()

    filed = [back(1)]  # no report yet: every other group may still be shorter
    filed.append(report({0: 2, 2: 2, 4: 2, 5: 2}))  # 3 finished too, but is not back
    filed.append(back(3))
    filed.append(report({0: 4, 2: 4, 5: 4, 1: 9}))  # 4 finished (not listed); 1 is filed
    filed.append(back(4))
    filed.append(back(0))
    filed.append(report({2: 5, 5: 5}))
    filed.append(back(2))
    filed.append(back(5))  # nothing out: the rest goes
    assert filed == [[], [], [1, 3], [], [4], [], [0], [], [2, 5]]
    assert [g for g, _, _ in sampler.state_dict()["ready"]] == [1, 3, 4, 0, 2, 5]
    batch = m.claim([0, 1, 2, 3, 4, 5])
    assert batch["prompt_indices"][:: PARAMS.n].tolist() == [1, 3, 4, 0, 2, 5]
    assert m.idle() and not m._held and not m._unfiled
    with pytest.raises(ValueError, match="two filing orders"):
        manager(file_in_dispatch_order=True)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        pytest.param({"engines": []}, "needs at least one engine", id="no-engine"),
        pytest.param({"prompts_per_step": 0}, r"prompts_per_step=0: use at least 1", id="step"),
        pytest.param(
            {"max_in_flight": 0}, "max_in_flight=0: allow at least one group", id="in-flight"
        ),
        pytest.param({"groups_per_call": 0}, r"groups_per_call=0: use at least 1", id="per-call"),
        pytest.param(
            {"reward_timeout_s": -1.0}, r"reward_timeout_s=-1.0: use seconds > 0", id="timeout"
        ),
        pytest.param(
            {"max_consecutive_group_failures": 0},
            r"max_consecutive_group_failures=0: use at least 1 \(None: never stop\)",
            id="failures",
        ),
    ],
)
def test_rollout_manager_refuses_limits_that_cannot_work(
    dataset: PromptDataset, limits: dict[str, Any], message: str
) -> None:
    """Each limit is refused at construction, naming it, its value and the fix."""
    from ppo_driver.rollout import RolloutManager
    from ppo_sampler import InOrderSampler

    kwargs: dict[str, Any] = {
        "engines": [object()],
        "dataset": dataset,
        "sampler": InOrderSampler(max_lookahead_versions=0),
        "reward_fn": _fails_for_2,
        "params": PARAMS,
        "prompts_per_step": 2,
        "max_in_flight": 2,
        **limits,
    }
    with pytest.raises(ValueError, match=message):
        RolloutManager(**kwargs)


# ------------------------------------------- rules a mutation sweep found untested


def test_synthetic_counts_cover_one_to_max_count() -> None:
    """Counts are uniform in [1, max_count], max_count itself included, up to 99."""
    counts = {r["count"] for r in synthetic_records(num_prompts=500, seed=0, max_count=3)}
    assert counts == {1, 2, 3}
    assert max(r["count"] for r in synthetic_records(num_prompts=500, seed=0, max_count=99)) == 99
    with pytest.raises(ValueError, match="max_count=100"):
        synthetic_records(num_prompts=1, seed=0, max_count=100)


@pytest.mark.parametrize(
    ("lines", "messages", "words"),
    [
        pytest.param(['{"prompt": "a1:"}', '{"prompt": ""}'], False, ":2:", id="empty-string"),
        pytest.param(['{"prompt": []}'], True, ":1:", id="no-messages"),
    ],
)
def test_jsonl_refuses_an_empty_prompt_naming_the_line(
    tmp_path: Path, lines: list[str], messages: bool, words: str
) -> None:
    from ppo_driver.rollout import DataError, read_jsonl

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=words):
        read_jsonl(path, messages=messages)


def test_replay_buffer_refuses_tensors_that_do_not_match_its_metadata() -> None:
    buf = ReplayBuffer()
    for gid in range(2):
        buf.add(_scored(gid), step=0)
    meta, tensors = buf.state_dict()
    key = next(k for k in tensors if "reward" in k)
    tensors[key] = torch.cat([tensors[key], tensors[key][:1]])  # one reward too many
    with pytest.raises(ValueError, match="do not match"):
        ReplayBuffer().load_state_dict(meta, tensors)
