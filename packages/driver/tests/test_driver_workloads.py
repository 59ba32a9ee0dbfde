"""A user's own model, tokenizer, data and reward, as ``ppo-driver validate`` sees them.

The workload is real and made here (``workload_testlib``): a tiny random Qwen2 saved with
``save_pretrained`` beside a BPE tokenizer trained in-process, JSONL train and held-out
prompt files, a reward in a plain Python file. ``validate`` accepts it; each broken
variant is refused before Ray starts, naming the key, the file and line, and a fix. The
pieces ``train`` builds from it (tokenizer, stop ids, chat template, prompts, reward
from a file, the critic's default model) are checked here too; the run itself is in
``test_driver_workloads_train.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_driver.cli import main
from ppo_driver.config import (
    ConfigError,
    ConfigProblem,
    load_config,
    model_path,
    trainer_configs,
)
from ppo_driver.rollout import (
    DataError,
    GroupOutput,
    HFTokenizer,
    PromptDataset,
    SampleOutput,
    load_reward_fn,
    score_group,
)
from ppo_driver.workload import load_workload
from ppo_trainer import ModelSpec, build_causal_lm, build_value_model
from workload_testlib import (
    REWARD_SOURCE,
    arithmetic_records,
    make_model_dir,
    make_workload,
    workload_overrides,
    write_jsonl,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_workload(tmp_path_factory.mktemp("workload"))


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> dict[str, Path]:
    """Broken variants of the workload's files."""
    root = tmp_path_factory.mktemp("broken")
    good = json.dumps({"prompt": "1+2=", "answer": "3"})
    out = {
        "empty": root / "empty.jsonl",
        "bad_json": root / "bad_json.jsonl",
        "not_object": root / "not_object.jsonl",
        "no_prompt": root / "no_prompt.jsonl",
        "messages": root / "messages.jsonl",
        "outside_alphabet": root / "outside_alphabet.jsonl",
        "raises": root / "raises_on_import.py",
    }
    out["empty"].write_text("\n  \n")
    out["bad_json"].write_text(f"{good}\n{good}\n{{oops\n")
    out["not_object"].write_text(f"{good}\n[1, 2]\n")
    out["no_prompt"].write_text(json.dumps({"question": "1+2="}) + "\n")
    write_jsonl(out["messages"], [{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}])
    write_jsonl(out["outside_alphabet"], [{"prompt": "a3:"}, {"prompt": "What is 1+2?"}])
    out["raises"].write_text("raise RuntimeError('no GPU here')\n")
    # a model directory without its tokenizer, one without weights, one whose tokenizer
    # has no chat template, and one with a smaller vocabulary than the tokenizer
    no_tok = root / "no_tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((files["model"] / name).read_bytes())
    out["no_tokenizer"] = no_tok
    no_weights = root / "no_weights"
    no_weights.mkdir()
    for p in files["model"].iterdir():
        if p.suffix != ".safetensors":
            (no_weights / p.name).write_bytes(p.read_bytes())
    out["no_weights"] = no_weights
    out["no_chat"] = make_model_dir(root / "no_chat", chat_template=False)
    small = root / "small_vocab"
    build_causal_lm(
        ModelSpec(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(str(small))
    out["small_vocab"] = small
    return out


def _errors(overrides: list[str]) -> list[ConfigProblem]:
    _, report = load_config(None, overrides, check=False)
    return report.errors


# --------------------------------------------------------------------------- accepted


def test_cli_validate_accepts_the_workload(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", *workload_overrides(files)]) == 0
    assert "config OK" in capsys.readouterr().out
    assert main(["validate", *workload_overrides(files), "rollout.apply_chat_template=true"]) == 0


def test_train_builds_the_workload_from_the_model_directory(files: dict[str, Path]) -> None:
    cfg, _ = load_config(None, [*workload_overrides(files), "rollout.apply_chat_template=true"])
    work = load_workload(cfg)
    tok = work.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 302
    # EOS and pad from the tokenizer; generation also stops at generation_config's <|end|>
    assert (tok.eos_id, tok.pad_id) == (2, 0)
    assert work.stop_token_ids == (2, 4)
    # every JSONL record, inside the chat template, reaches the reward as `record`
    records = [json.loads(line) for line in files["train"].read_text().splitlines()]
    assert work.dataset.records == records
    first = tok.decode(list(work.dataset.prompt_ids(0)))
    assert first == f"<|user|>{records[0]['prompt']}\n<|assistant|>"
    assert work.eval_dataset is not None and len(work.eval_dataset) == 6
    assert work.reward_fn(response="7", record={"answer": "7"}, finish_reason="stop") == 1.0
    # the policy, its reference and the engine load the directory; the critic defaults to it
    actor, critic = trainer_configs(cfg, vocab_size=tok.vocab_size)
    assert actor.model.path == critic.model.path == str(files["model"].absolute())
    assert model_path(cfg, "critic") == model_path(cfg, "policy")


def test_validate_keeps_the_workload_it_loaded_for_train(
    files: dict[str, Path], broken: dict[str, Path]
) -> None:
    # validate reads the tokenizer, the data and the reward once, with load_workload's
    # code (check_workload), and the ValidConfig carries them to train
    cfg, report = load_config(None, workload_overrides(files))
    work = report.valid().workload
    assert work is not None and isinstance(work.tokenizer, HFTokenizer)
    assert work.dataset.records == load_workload(cfg).dataset.records
    assert work.eval_dataset is not None and work.reward_fn is not None
    # a refused workload: no workload kept; load_workload raises every problem by key
    bad = [*workload_overrides(files), f"rollout.dataset_path={broken['bad_json']}"]
    cfg, report = load_config(None, bad, check=False)
    assert report.workload is None
    with pytest.raises(ConfigError, match=r"rollout\.dataset_path=.*bad_json\.jsonl:3"):
        load_workload(cfg)


def test_without_chat_template_the_prompt_is_encoded_as_is(files: dict[str, Path]) -> None:
    cfg, _ = load_config(None, workload_overrides(files))
    work = load_workload(cfg)
    assert (
        work.tokenizer.decode(list(work.dataset.prompt_ids(1))) == work.dataset.record(1)["prompt"]
    )


def test_message_lists_take_the_chat_template(files: dict[str, Path], tmp_path: Path) -> None:
    tok = HFTokenizer(files["model"])
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]}],
    )
    data = PromptDataset.from_jsonl(path, tok, chat_template=True)
    assert tok.decode(list(data.prompt_ids(0))) == "<|system|>add\n<|user|>1+2=\n<|assistant|>"
    with pytest.raises(DataError, match=r"chat\.jsonl:1: 'prompt' must be a string"):
        PromptDataset.from_jsonl(path, tok, chat_template=False)


