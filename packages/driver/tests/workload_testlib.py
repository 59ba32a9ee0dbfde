"""A user's workload, made in a temporary directory without any download: a tiny Hugging
Face model directory (a random Qwen2 saved with ``save_pretrained``: config.json,
model.safetensors, generation_config.json) holding a REAL tokenizer trained in-process
(byte-level BPE with the ``tokenizers`` library, saved as tokenizer.json and
tokenizer_config.json with a chat template, loadable by ``AutoTokenizer``), JSONL
training and held-out prompt files, and a reward in a plain Python file."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_EXAMPLE = Path(__file__).parents[3] / "examples" / "make_tiny_workload.py"
_spec = importlib.util.spec_from_file_location("make_tiny_workload", _EXAMPLE)
assert _spec is not None and _spec.loader is not None
example: Any = importlib.util.module_from_spec(_spec)
sys.modules["make_tiny_workload"] = example
_spec.loader.exec_module(example)

# the README's example IS the tests' workload
CHAT_TEMPLATE = example.CHAT_TEMPLATE
SPECIALS = example.SPECIALS
arithmetic_records = example.arithmetic_records
write_jsonl = example.write_jsonl
make_tokenizer = example.make_tokenizer
make_model_dir = example.make_model_dir

REWARD_SOURCE = (
    example.REWARD_FILE.read_text()
    + """

async def async_reward(*, response, record, finish_reason):
    return reward(response=response, record=record, finish_reason=finish_reason)


def positional(text):
    return 0.0


NOT_CALLABLE = 3
"""
)


def make_workload(root: Path) -> dict[str, Path]:
    """Model directory, train and eval JSONL files and a reward file (with extra functions
    the validation tests refuse) under ``root``."""
    files: dict[str, Path] = example.make_workload(root)
    files["reward"].write_text(REWARD_SOURCE)
    return files


def workload_overrides(files: Mapping[str, Path], *, eval_every: int = 1) -> list[str]:
    """The overrides that point a run at ``files`` (:func:`make_workload`)."""
    return [
        f"policy.model_path={files['model']}",
        f"rollout.dataset_path={files['train']}",
        f"rollout.eval_dataset_path={files['eval']}",
        f"rollout.reward={files['reward']}:reward",
        f"run.eval_every={eval_every}",
    ]
