"""Make a tiny workload of your own, without any download: a Hugging Face model directory
(a random Qwen2 saved with ``save_pretrained``) holding a REAL tokenizer trained here
(byte-level BPE with the ``tokenizers`` library, a chat template, loadable by
``AutoTokenizer``), JSONL training and held-out prompts, and a reward in a plain file.

    uv run python examples/make_tiny_workload.py workload/
    uv run ppo-driver train --config examples/tiny_workload.yaml

The test suite builds its workloads with this same script.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ppo_trainer import ModelSpec, build_causal_lm

REWARD_FILE = Path(__file__).with_name("arithmetic_reward.py")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|end|>"]
"""The tokenizer's special tokens: pad, bos, eos, unk, and an end-of-turn token that
generation_config.json lists as a second stop token."""


def arithmetic_records(n: int, *, seed: int) -> list[dict[str, Any]]:
    """``{"prompt": "3+4=", "answer": "7", "a": 3, "b": 4}`` records."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "a": a, "b": b})
    return out


def write_jsonl(path: Path, records: Iterable[Mapping[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(dict(r)) + "\n" for r in records))
    return path


def make_tokenizer(path: Path, *, chat_template: bool = True) -> Any:
    """Train a byte-level BPE over arithmetic text and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{r['prompt']}{r['answer']}" for r in arithmetic_records(400, seed=1)]
    corpus += ["What is the sum?", "The answer is", "user assistant system"] * 20
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus, trainer)
    fast_cls: Any = PreTrainedTokenizerFast
    tok = fast_cls(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|end|>"],
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return tok


def make_model_dir(path: Path, *, chat_template: bool = True, seed: int = 0) -> Path:
    """A tiny random Qwen2 + its tokenizer in one Hugging Face directory (a plain
    causal-LM checkpoint: the critic loads it with a new value head)."""
    tok = make_tokenizer(path, chat_template=chat_template)
    spec = ModelSpec(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        seed=seed,
    )
    model: Any = build_causal_lm(spec)
    model.config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(path))
    return path


def make_workload(root: Path) -> dict[str, Path]:
    """Model directory, train and eval JSONL files and a reward file under ``root``."""
    model = make_model_dir(root / "model")
    train = write_jsonl(root / "train.jsonl", arithmetic_records(64, seed=2))
    held_out = write_jsonl(root / "eval.jsonl", arithmetic_records(6, seed=3))
    reward = root / "my_reward.py"
    reward.write_text(REWARD_FILE.read_text())
    return {"model": model, "train": train, "eval": held_out, "reward": reward}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="directory to write the workload into")
    files = make_workload(parser.parse_args().root)
    for name, path in files.items():
        print(f"{name:>6}: {path}")


if __name__ == "__main__":
    main()