def test_critic_value_head_on_the_policy_checkpoint(files: dict[str, Path]) -> None:
    """``critic.model_path`` null: the critic is the policy's checkpoint (every base
    weight loaded from it) plus a new ``score`` head (hidden -> 1): weights drawn from
    N(0, initializer_range), bias 0."""
    _check_value_head(files["model"])


def test_critic_value_head_on_a_plain_causal_lm_checkpoint(tmp_path: Path) -> None:
    """A causal-LM checkpoint without ``classifier_dropout`` in its config (the usual
    case) loads as the critic; its new head is seeded (the same on every rank and run)."""
    path = make_model_dir(tmp_path / "plain")
    _check_value_head(path)
    a = build_value_model(ModelSpec(path=str(path))).score.weight
    assert torch.equal(a, build_value_model(ModelSpec(path=str(path))).score.weight)


def _check_value_head(path: Path) -> None:
    spec = ModelSpec(path=str(path))
    lm: Any = build_causal_lm(spec)
    critic: Any = build_value_model(spec)
    base = lm.model.state_dict()
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, base[name]), name
    head = critic.score
    assert tuple(head.weight.shape) == (1, lm.config.hidden_size)
    assert torch.count_nonzero(head.bias) == 0
    std = lm.config.initializer_range
    assert 0 < head.weight.abs().max() < 6 * std


# --------------------------------------------------------------------------- refused


def _case(
    overrides: Callable[[dict[str, Path], dict[str, Path]], list[str]], key: str, *words: str
) -> tuple[Any, str, tuple[str, ...]]:
    return overrides, key, words


