"""What a run leaves in its directory besides checkpoints: ``train.log`` (and the
console's lines), the trained policy as a Hugging Face directory, ``trace.json`` and
``reward.png``, and the summary at the end."""

from __future__ import annotations

import errno
import logging
import shutil
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from ppo_trainer import ModelSpec, save_hf_checkpoint

from ppo_driver._faults import _not_file_only
from ppo_driver._json import as_float, as_int
from ppo_driver.config import DriverConfig
from ppo_driver.metrics import plot_rewards, read_metrics
from ppo_driver.pump import TrainPump
from ppo_driver.trace import TraceRecorder
from ppo_driver.workers import LogFile

log = logging.getLogger("ppo_driver")


def _write_outputs(cfg: DriverConfig, run_dir: Path, trace: TraceRecorder) -> None:
    """``trace.json`` and ``reward.png`` (from ``metrics.jsonl``), however the run ends."""
    trace.write(run_dir / "trace.json")
    metrics_path = run_dir / "metrics.jsonl"
    rows = read_metrics(metrics_path) if metrics_path.exists() else []
    if rows:
        mode = "streaming" if cfg.streaming else "full-batch"
        plot_rewards(rows, run_dir / "reward.png", title=f"{cfg.run.name}: mean reward ({mode})")


def _export_policy(cfg: DriverConfig, pump: TrainPump, spec: ModelSpec, out: Path) -> None:
    """``<run dir>/hf/``: ``config.json`` + ``model.safetensors`` of the trained policy
    (loads with ``AutoModelForCausalLM.from_pretrained``), with the tokenizer files when
    the policy came from ``policy.model_path`` (the built-in task's character tokenizer
    is not a Hugging Face one). Written aside, then renamed over the previous export."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        # not ours to delete: the export would have replaced it
        raise NotADirectoryError(
            errno.ENOTDIR, "the policy export's path is taken by a file (move it away)", str(out)
        )
    weights = pump.export_policy()
    tmp = out.with_name(out.name + ".tmp")
    _remove(tmp)
    try:
        save_hf_checkpoint(weights=weights, spec=spec, path=tmp, role="policy")
        source = cfg.policy.model_path
        if source is not None:
            from transformers import AutoTokenizer  # only for a model directory

            AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(str(tmp))
            generation = Path(source) / "generation_config.json"
            if generation.is_file():
                shutil.copy2(generation, tmp / generation.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        _remove(tmp)  # nothing half-written stays
        raise
    log.info("policy exported to %s (Hugging Face format)", out)


def _remove(path: Path) -> None:
    """Remove ``path`` (a directory tree or a file) if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _summary(rows: Sequence[Mapping[str, object]], *, wall_s: float, run_dir: Path) -> None:
    """The run in two lines: steps, time, chunks per step, how the reward moved."""
    if not rows:
        return
    chunks = [as_int(r["train/chunks"]) for r in rows]
    first, last = rows[0]["rollout/reward_mean"], rows[-1]["rollout/reward_mean"]
    k = max(1, min(10, len(rows) // 4))
    head = sum(as_float(r["rollout/reward_mean"]) for r in rows[:k]) / k
    tail = sum(as_float(r["rollout/reward_mean"]) for r in rows[-k:]) / k
    log.info(
        "done: %d step(s) in %.1f s | chunks per step: %s (mean %.2f) | mean reward %.3f -> %.3f "
        "(first %d vs last %d steps: %.3f -> %.3f) | %s",
        len(rows),
        wall_s,
        ", ".join(f"{c} chunk(s) x {n} step(s)" for c, n in sorted(Counter(chunks).items())),
        sum(chunks) / len(chunks),
        first,
        last,
        k,
        k,
        head,
        tail,
        run_dir,
    )
    log.info(
        "outputs: metrics.jsonl, reward.png, trace.json (open in https://ui.perfetto.dev), train.log, checkpoints/"
    )


def _setup_logging(run_dir: Path, level: str = "INFO") -> logging.Handler:
    root = logging.getLogger("ppo_driver")
    root.setLevel(level)
    handler = LogFile(str(run_dir / "train.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    if not any(getattr(h, "_ppo_console", False) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        console.addFilter(_not_file_only)
        console._ppo_console = True  # type: ignore[attr-defined]
        root.addHandler(console)
    return handler


def _progress_bar(done: int, total: int, *, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"
