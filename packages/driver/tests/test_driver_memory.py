"""``policy.offload_backend`` / ``critic.offload_backend``: mapped to the trainer's
configs, and checked by ``validate`` on this machine's device (memory_saver needs CUDA,
torch_memory_saver and the torch backend; Megatron is host_copy only)."""

from __future__ import annotations

import pytest
import torch
from ppo_driver.cli import main
from ppo_driver.config import load_config, trainer_configs, validate
from ppo_trainer import backend_importable, memory_saver_installed

MEGATRON = [f"{role}.megatron_cfg.enabled=true" for role in ("policy", "critic")]
needs_megatron = pytest.mark.skipif(
    not backend_importable("megatron"), reason="needs the megatron extra"
)


def _problems(*overrides: str) -> dict[str, str]:
    cfg, report = load_config(None, list(overrides), check=False)
    assert [str(p) for p in validate(cfg).errors] == [str(p) for p in report.errors]
    return {p.key: str(p) for p in report.errors}


def test_the_key_reaches_the_trainer_configs() -> None:
    cfg, _ = load_config(None, ["policy.offload_backend=host_copy"])
    actor, critic = trainer_configs(cfg, vocab_size=64)
    assert actor.offload_backend == "host_copy"
    assert critic.offload_backend == "auto"  # the default: resolved on the worker's device
    assert cfg.policy.offload_backend == "host_copy"


def test_auto_and_host_copy_validate_everywhere() -> None:
    for value in ("auto", "host_copy"):
        errors = _problems(f"policy.offload_backend={value}", f"critic.offload_backend={value}")
        assert not {k for k in errors if k.endswith("offload_backend")}, errors


def test_an_unknown_backend_is_named_by_its_yaml_key() -> None:
    errors = _problems("critic.offload_backend=disk")
    assert "critic.offload_backend" in errors, errors
    assert "memory_saver" in errors["critic.offload_backend"]  # the choices, in the fix


@pytest.mark.skipif(
    torch.cuda.is_available() and memory_saver_installed(), reason="memory_saver can run here"
)
def test_memory_saver_is_refused_where_it_cannot_run_with_the_fix() -> None:
    errors = _problems("policy.offload_backend=memory_saver")
    text = errors["policy.offload_backend"]
    assert "needs CUDA" in text or "needs the torch_memory_saver package" in text, text
    assert "fix: set policy.offload_backend='host_copy'" in text
    assert "critic.offload_backend" not in errors


@needs_megatron
def test_megatron_refuses_memory_saver_even_on_cuda() -> None:
    errors = _problems(*MEGATRON, "critic.offload_backend=memory_saver")
    text = errors["critic.offload_backend"]
    assert "not supported by the megatron backend" in text, text
    assert "fix: set critic.offload_backend='host_copy'" in text


def test_cli_validate_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and memory_saver_installed():
        pytest.skip("memory_saver can run here")
    assert main(["validate", "policy.offload_backend=memory_saver"]) == 1
    assert "policy.offload_backend='memory_saver'" in capsys.readouterr().err
