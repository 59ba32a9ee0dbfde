"""A tiny real model for the lifecycle tests: tied weights, a buffer, Adam."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ppo_lifecycle import OffloadManager


class TinyLM(nn.Module):
    """Embedding tied to the output head, one hidden layer, a norm and a buffer."""

    def __init__(self, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names
        self.register_buffer("temperature", torch.tensor([0.5, 2.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] long -> logits [B, T, vocab]."""
        h = torch.tanh(self.hidden(self.embed(tokens)))
        temperature: torch.Tensor = self.temperature
        return self.head(self.norm(h)) / temperature[0]


def make(seed: int = 0, device: str = "cpu") -> tuple[TinyLM, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = TinyLM().to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (4, 6), generator=gen).to(device)


def loss_fn(model: TinyLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def train_step(model: TinyLM, opt: torch.optim.Optimizer, seed: int) -> None:
    loss_fn(model, batch(seed, str(next(model.parameters()).device))).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor, cloned."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[f"opt.{i}.{k}"] = v.detach().clone()
    for i, p in enumerate(model.parameters()):
        if p.grad is not None:
            out[f"grad.{i}"] = p.grad.detach().clone()
    return out


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(
            a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)
        ), key


def assert_a_failed_sleep_kept_everything(
    manager: OffloadManager,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    before: dict[str, torch.Tensor],
    resident: int,
) -> None:
    """After a sleep that raised: awake, every byte still on the device, the state bit
    for bit ``before``, and a retried sleep and wake-up round-trip it."""
    assert not manager.is_asleep and manager.device_bytes() == resident
    assert_bit_exact(before, snapshot(model, opt))
    manager.sleep()
    manager.wake_up()
    assert_bit_exact(before, snapshot(model, opt))
