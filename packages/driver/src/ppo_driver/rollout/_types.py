"""Value types shared by the engines, the rollout manager and the replay buffer."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    from ray import ObjectRef

FinishReason = Literal["stop", "length"]
"""``stop``: a stop token was produced (and is the last response token);
``length``: ``max_new_tokens`` was reached."""


class SamplingParamsDict(TypedDict):
    """:class:`SamplingParams` as JSON (``to_dict`` / ``from_dict``)."""

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one prompt group is sampled.

    ``n`` samples per prompt; ``temperature == 0`` means greedy; ``top_p`` in (0, 1];
    generation of a sample ends at the first token in ``stop_token_ids`` (kept as the
    last response token) or after ``max_new_tokens`` tokens.
    """

    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: need at least one sample per prompt")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature}: use a finite value >= 0 "
                "(0 means greedy)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: use a value in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: use at least 1")

    def to_dict(self) -> SamplingParamsDict:
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
        }

    @classmethod
    def from_dict(cls, data: SamplingParamsDict) -> SamplingParams:
        return cls(
            n=int(data["n"]),
            temperature=float(data["temperature"]),
            top_p=float(data["top_p"]),
            max_new_tokens=int(data["max_new_tokens"]),
            stop_token_ids=tuple(int(t) for t in data["stop_token_ids"]),
        )


@dataclass(frozen=True, slots=True)
class GroupRequest:
    """One prompt group to generate: ``prompt_index`` is the global prompt id that seeds
    every sample's random stream (together with the run seed, the sample index and the
    engine's weight version)."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"GroupRequest(prompt_index={self.prompt_index}): empty prompt_ids")


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One generated sample: ``token_ids[i]`` was drawn with log-probability
    ``logprobs[i]`` (under the temperature-scaled distribution, before top-p)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True)
class GroupOutput:
    """Every sample of one prompt group, tagged with the weight version that produced
    all of them (an engine switches versions only between groups)."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    samples: tuple[SampleOutput, ...]
    weight_version: int
    engine_id: str = ""


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """What ``health()`` reports. ``incarnation`` changes every time the engine process
    is (re)started, so a caller can tell a restarted engine from a live one.
    ``needs_weights``: Ray restarted this engine and it still holds the weights it was
    built with; it refuses to generate (:class:`EngineRestarted`) until it receives
    weights (refit, disk) or :meth:`RolloutEngine.confirm_weights`."""

    alive: bool
    engine_id: str
    incarnation: str
    weight_version: int
    paused: bool
    memory_released: bool
    groups_served: int
    extra: dict[str, Any] = field(default_factory=dict)
    needs_weights: bool = False


class EngineRestarted(RuntimeError):
    """``generate`` on an engine that Ray restarted and that has not received the
    current weights yet: its initial weights are older than the policy being trained,
    so it generates nothing until the driver brings it up to date
    (:meth:`WeightRefitter.restore_engine`, the rollout manager's ``on_engine_restart``)."""


def check_vouched_version(engine_id: str, *, holds: int, version: int) -> None:
    """``confirm_weights`` of every engine: the driver may only vouch for the version the
    engine really holds; anything else needs the weights pushed."""
    if version != holds:
        raise ValueError(
            f"engine {engine_id}: holds version {holds}, not {version}; push the weights instead"
        )


def restarted_by_ray() -> bool:
    """True inside a Ray actor that Ray has restarted (its constructor runs again after
    the process died); False for a first start and outside Ray actors."""
    import ray

    if not ray.is_initialized():
        return False
    ctx = ray.get_runtime_context()
    if ctx.get_actor_id() is None:
        return False
    with warnings.catch_warnings():  # Ray's accessor reads its own deprecated actor_id
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ctx.was_current_actor_reconstructed)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the driver needs from a generation engine.

    Implementations: :class:`~ppo_driver.rollout.EmbeddedEngine` (CPU default, a Ray
    actor) and :class:`~ppo_driver.rollout.SglangEngine` (GPU, optional extra). Through a
    Ray actor handle every method is called as ``handle.method.remote(...)``.
    """

    def generate(self, requests: Sequence[GroupRequest]) -> list[GroupOutput]:
        """Generate every group of ``requests``; one output per request, same order."""
        ...

    def pause_generation(self) -> None:
        """Stop starting new groups; returns once no group is running."""
        ...

    def continue_generation(self) -> None:
        """Undo :meth:`pause_generation`."""
        ...

    def release_memory(self) -> None:
        """Free device memory (weights and caches); idempotent."""
        ...

    def resume_memory(self) -> None:
        """Undo :meth:`release_memory`; idempotent."""
        ...

    def init_refit_group(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
    ) -> None:
        """Join the weight-broadcast group whose rank 0 is the actor."""
        ...

    def receive_weights(self, *, group_name: str) -> int:
        """Receive one broadcast (header + buckets) and apply it atomically between
        groups; returns the new weight version."""
        ...

    def update_weights_from_disk(self, path: str, *, version: int) -> int:
        """Load a safetensors directory written by :func:`save_weights_to_disk`."""
        ...

    def close_refit_group(self, *, group_name: str) -> None:
        """Drop a weight-broadcast group (its sockets close); unknown names are ignored."""
        ...

    def confirm_weights(self, *, version: int) -> int:
        """The driver vouches that the weights this engine holds are ``version`` (a
        restarted engine before any refit: its initial weights are current). Raises
        ``ValueError`` if the engine holds another version; returns the version."""
        ...

    def health(self) -> EngineHealth:
        """Liveness, weight version and lifecycle state."""
        ...


class RemoteMethod(Protocol):
    """A method of a Ray actor handle: ``.remote(...)`` submits the call."""

    # A Ray call's result is whatever the actor's method returns: the handle does not
    # know it, so the ref's payload is Any (``ray.get`` of it is checked where used).
    def remote(self, *args: object, **kwargs: object) -> ObjectRef[Any]: ...


class ActorRef(Protocol):
    """A Ray actor handle as the driver calls it: ``handle.method.remote(...)``.

    ``ray.actor.ActorHandle`` types every method attribute as ``Never`` (Ray's typed
    actors need ``@ray.method`` on each method), which would leave all code after the
    first call unchecked; every ``ActorHandle`` satisfies this protocol."""

    def __getattr__(self, name: str) -> RemoteMethod: ...


def check_requests(requests: Sequence[GroupRequest]) -> None:
    """Reject duplicate prompt indices inside one call (a bug in the caller)."""
    seen: set[int] = set()
    for req in requests:
        if req.prompt_index in seen:
            raise ValueError(
                f"prompt_index={req.prompt_index} appears twice in one generate() call; "
                "each prompt group must be dispatched once"
            )
        seen.add(req.prompt_index)
