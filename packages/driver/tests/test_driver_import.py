"""The package imports, exposes its version and an explicit, resolvable __all__."""

import importlib
import importlib.metadata
import subprocess
import sys


def test_public_names_resolve() -> None:
    module = importlib.import_module("ppo_driver")
    # The version the package reports is the one it is installed (and released) as.
    assert module.__version__ == importlib.metadata.version("ppo-driver")
    assert isinstance(module.__all__, list)
    for name in module.__all__:
        assert hasattr(module, name), (
            f"ppo_driver.__all__ lists {name!r} but the package does not define it"
        )


def test_a_trainer_process_imports_at_start_what_its_build_would_import() -> None:
    """The driver builds the models one at a time while every rank process starts at
    once: whatever ``build`` imports is serialised per model. ``_Host`` imports it at
    process start instead (here: the optimizer's ``torch._dynamo``, about 1 CPU-s), so
    after that preload, building the actor and the critic imports no module at all."""
    code = """
import sys
from ppo_driver.config import load_config
from ppo_driver.config.packages import trainer_configs
from ppo_driver.workers import _preload_build_modules
from ppo_trainer import ActorWorker, CriticWorker

cfg, _ = load_config(None, [])
actor, critic = trainer_configs(cfg, vocab_size=32)
_preload_build_modules(actor.model)
before = set(sys.modules)
ActorWorker(actor, rank=0, world_size=1, dist_init_method=None)
CriticWorker(critic, rank=0, world_size=1, dist_init_method=None)
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
