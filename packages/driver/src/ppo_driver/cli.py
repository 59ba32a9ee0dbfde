"""The ``ppo-driver`` command line: ``train`` and ``validate``.

ppo-driver train                       # built-in tiny task, streaming, ./runs/tiny
ppo-driver train --config my.yaml ppo.num_prompts_per_step=32
ppo-driver train --resume              # continue the run in its run directory
ppo-driver train --overwrite           # start over in a used run directory
ppo-driver validate --config my.yaml   # every problem at once, exit 1 on errors
ppo-driver simulate --from runs/tiny   # project step times for other settings (a model)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ppo_driver._watch import AbruptEndWatch
    from ppo_driver.config import ValidConfig

__all__ = ["main"]


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and the subcommands' parsers (overrides may come before,
    between and after the flags: the subcommands parse intermixed arguments)."""
    parser = argparse.ArgumentParser(
        prog="ppo-driver",
        description="Streaming colocated PPO: actor and critic share training devices, "
        "generation runs on its own.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{train,validate,simulate}")

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
            help="dotted overrides, e.g. ppo.num_prompts_per_step=32 "
            "async_rl.min_groups_for_streaming_train=8 (before or after the flags)",
        )

    train = sub.add_parser(
        "train", help="run PPO training (the built-in tiny task without --config)"
    )
    common(train)
    train.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="output directory (default: <run.output_dir>/<run.name>); a new run needs "
        "it empty, one run at a time may use it",
    )
    start = train.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in the run directory (verified "
        "first; if it is damaged the message names the file and the older checkpoint to "
        "use: move the damaged one out of checkpoints/ and --resume again)",
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run directory's contents and start a new run there",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar, log lines only")
    validate = sub.add_parser("validate", help="check a config and report every problem at once")
    common(validate)
    simulate = sub.add_parser(
        "simulate", help="fit the step simulator on a run and project other settings"
    )
    _simulate_options(simulate)
    return parser, {"train": train, "validate": validate, "simulate": simulate}


def _simulate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="run_dir", type=Path, required=True, help="a run directory")
    p.add_argument(
        "--min-groups", default=None, help="minimums to project, comma separated (default: a sweep)"
    )
    p.add_argument("--batch", type=int, default=None, help="another ppo.num_prompts_per_step")
    p.add_argument("--engines", type=int, default=None, help="another rollout.num_engines")
    p.add_argument("--lookahead", type=int, default=None, help="another sampler lookahead bound")
    p.add_argument(
        "--deterministic-chunks",
        choices=("true", "false"),
        default=None,
        help="another async_rl.deterministic_chunks: fixed blocks (true) or chunks as groups "
        "arrive (false); default: the run's",
    )
    p.add_argument("--no-streaming", action="store_true", help="the full batch only")
    p.add_argument("--steps", type=int, default=8, help="simulated steps (the first warms up)")
    p.add_argument(
        "--skip-steps", type=int, default=1, help="the run's first steps not to fit on (start-up)"
    )


def _simulate(args: argparse.Namespace) -> int:
    from ppo_driver.simulate import main as simulate_main

    try:
        lows = None if args.min_groups is None else [int(m) for m in args.min_groups.split(",")]
        print(
            simulate_main(
                args.run_dir,
                minimums=lows,
                batch=args.batch,
                engines=args.engines,
                lookahead=args.lookahead,
                streaming=not args.no_streaming,
                steps=args.steps,
                skip_steps=args.skip_steps,
                deterministic_chunks=(
                    None
                    if args.deterministic_chunks is None
                    else args.deterministic_chunks == "true"
                ),
            )
        )
    except ValueError as exc:
        print(f"ppo-driver simulate: {exc}", file=sys.stderr)
        return 2
    return 0


