"""Per-device bookkeeping of which models and parts are resident."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ._parts import ALL_PARTS, Part, normalize_parts, parts_label
from ._plan import Action, PlanStep, Transition

__all__ = ["ResidencyError", "ResidencyLedger"]


class ResidencyError(ValueError):
    """A transition would put more on a device than its budget allows."""


@dataclass
class _Entry:
    part_bytes: dict[Part, int]
    resident: set[Part] = field(default_factory=set)


class ResidencyLedger:
    """Which models and parts are resident on each physical device, and their bytes.

    Register each model on each device it occupies (one data-parallel rank's shard
    per device), then record transitions with :meth:`sleep` / :meth:`wake_up` or
    :meth:`apply`, or check a whole plan with :meth:`check_plan`. A wake-up that
    would exceed a device's budget raises :class:`ResidencyError` and changes nothing.

    Args:
        budget_bytes: bytes allowed per device: one number for all devices, a
            mapping ``{device: bytes}``, or ``None`` for the default: the largest
            ``(one model fully resident + every other model's gradients)``, i.e.
            one model plus the other's kept gradients, never two full models.
    """

    def __init__(self, *, budget_bytes: int | Mapping[str, int] | None = None) -> None:
        if isinstance(budget_bytes, int) and budget_bytes < 0:
            raise ValueError(f"budget_bytes: {budget_bytes} is negative; pass bytes >= 0")
        self._budget = budget_bytes
        self._entries: dict[tuple[str, str], _Entry] = {}

    # ----------------------------------------------------------- registration
    def register(
        self,
        model: str,
        *,
        device: str,
        part_bytes: Mapping[Part, int],
        resident: Iterable[Part] = (),
    ) -> None:
        """Add ``model``'s footprint on ``device`` (bytes per part, missing parts: 0).

        Raises:
            ValueError: already registered, or negative bytes.
            ResidencyError: the initially ``resident`` parts exceed the budget.
        """
        key = (model, str(device))
        if key in self._entries:
            raise ValueError(f"model: {model!r} is already registered on {device}")
        sizes = {part: int(part_bytes.get(part, 0)) for part in Part}
        for part, size in sizes.items():
            if size < 0:
                raise ValueError(f"part_bytes[{part.value}]: {size} is negative")
        self._entries[key] = _Entry(sizes)
        parts = frozenset(resident)
        if parts:
            try:
                self._grow(model, parts, f"register({model!r}, resident=...)")
            except ResidencyError:
                del self._entries[key]
                raise

    # ------------------------------------------------------------------ query
    def devices(self) -> list[str]:
        return sorted({device for _, device in self._entries})

    def models(self, device: str | None = None) -> list[str]:
        return sorted({m for m, d in self._entries if device is None or d == str(device)})

    def resident_parts(self, model: str, device: str | None = None) -> frozenset[Part]:
        """Parts of ``model`` resident (on ``device``, or on its first device)."""
        for (m, d), entry in sorted(self._entries.items()):
            if m == model and (device is None or d == str(device)):
                return frozenset(entry.resident)
        raise ValueError(
            f"model: {model!r} is not registered" + (f" on {device}" if device else "")
        )

    def resident_bytes(self, device: str) -> int:
        """Bytes resident on ``device`` over all models."""
        return sum(
            entry.part_bytes[p]
            for (_, d), entry in self._entries.items()
            if d == str(device)
            for p in entry.resident
        )

    def budget(self, device: str) -> int:
        """The byte budget of ``device`` (explicit, or the default rule)."""
        device = str(device)
        if isinstance(self._budget, int):
            return self._budget
        if isinstance(self._budget, Mapping) and device in self._budget:
            return int(self._budget[device])
        entries = [e for (_, d), e in self._entries.items() if d == device]
        totals = [sum(e.part_bytes.values()) for e in entries]
        grads = [e.part_bytes[Part.GRADIENTS] for e in entries]
        if not entries:
            return 0
        return max(totals[i] + sum(grads) - grads[i] for i in range(len(entries)))

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{device: {model: {part: resident bytes}}}`` (JSON-friendly)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (model, device), entry in sorted(self._entries.items()):
            out.setdefault(device, {})[model] = {
                p.value: entry.part_bytes[p] for p in Part if p in entry.resident
            }
        return out

    # ------------------------------------------------------------ transitions
    def sleep(self, model: str, parts: Iterable[Part] = ALL_PARTS) -> None:
        """Record ``model`` putting ``parts`` to sleep on all its devices (idempotent)."""
        chosen = normalize_parts(parts)
        for entry in self._model_entries(model).values():
            entry.resident -= chosen

    def wake_up(self, model: str, parts: Iterable[Part] = ALL_PARTS) -> None:
        """Record ``model`` bringing ``parts`` back (default: all) on all its devices.

        Raises:
            ResidencyError: some device would exceed its budget (nothing changes).
        """
        chosen = normalize_parts(parts)
        self._grow(model, chosen, f"{model}.wake_up({parts_label(chosen)})")

    def apply(self, step: PlanStep) -> None:
        """Record a plan item (``Work`` items only check nothing)."""
        if isinstance(step, Transition):
            if step.action is Action.SLEEP:
                self.sleep(step.role, step.parts)
            else:
                self.wake_up(step.role, step.parts)

    def check_plan(self, plan: Iterable[PlanStep]) -> None:
        """Replay ``plan`` on a copy of this ledger; raise at the first over-budget step."""
        trial = ResidencyLedger(budget_bytes=self._budget)
        for key, entry in self._entries.items():
            trial._entries[key] = _Entry(dict(entry.part_bytes), set(entry.resident))
        for index, step in enumerate(plan):
            try:
                trial.apply(step)
            except ResidencyError as exc:
                raise ResidencyError(f"plan step {index} ({step}): {exc}") from None

    # ---------------------------------------------------------------- helpers
    def _model_entries(self, model: str) -> dict[str, _Entry]:
        found = {d: e for (m, d), e in self._entries.items() if m == model}
        if not found:
            raise ValueError(f"model: {model!r} is not registered; call register() first")
        return found

    def _grow(self, model: str, parts: frozenset[Part], what: str) -> None:
        entries = self._model_entries(model)
        for device, entry in entries.items():
            added = sum(entry.part_bytes[p] for p in parts - entry.resident)
            after = self.resident_bytes(device) + added
            limit = self.budget(device)
            if after > limit:
                others = {
                    m: sorted(p.value for p in e.resident)
                    for (m, d), e in self._entries.items()
                    if d == device and m != model and e.resident
                }
                raise ResidencyError(
                    f"{what}: {device} would hold {after} bytes, over its budget of "
                    f"{limit} bytes (resident already: {others or 'nothing'}). Fix: put "
                    "the other model to sleep first, or raise budget_bytes if the "
                    "device really fits both."
                )
        for entry in entries.values():
            entry.resident |= parts
