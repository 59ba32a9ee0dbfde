"""``--resume``: which checkpoint (the newest complete one, verified), and whether the
config may continue it (the keys that fix the meaning of the saved state, and the
fingerprints of the files they name)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import yaml

from ppo_driver.checkpoint import (
    CheckpointDamaged,
    checkpoint_step,
    complete_checkpoints,
    find_latest,
    input_fingerprint,
    verify_checkpoint,
)
from ppo_driver.config import (
    DriverConfig,
    model_path,
)
from ppo_driver.startup import StartupError

log = logging.getLogger("ppo_driver")


RESUME_FIXED_KEYS: tuple[str, ...] = (
    "run.seed",  # prompt order, sampling and initial weights
    "ppo.num_prompts_per_step",  # which prompts make step k; replay and sampler state
    "ppo.num_generations_per_prompt",  # rows per group in the replay buffer
    "cluster.actor_gpus",  # data-parallel ranks: one checkpoint file set per rank
    "rollout.dataset_path",  # the prompts (null: the built-in task)
    "rollout.prompt_key",  # the prompt of record i
    "rollout.apply_chat_template",  # the token ids of prompt i
    "rollout.extra",  # e.g. the built-in task's max_count: what prompt i is
    "async_rl.sampler.name",  # the sampler state's format
    *(
        f"{role}.{key}"
        for role in ("policy", "critic")
        for key in (
            "model_path",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "megatron_cfg.enabled",
            "megatron_cfg.tensor_model_parallel_size",
            "megatron_cfg.pipeline_model_parallel_size",
            "megatron_cfg.optimizer.use_distributed_optimizer",
        )
    ),
)
"""Config keys that fix the meaning of a run's saved state: ``--resume`` refuses to
change them (the rest, e.g. ``run.num_steps`` or learning rates, may change)."""


RESUME_INPUT_KEYS: tuple[str, ...] = (
    "rollout.dataset_path",
    "policy.model_path",
    "critic.model_path",
)
"""The :data:`RESUME_FIXED_KEYS` that name files: checkpoints record what they point
at (:func:`ppo_driver.checkpoint.input_fingerprint`), and ``--resume`` compares that,
not the path as written (the same files under another path are the same input)."""


Fingerprints = dict[str, dict[str, str] | None]
"""Per :data:`RESUME_INPUT_KEYS` key: what the path pointed at (``None``: no such input)."""


def resume_inputs(cfg: DriverConfig) -> Fingerprints:
    """The fingerprint of each :data:`RESUME_INPUT_KEYS` input of ``cfg`` (a null
    ``critic.model_path``: the policy's directory, which the critic is built from)."""
    return {
        "rollout.dataset_path": input_fingerprint(cfg.rollout.dataset_path),
        "policy.model_path": input_fingerprint(model_path(cfg, "policy")),
        "critic.model_path": input_fingerprint(model_path(cfg, "critic")),
    }


def _checkpoint_to_resume(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, verified (manifest) before anything reads it."""
    latest = find_latest(ckpt_dir)
    if latest is None:
        return None
    try:
        if not verify_checkpoint(latest):
            log.warning(
                "%s has no manifest (written before ppo-driver checked checkpoints): its "
                "files parse and have the lengths their headers give, contents not verified",
                latest,
            )
    except CheckpointDamaged as exc:
        raise StartupError(_damaged_message(exc, ckpt_dir)) from None
    return latest


def _damaged_message(exc: CheckpointDamaged, ckpt_dir: Path) -> str:
    damaged_step = checkpoint_step(exc.checkpoint) or 0
    fallback: Path | None = None
    for older in reversed(complete_checkpoints(ckpt_dir)):
        if (checkpoint_step(older) or 0) < damaged_step:
            try:
                verify_checkpoint(older)
            except CheckpointDamaged:
                continue
            fallback = older
            break
    out = f"--resume: {exc}. "
    if fallback is None:
        return out + (
            "No older complete checkpoint verifies: start over with --overwrite (deletes the "
            "run directory's contents) or choose another --run-dir"
        )
    return out + (
        f"The newest older checkpoint that verifies is {fallback} ({checkpoint_step(fallback)} "
        f"step(s) done). To continue from it, move {exc.checkpoint.name} out of {ckpt_dir} "
        "(or delete it) and run again with --resume; the steps after it are trained again"
    )


_MISSING = object()


def _dotted(tree: object, key: str) -> object:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _digest(fingerprint: object) -> object:
    return fingerprint.get("sha256") if isinstance(fingerprint, dict) else None


def _shown_input(fingerprint: object) -> str:
    """A recorded input as the refusal names it: its path and the start of its digest."""
    if not isinstance(fingerprint, dict):
        return "(none)"
    return f"{fingerprint.get('path')} (sha256 {str(fingerprint.get('sha256'))[:12]})"


def resume_config_changes(
    saved: Mapping[str, object],
    now: Mapping[str, object],
    *,
    saved_inputs: Mapping[str, object] | None = None,
    inputs: Mapping[str, object] | None = None,
) -> list[str]:
    """``"key: old (saved) -> new (now)"`` for each :data:`RESUME_FIXED_KEYS` entry that
    differs (keys the saved config does not have are skipped). With the fingerprints of
    both (``saved_inputs`` from the checkpoint, ``inputs`` now), the
    :data:`RESUME_INPUT_KEYS` compare what the paths point at, not how they are written."""
    out = []
    compared = saved_inputs is not None and inputs is not None
    if saved_inputs is not None and inputs is not None:
        for key in RESUME_INPUT_KEYS:
            old, new = saved_inputs.get(key, _MISSING), inputs.get(key)
            if old is _MISSING or _digest(old) == _digest(new):
                continue
            out.append(
                f"{key}: {_shown_input(old)} (saved) -> {_shown_input(new)} (now): not the "
                "same input"
            )
    for key in RESUME_FIXED_KEYS:
        if compared and key in RESUME_INPUT_KEYS:
            continue
        old, new = _dotted(saved, key), _dotted(now, key)
        if old is not _MISSING and old != new:
            shown = "(absent)" if new is _MISSING else repr(new)
            out.append(f"{key}: {old!r} (saved) -> {shown} (now)")
    return out


def _check_resume_config(
    cfg: DriverConfig, checkpoint: Path, run_dir: Path, inputs: Mapping[str, object]
) -> None:
    """Refuse a resume whose config changes what the saved state means."""
    state = json.loads((checkpoint / "driver.json").read_text())
    saved, saved_inputs = state.get("config"), state.get("inputs")
    source = checkpoint / "driver.json"
    if not isinstance(saved, dict) and (run_dir / "config.yaml").is_file():
        saved, source = (
            yaml.safe_load((run_dir / "config.yaml").read_text()),
            run_dir / "config.yaml",
        )
    if not isinstance(saved, dict):
        return
    changes = resume_config_changes(
        saved,
        cfg.to_dict(),
        saved_inputs=saved_inputs if isinstance(saved_inputs, dict) else None,
        inputs=inputs,
    )
    if changes:
        raise StartupError(
            f"--resume: {len(changes)} key(s) differ from the config the run in {run_dir} was "
            f"saved with ({source}), and they fix the meaning of its saved state:\n"
            + "".join(f"  - {c}\n" for c in changes)
            + "Continue with the saved values, or start a new run (--overwrite, or another "
            "--run-dir)"
        )
