"""Rollout side of the driver: generation engines, weight refit, rewards, the replay
buffer and the rollout manager. See the package README for the API walk-through."""

from ._buffer import ReplayBuffer, build_batch
from ._embedded import EmbeddedEngine, launch_embedded_engines
from ._manager import GroupFailure, RolloutManager
from ._model import build_model, tiny_qwen2_config
from ._refit import (
    DEFAULT_BUCKET_BYTES,
    RefitStats,
    WeightRefitter,
    broadcast_state_dict,
    connect_group,
    load_weights_from_disk,
    open_store,
    plan_buckets,
    receive_state_dict,
    save_weights_to_disk,
)
from ._sampling import draw_tokens, generate_group, generate_rows, sample_seed
from ._sglang import SglangEngine, parse_sglang_output
from ._task import (
    TASK_ALPHABET,
    PromptDataset,
    RewardError,
    RewardFailure,
    RewardFn,
    ScoredGroup,
    load_jsonl,
    load_reward_fn,
    repeat_reward,
    score_group,
    synthetic_records,
)
from ._tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from ._types import (
    EngineHealth,
    EngineRestarted,
    FinishReason,
    GroupOutput,
    GroupRequest,
    RolloutEngine,
    SampleOutput,
    SamplingParams,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TASK_ALPHABET",
    "CharTokenizer",
    "EmbeddedEngine",
    "EngineHealth",
    "EngineRestarted",
    "FinishReason",
    "GroupFailure",
    "GroupOutput",
    "GroupRequest",
    "HFTokenizer",
    "PromptDataset",
    "RefitStats",
    "ReplayBuffer",
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RolloutEngine",
    "RolloutManager",
    "SampleOutput",
    "SamplingParams",
    "ScoredGroup",
    "SglangEngine",
    "Tokenizer",
    "WeightRefitter",
    "broadcast_state_dict",
    "build_batch",
    "build_model",
    "connect_group",
    "draw_tokens",
    "generate_group",
    "generate_rows",
    "launch_embedded_engines",
    "load_jsonl",
    "load_reward_fn",
    "load_tokenizer",
    "load_weights_from_disk",
    "open_store",
    "parse_sglang_output",
    "plan_buckets",
    "receive_state_dict",
    "repeat_reward",
    "sample_seed",
    "save_weights_to_disk",
    "score_group",
    "synthetic_records",
    "tiny_qwen2_config",
]