CASES = {
    "dataset-missing": _case(
        lambda f, b: [*workload_overrides(f), "rollout.dataset_path=/nonexistent/train.jsonl"],
        "rollout.dataset_path",
        "/nonexistent/train.jsonl",
        "does not exist",
    ),
    "dataset-empty": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.dataset_path={b['empty']}"],
        "rollout.dataset_path",
        "empty.jsonl",
        "no records",
    ),
    "dataset-bad-json-line": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.dataset_path={b['bad_json']}"],
        "rollout.dataset_path",
        "bad_json.jsonl:3: not valid JSON",
    ),
    "dataset-line-not-object": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.dataset_path={b['not_object']}"],
        "rollout.dataset_path",
        "not_object.jsonl:2: a JSON list, not an object",
    ),
    "dataset-line-without-prompt": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.dataset_path={b['no_prompt']}"],
        "rollout.dataset_path",
        "no_prompt.jsonl:1: no 'prompt' field",
        "'question'",
    ),
    "prompt-key-absent": _case(
        lambda f, b: [*workload_overrides(f), "rollout.prompt_key=question"],
        "rollout.dataset_path",
        "train.jsonl:1: no 'question' field",
    ),
    "messages-without-chat-template": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.dataset_path={b['messages']}"],
        "rollout.dataset_path",
        "messages.jsonl:1: 'prompt' must be a string",
    ),
    "eval-dataset-bad-line": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.eval_dataset_path={b['bad_json']}"],
        "rollout.eval_dataset_path",
        "bad_json.jsonl:3",
    ),
    "eval-every-without-eval-set": _case(
        lambda f, b: [
            f"rollout.dataset_path={f['train']}",
            f"rollout.reward={f['reward']}:reward",
            f"policy.model_path={f['model']}",
            "run.eval_every=5",
        ],
        "run.eval_every",
        "eval_dataset_path",
    ),
    "eval-set-never-evaluated": _case(
        lambda f, b: [*workload_overrides(f, eval_every=0)],
        "rollout.eval_dataset_path",
        "never evaluated",
    ),
    "eval-every-negative": _case(
        lambda f, b: [*workload_overrides(f, eval_every=-1)], "run.eval_every", ">= 0"
    ),
    "reward-file-missing": _case(
        lambda f, b: [*workload_overrides(f), "rollout.reward=/nonexistent/reward.py:reward"],
        "rollout.reward",
        "/nonexistent/reward.py",
        "does not exist",
    ),
    "reward-file-no-function": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.reward={f['reward']}:missing"],
        "rollout.reward",
        "no callable 'missing'",
    ),
    "reward-file-not-callable": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.reward={f['reward']}:NOT_CALLABLE"],
        "rollout.reward",
        "no callable",
    ),
    "reward-file-signature": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.reward={f['reward']}:positional"],
        "rollout.reward",
        "finish_reason",
    ),
    "reward-file-raises-on-import": _case(
        lambda f, b: [*workload_overrides(f), f"rollout.reward={b['raises']}:reward"],
        "rollout.reward",
        "importing it raised RuntimeError: no GPU here",
    ),
    "builtin-reward-on-jsonl": _case(
        lambda f, b: [*workload_overrides(f), "rollout.reward=null"],
        "rollout.reward",
        "built-in reward",
    ),
    "model-without-tokenizer": _case(
        lambda f, b: [*workload_overrides(f), f"policy.model_path={b['no_tokenizer']}"],
        "policy.model_path",
        "no_tokenizer",
        "tokenizer",
    ),
    "model-without-weights": _case(
        lambda f, b: [*workload_overrides(f), f"policy.model_path={b['no_weights']}"],
        "policy.model_path",
        "safetensors",
    ),
    "critic-vocabulary-too-small": _case(
        lambda f, b: [*workload_overrides(f), f"critic.model_path={b['small_vocab']}"],
        "critic.model_path",
        "302 ids",
        "64",
    ),
    "chat-template-missing": _case(
        lambda f, b: [
            *workload_overrides(f),
            f"policy.model_path={b['no_chat']}",
            "rollout.apply_chat_template=true",
        ],
        "rollout.apply_chat_template",
        "no chat_template",
    ),
    "chat-template-with-the-builtin-tokenizer": _case(
        lambda f, b: ["rollout.apply_chat_template=true"],
        "rollout.apply_chat_template",
        "character tokenizer",
    ),
    "char-tokenizer-outside-alphabet": _case(
        lambda f, b: [
            f"rollout.dataset_path={b['outside_alphabet']}",
            "rollout.reward=ppo_driver.rollout:repeat_reward",
        ],
        "rollout.dataset_path",
        "outside_alphabet.jsonl:2: the prompt cannot be encoded",
        "policy.model_path",
    ),
    "max-count-with-a-dataset": _case(
        lambda f, b: [*workload_overrides(f), "rollout.extra={max_count: 5}"],
        "rollout.extra.max_count",
        "no effect",
    ),
    "unknown-task-option": _case(
        lambda f, b: ["rollout.extra={difficulty: 3}"], "rollout.extra.difficulty", "unknown"
    ),
    "task-key-removed": _case(lambda f, b: ["rollout.task=builtin"], "rollout.task", "unknown key"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_validate_refuses_a_broken_workload(
    name: str, files: dict[str, Path], broken: dict[str, Path]
) -> None:
    make, key, words = CASES[name]
    errors = _errors(make(files, broken))
    mine = [p for p in errors if p.key == key]
    assert mine, f"no error for {key}: {[str(p) for p in errors]}"
    text = str(mine[0])
    assert all(w in text for w in words) and "fix:" in text, text


def test_cli_validate_names_every_broken_key_at_once(
    files: dict[str, Path], broken: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "validate",
        f"policy.model_path={broken['no_tokenizer']}",
        f"rollout.dataset_path={broken['bad_json']}",
        f"rollout.eval_dataset_path={broken['empty']}",
        f"rollout.reward={files['reward']}:missing",
        "run.eval_every=2",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    for key in (
        "policy.model_path",
        "rollout.dataset_path",
        "rollout.eval_dataset_path",
        "rollout.reward",
    ):
        assert f"{key}=" in err, err
    assert "bad_json.jsonl:3" in err and "empty.jsonl" in err


def test_model_sizes_beside_a_model_path_are_warned_about(files: dict[str, Path]) -> None:
    _, report = load_config(None, [*workload_overrides(files), "critic.hidden_size=32"])
    assert report.ok, report.errors
    assert [w.key for w in report.warnings] == ["critic.hidden_size"]
    assert "policy.model_path" in str(report.warnings[0])


# --------------------------------------------------------------------------- reward


def test_reward_from_a_file_sync_and_async(files: dict[str, Path]) -> None:
    sync = load_reward_fn(f"{files['reward']}:reward")
    assert sync(response="7", record={"answer": "7"}, finish_reason="stop") == 1.0
    assert sys.modules[sync.__module__].__file__ == str(files["reward"].resolve())
    async_fn = load_reward_fn(f"{files['reward']}:async_reward")
    value = async_fn(response="17", record={"answer": "7"}, finish_reason="length")
    assert asyncio.run(value) == 0.5
    # as the rollout calls it: one record per group, the response decoded
    tok = HFTokenizer(files["model"])
    ids = (*tok.encode("12"), tok.eos_id)
    out = GroupOutput(
        prompt_index=0,
        prompt_ids=(5,),
        samples=(SampleOutput(token_ids=ids, logprobs=(0.0,) * len(ids), finish_reason="stop"),),
        weight_version=0,
    )
    record = arithmetic_records(1, seed=0)[0] | {"answer": "12"}
    for fn in (sync, async_fn):
        assert score_group(out, record=record, reward_fn=fn, tokenizer=tok).rewards == (1.0,)


def test_a_stop_at_a_plain_token_is_not_in_the_rewarded_text(files: dict[str, Path]) -> None:
    """A stop id that decodes to text (a generation config may list a plain token, such as
    a newline, among its EOS ids) is cut from the response before the reward sees it;
    a sample cut at the length limit keeps its last token."""
    tok = HFTokenizer(files["model"])
    newline = tok.encode("\n")
    assert len(newline) == 1 and tok.decode(newline) == "\n"  # a plain, decoded token
    ids = (*tok.encode("12"), *newline)
    seen: list[str] = []

    def reward(*, response: str, record: object, finish_reason: str) -> float:
        seen.append(response)
        return 0.0

    for finish in ("stop", "length"):
        out = GroupOutput(
            prompt_index=0,
            prompt_ids=(5,),
            samples=(
                SampleOutput(token_ids=ids, logprobs=(0.0,) * len(ids), finish_reason=finish),
            ),
            weight_version=0,
        )
        score_group(out, record={}, reward_fn=reward, tokenizer=tok)
    assert seen == ["12", "12\n"]


def test_reward_file_path_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "score.py").write_text(REWARD_SOURCE)
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("rewards/score.py:reward")
    assert fn(response="3", record={"answer": "3"}, finish_reason="stop") == 1.0
    with pytest.raises(ValueError, match="does not exist"):
        load_reward_fn("rewards/nope.py:reward")
