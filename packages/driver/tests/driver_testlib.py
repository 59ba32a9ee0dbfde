"""Overrides shared by the tests that run the real driver: a tiny, reproducible run."""

from __future__ import annotations

TINY_RUN = [
    "run.checkpoint_every=1",
    "run.keep_checkpoints=5",
    "ppo.num_prompts_per_step=8",
    "ppo.num_generations_per_prompt=2",
    "ppo.critic_mini_batch_size=8",
    # per-chunk whitening would make the result depend on where chunk boundaries fall
    # (arrival timing), which differs between any two runs; without it it does not
    "ppo.adv_estimator.normalize_advantages=false",
    "async_rl.min_groups_for_streaming_train=2",  # streaming: several chunks per step
    "async_rl.sampler.max_lookahead_versions=0",
    *(
        f"{role}.{key}={value}"
        for role in ("policy", "critic")
        for key, value in (
            ("hidden_size", 32),
            ("intermediate_size", 64),
            ("num_hidden_layers", 1),
            ("num_attention_heads", 2),
            ("num_key_value_heads", 1),
        )
    ),
]