def _parse(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser, commands = _parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in commands:
        ns = commands[args[0]].parse_intermixed_args(args[1:])
        ns.command = args[0]
        return parser, ns
    return parser, parser.parse_args(args)


def _say(message: str) -> None:
    print(f"ppo-driver: {message}", file=sys.stderr, flush=True)


def _resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    words = ["ppo-driver", "train", "--run-dir", str(run_dir), "--resume"]
    if args.config is not None:
        words += ["--config", str(args.config)]
    return shlex.join(words + list(args.overrides))


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = _parse(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "simulate":
        return _simulate(args)
    # imported after parsing: `ppo-driver --help` answers without loading torch
    from ppo_driver.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.command != "validate" and args.no_progress:
        overrides.append("run.progress=false")
    try:
        cfg, report = load_config(args.config, overrides, check=False)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    for warning in report.warnings:
        print(warning, file=sys.stderr)
    if args.command == "validate":
        from ppo_driver.startup import FAIL_ENV, StartupError, parse_fail_at

        try:
            parse_fail_at(os.environ.get(FAIL_ENV))
        except StartupError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
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
    run_dir = args.run_dir or Path(cfg.run.output_dir) / cfg.run.name
    watch = _watch_for_abrupt_end(cfg.cluster.address, run_dir, _resume_command(args, run_dir))
    try:
        return _train(report.valid(), args, run_dir, watch)
    finally:
        if watch is not None:
            watch.done()


def _watch_for_abrupt_end(address: str | None, run_dir: Path, resume: str) -> AbruptEndWatch | None:
    """On a joined cluster at ``host:port``, the watcher that reports the end Ray gives a
    driver whose node lost its raylet (:mod:`ppo_driver._watch`)."""
    if address is None or ":" not in address:
        return None
    from ppo_driver._watch import AbruptEndWatch

    return AbruptEndWatch(address=address, run_dir=run_dir, resume_command=resume)


def _train(valid: ValidConfig, args: argparse.Namespace, run_dir: Path,
           watch: AbruptEndWatch | None) -> int:  # fmt: skip
    from ppo_driver.pump import InjectedFailure, NonFiniteError
    from ppo_driver.rollout import RewardFailure
    from ppo_driver.run import RunFailed, RunStopped, StartupError, last_checkpoint_note, train

    try:
        result = train(valid, run_dir=run_dir, resume=args.resume, overwrite=args.overwrite)
    except StartupError as exc:
        _say(f"refusing to start: {exc}")
        return 1
    except RunStopped as stop:
        _say(f"stopped by {stop.signal_name}; the workers, the engines and Ray are shut down")
        _say(last_checkpoint_note(run_dir))
        _say(f"to continue: {_resume_command(args, run_dir)}")
        return stop.exit_code
    except NonFiniteError as exc:
        _say(f"stopped: {exc}")
        _say(f"nothing of that step was applied or recorded; {last_checkpoint_note(run_dir)}")
        return 1
    except RewardFailure as exc:
        # The reward function failed for too many groups in a row: a bug in the reward,
        # not in the run. Ray and the workers are already shut down by train().
        _say(f"stopped: {exc}")
        _say(last_checkpoint_note(run_dir))
        return 1
    except RunFailed as exc:
        # A fault during the run (a dead worker, a lost cluster, an I/O error): train()
        # has torn down what it could; the traceback is in train.log.
        _say(f"stopped at step {exc.step}: {exc.what}")
        _say(f"the workers and engines are shut down; the traceback is in {run_dir / 'train.log'}")
        _say(last_checkpoint_note(run_dir))
        _say(f"to continue: {_resume_command(args, run_dir)}")
        if exc.cluster_lost:  # Ray's client cannot disconnect from a cluster that is gone
            if watch is not None:
                watch.done()
            sys.stdout.flush()
            os._exit(1)
        return 1
    except InjectedFailure as exc:
        # A crash drill: train() has already run its clean-up (workers, Ray, trace); what
        # the drill tests is that no half-written checkpoint is ever taken as the latest.
        _say(str(exc))
        if watch is not None:
            watch.done()
        os._exit(3)
    return 0 if result.completed_steps >= valid.config.run.num_steps else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
