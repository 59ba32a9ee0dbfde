"""Random interleavings of sleep / (partial) wake_up / training: never double free,
never resume twice."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lifecycle_models import assert_bit_exact, batch, loss_fn, make, snapshot
from ppo_lifecycle import ALL_PARTS, FORWARD_PARTS, HostCopyBackend, OffloadManager, Part

_parts = st.frozensets(st.sampled_from(list(Part)), min_size=1)


class StrictBackend(HostCopyBackend):
    """Host copy that records every call and fails loudly on misuse."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.offloaded: set[Part] = set()
        self.log: list[tuple[str, Part]] = []

    def offload(self, part, groups):  # type: ignore[no-untyped-def]
        assert part not in self.offloaded, f"double free of {part}"
        for group in groups:
            assert group.storage.nbytes() > 0, f"{part}: storage already released"
        self.offloaded.add(part)
        self.log.append(("offload", part))
        return super().offload(part, groups)

    def reload(self, part):  # type: ignore[no-untyped-def]
        assert part in self.offloaded, f"resume of {part} that is resident"
        self.offloaded.discard(part)
        self.log.append(("reload", part))
        return super().reload(part)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.opt = make(seed=3)
        self.backend = StrictBackend()
        self.reloads = 0
        self.manager = OffloadManager(
            self.model,
            self.opt,
            backend=self.backend,
            on_reload_process_groups=self._count_reload,
        )
        self.expected = snapshot(self.model, self.opt)
        self.asleep: set[Part] = set()
        self.seed = 0

    def _count_reload(self) -> None:
        self.reloads += 1

    @rule(parts=_parts)
    def sleep(self, parts: frozenset[Part]) -> None:
        self.manager.sleep(parts=parts)
        self.asleep |= parts

    @rule()
    def wake_up(self) -> None:
        before = self.reloads
        self.manager.wake_up()
        self.asleep.clear()
        assert self.reloads == before + 1  # process groups re-established every time

    @rule(parts=_parts)
    def wake_up_parts(self, parts: frozenset[Part]) -> None:
        before = self.reloads
        self.manager.wake_up(parts=parts)  # only these come back; the rest stay asleep
        self.asleep -= parts
        assert self.reloads == before + 1

    @precondition(lambda self: not self.asleep)
    @rule(step=st.booleans())
    def train(self, step: bool) -> None:
        self.seed += 1
        loss_fn(self.model, batch(self.seed)).backward()
        if step:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.expected = snapshot(self.model, self.opt)

    @precondition(lambda self: self.asleep and Part.GRADIENTS not in self.asleep)
    @rule()
    def accumulate_while_asleep(self) -> None:
        # The driver may touch kept gradients while parameters are away.
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
        self.expected = {
            k: (v * 0.5 if k.startswith("grad.") else v) for k, v in self.expected.items()
        }

    @invariant()
    def state_is_consistent(self) -> None:
        assert self.manager.asleep_parts == self.asleep
        assert self.backend.offloaded == self.asleep
        assert self.manager.is_asleep is bool(self.asleep)
        for part in Part:
            for tensor in _tensors(self, part):
                released = tensor.untyped_storage().nbytes() == 0
                assert released is (part in self.asleep), (part, released)
        if not self.asleep:
            assert_bit_exact(self.expected, snapshot(self.model, self.opt))

    def teardown(self) -> None:
        self.manager.wake_up()
        assert self.backend.offloaded == set()
        assert_bit_exact(self.expected, snapshot(self.model, self.opt))
        self.manager.sleep(parts=ALL_PARTS)
        assert self.manager.device_bytes() == 0
        self.manager.wake_up()


def _tensors(machine: Lifecycle, part: Part) -> list[torch.Tensor]:
    model, opt = machine.model, machine.opt
    if part is Part.PARAMETERS:
        return list(model.parameters())
    if part is Part.BUFFERS:
        return list(model.buffers())
    if part is Part.GRADIENTS:
        return [p.grad for p in model.parameters() if p.grad is not None]
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


Lifecycle.TestCase.settings = settings(max_examples=20, stateful_step_count=15, deadline=None)
TestLifecycle = Lifecycle.TestCase


def test_process_groups_released_by_each_sleep_after_a_wake_up() -> None:
    """Partial wake-ups reload the groups; the next sleep releases them again, even
    though some parts never woke (the optimizer state while a forward runs)."""
    model, opt = make()
    loss_fn(model, batch(0, "cpu")).backward()
    opt.step()
    events: list[str] = []
    manager = OffloadManager(
        model,
        opt,
        on_release_process_groups=lambda: events.append("release"),
        on_reload_process_groups=lambda: events.append("reload"),
    )
    manager.sleep()
    manager.wake_up(parts=FORWARD_PARTS)
    manager.sleep()
    manager.sleep()  # nothing left to move: no second release
    manager.wake_up()
    assert events == ["release", "reload", "release", "reload"]
