"""ppo_sampler: the tail-aware chunk gate and streaming samplers for colocated PPO.

Stdlib only. Pure chunk arithmetic (:func:`plan_chunk`, :func:`chunk_schedule`,
:func:`group_alignment`, :func:`single_chunk_only`; the fixed plan of
``async_rl.deterministic_chunks``: :func:`plan_fixed_chunk`, :func:`fixed_chunk_sizes`) and the stateful ``in_order`` and
``ready_first`` samplers the driver polls (:func:`make_sampler`). A step simulator
(:func:`simulate`, :func:`simulate_minimums`) drives those samplers with modelled
generation and training times to project what streaming buys.
"""

from ppo_sampler._chunk import (
    chunk_schedule,
    fixed_chunk_sizes,
    group_alignment,
    plan_chunk,
    plan_fixed_chunk,
    single_chunk_only,
    tail_floor,
)
from ppo_sampler._config import (
    SAMPLER_NAMES,
    SamplerConfig,
    SamplerConfigError,
    SamplerProblem,
    make_sampler,
)
from ppo_sampler._presets import PRESETS, Preset
from ppo_sampler._samplers import GroupId, InOrderSampler, ReadyFirstSampler, Sampler
from ppo_sampler._simulate import (
    GenerationModel,
    LognormalLengths,
    MeasuredLengths,
    MinimumRow,
    SimStep,
    SimulationResult,
    SimulationTable,
    TrainingCosts,
    Workload,
    default_minimums,
    simulate,
    simulate_minimums,
)

__version__ = "0.3.1"

__all__ = [
    "PRESETS",
    "SAMPLER_NAMES",
    "GenerationModel",
    "GroupId",
    "InOrderSampler",
    "LognormalLengths",
    "MeasuredLengths",
    "MinimumRow",
    "Preset",
    "ReadyFirstSampler",
    "Sampler",
    "SamplerConfig",
    "SamplerConfigError",
    "SamplerProblem",
    "SimStep",
    "SimulationResult",
    "SimulationTable",
    "TrainingCosts",
    "Workload",
    "__version__",
    "chunk_schedule",
    "default_minimums",
    "fixed_chunk_sizes",
    "group_alignment",
    "make_sampler",
    "plan_chunk",
    "plan_fixed_chunk",
    "simulate",
    "simulate_minimums",
    "single_chunk_only",
    "tail_floor",
]
