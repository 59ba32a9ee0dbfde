"""The ``ppo-driver`` command line: ``train`` and ``validate``.

ppo-driver train                       # built-in tiny task, streaming, ./runs/tiny
ppo-driver train --config my.yaml ppo.num_prompts_per_step=32
ppo-driver train --resume              # continue the run in its run directory
ppo-driver validate --config my.yaml   # every problem at once, exit 1 on errors
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ppo_driver.config import ConfigError, load_config

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppo-driver",
        description="Streaming colocated PPO: actor and critic share training devices, generation runs on its own.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{train,validate}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--config",
            type=Path,
            default=None,
            help="YAML config (default: the built-in tiny task)",
        )
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="dotted overrides, e.g. ppo.num_prompts_per_step=32 async_rl.min_groups_for_streaming_train=8",
        )

    train = sub.add_parser(
        "train", help="run PPO training (the built-in tiny task without --config)"
    )
    common(train)
    train.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="output directory (default: <run.output_dir>/<run.name>)",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in the run directory",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar, log lines only")
    validate = sub.add_parser("validate", help="check a config and report every problem at once")
    common(validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        cfg, report = load_config(args.config, args.overrides, check=False)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    for warning in report.warnings:
        print(warning, file=sys.stderr)
    if args.command == "validate":
        if report.errors:
            print(f"{len(report.errors)} error(s):", file=sys.stderr)
            for problem in report.errors:
                print(f"  - {problem}", file=sys.stderr)
            return 1
        mode = "streaming" if cfg.streaming else "full-batch"
        print(f"config OK ({mode}, {len(report.warnings)} warning(s))")
        return 0
    if report.errors:
        print(f"refusing to start: {len(report.errors)} configuration error(s):", file=sys.stderr)
        for problem in report.errors:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    from ppo_driver.pump import InjectedFailure
    from ppo_driver.run import train

    run_dir = args.run_dir or Path(cfg.run.output_dir) / cfg.run.name
    if args.no_progress:
        cfg.run.progress = False
    try:
        result = train(cfg, run_dir=run_dir, resume=args.resume)
    except InjectedFailure as exc:
        # A crash drill: train() has already run its clean-up (workers, Ray, trace); what
        # the drill tests is that no half-written checkpoint is ever taken as the latest.
        print(f"ppo-driver: {exc}", file=sys.stderr, flush=True)
        os._exit(3)
    return 0 if result.completed_steps >= cfg.run.num_steps else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
