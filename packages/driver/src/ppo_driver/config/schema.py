"""The driver's YAML schema: one dataclass per section, with the document's key names
(``ppo.*``, ``async_rl.*``, ``policy.megatron_cfg.*``) and their defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from ppo_sampler import group_alignment
from ppo_trainer import ModelSpec, data_parallel_size

Role = Literal["policy", "actor", "critic"]
"""A trained model: ``policy`` (its YAML section; ``actor`` is the same model) or ``critic``."""

T = TypeVar("T")

RANGES: dict[str, Callable[[Any], bool]] = {
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    ">= 0 (0: greedy)": lambda v: v >= 0,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
}
"""The declared ranges of :func:`bounded` fields, by the words ``validate`` reports."""


def bounded(default: T, rule: str, *, choices: tuple[str, ...] = (), example: object = None) -> T:
    """A field of a key no package reads, with its rule declared here: a value outside
    ``rule`` (a :data:`RANGES` key, or the ``choices`` in words) is refused by ``validate``
    under its YAML key (fix: ``e.g. example``). A null value is not checked."""
    ok = choices.__contains__ if choices else RANGES[rule]
    return field(default=default, metadata={"rule": rule, "ok": ok, "example": example})


class _Section:
    """Base of the sections: one that :func:`freeze` froze refuses every assignment (the
    config inside a ``ValidConfig``); a plain ``DriverConfig`` stays editable."""

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: a validated config is frozen "
                "(edit a DriverConfig and validate it again)"
            )
        object.__setattr__(self, name, value)


def freeze(section: _Section) -> None:
    """Freeze ``section`` and every section inside it."""
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        child = getattr(section, f.name)
        if isinstance(child, _Section):
            freeze(child)
    object.__setattr__(section, "_frozen", True)


#: ``rollout.groups_per_call: null`` with the embedded engine. Its calls' CPU (a Ray task,
#: a thread in the engine, a result to collect) is the trainers': on the built-in task (2
#: cores, interleaved 50-step runs) 16 groups per call cost 0.53-0.54 CPU-s a step in all
#: processes against 0.55-0.57 with 4 (the driver 0.037 against 0.048, the engine 0.047
#: against 0.057), and 64 no less than 16. With the default blocks
#: (``min_groups_for_streaming_train`` 16, dispatch order) a call is one block: no block
#: waits for another's groups.
EMBEDDED_GROUPS_PER_CALL = 16


def generation_on_shared_cores(*, engine: str, decode_delay_s: float) -> bool:
    """Whether generation takes its compute from the trainers' machine (the embedded
    engine without a ``decode_delay_s``), rather than running on devices of its own
    (sglang, or the decode delay that emulates them)."""
    return engine == "embedded" and not decode_delay_s


def groups_per_call(given: int | None, *, engine: str, decode_delay_s: float) -> int:
    """``rollout.groups_per_call`` resolved: ``given``, or for null
    :data:`EMBEDDED_GROUPS_PER_CALL` with the embedded engine and no decode delay (its
    calls' CPU is the trainers'), else 1 (each group handed over as it finishes)."""
    if given is not None:
        return given
    shared = generation_on_shared_cores(engine=engine, decode_delay_s=decode_delay_s)
    return EMBEDDED_GROUPS_PER_CALL if shared else 1


def block_order(given: str | None, *, engine: str, decode_delay_s: float) -> str:
    """``async_rl.block_order`` resolved: ``given``, or for null ``dispatch`` with
    generation on the trainers' cores (a step's groups are all done when it starts) and
    ``length`` where generation has devices of its own and the engine reports its
    progress (the embedded engine with a ``decode_delay_s``), else ``dispatch``."""
    if given is not None:
        return given
    shared = generation_on_shared_cores(engine=engine, decode_delay_s=decode_delay_s)
    return "length" if engine == "embedded" and not shared else "dispatch"


def deterministic_chunks(
    given: bool | None,
    *,
    engine: str,
    decode_delay_s: float,
    sampler: str,
    lookahead: int,
    order: str = "dispatch",
) -> bool:
    """``async_rl.deterministic_chunks`` resolved: ``given``, or for null true where
    fixed blocks keep the overlap and the sampler allows them (``in_order`` without a
    look-ahead): generation on the trainers' cores (:func:`generation_on_shared_cores`:
    the steps are training-bound, the next step's groups are all done when it starts),
    or blocks in ``order`` ``length`` (:func:`block_order`: a block fills as its groups
    finish). With generation on devices of its own and blocks in dispatch order the
    groups of a block finish over the whole step (a block waits for its slowest), so
    null cuts chunks as groups arrive, which overlaps more."""
    if given is not None:
        return given
    shared = generation_on_shared_cores(engine=engine, decode_delay_s=decode_delay_s)
    return (shared or order == "length") and sampler == "in_order" and lookahead == 0


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class RunConfig(_Section):
    """Run bookkeeping (not from the document)."""

    name: str = "tiny"
    output_dir: str = "runs"
    seed: int = 0
    num_steps: int = bounded(100, ">= 1")
    checkpoint_every: int = bounded(25, ">= 0")
    keep_checkpoints: int = bounded(2, ">= 1")
    # Greedy evaluation of rollout.eval_dataset_path after every eval_every-th step (and
    # the last); eval/* in that step's metrics row. 0: off.
    eval_every: int = bounded(0, ">= 0")
    progress: bool = True
    # TensorBoard event files under <run dir>/tensorboard/ (every numeric metric), besides
    # metrics.jsonl and the console line; needs the extra ppo-driver[tensorboard].
    tensorboard: bool = False
    # Level of the project's loggers (ppo_driver, ppo_trainer, ppo_lifecycle, ...) in
    # train.log, the trainer worker processes' lines included: DEBUG, INFO, WARNING, ERROR.
    log_level: str = bounded("INFO", f"one of {', '.join(LOG_LEVELS)}", choices=LOG_LEVELS,
                             example="INFO")  # fmt: skip


ADV_NORMALIZATIONS = ("previous_step", "chunk")
BLOCK_ORDERS = ("dispatch", "length")
"""``async_rl.block_order`` values: the order of a step's groups that fixed blocks cut."""


@dataclass
class AdvEstimatorConfig(_Section):
    normalize_advantages: bool = True
    # previous_step (the project's): every chunk of a step is whitened with the statistics
    # of the previous step's whole batch, fixed before the step starts (none yet: not
    # normalised), so a streamed step learns what a full-batch step learns.
    # chunk (the streaming document's): each chunk with its own statistics (full-batch:
    # the batch's), so the chunk boundaries change the gradients.
    normalization: str = bounded("previous_step", " or ".join(ADV_NORMALIZATIONS),
                                 choices=ADV_NORMALIZATIONS, example="previous_step")  # fmt: skip
    gamma: float = bounded(1.0, "in [0, 1]")
    lam: float = bounded(0.95, "in [0, 1]")


@dataclass
class PPOConfig(_Section):
    num_prompts_per_step: int = 64
    num_generations_per_prompt: int = bounded(4, ">= 1")
    ppo_epochs: int = bounded(4, ">= 1")
    critic_ppo_epochs: int = bounded(2, ">= 1")
    critic_warmup_steps: int = bounded(0, ">= 0")
    critic_mini_batch_size: int = bounded(32, ">= 1")
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    kl_coef: float = 0.0
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "sample"
    adv_estimator: AdvEstimatorConfig = field(default_factory=AdvEstimatorConfig)


@dataclass
class SamplerCfg(_Section):
    name: str = "in_order"
    # 0: each step's generation starts after the previous update and refit (see the
    # README: on the 2-core CPU task this is what leaves streaming a tail to overlap).
    max_lookahead_versions: int = 0
    max_staleness_versions: int = 1
    evict_stale: bool = False


@dataclass
class AsyncRLConfig(_Section):
    min_groups_for_streaming_train: int = 16
    # true: chunks cut at fixed positions of each step's dispatch order (bitwise reruns,
    # and with matching micro-batches a streamed step equals a full-batch step bit for
    # bit); false: as groups arrive; null: DriverConfig.fixed_chunks decides
    deterministic_chunks: bool | None = None
    # with deterministic_chunks: every block that is ready in one chunk (true) or one
    # chunk per block (false); the same bits either way, fewer calls with true
    merge_ready_blocks: bool = True
    # the order fixed blocks cut a step's groups in: dispatch (prompt order), or length
    # (longest response first to last, by the engines' progress reports: a block fills as
    # early as its groups finish); null: DriverConfig.block_order decides
    block_order: str | None = bounded(None, " or ".join(BLOCK_ORDERS), choices=BLOCK_ORDERS,
                                      example="length")  # fmt: skip
    max_prompts_in_flight: int = bounded(0, ">= 0")  # 0: num_prompts_per_step * (1 + lookahead)
    poll_interval_s: float = bounded(0.02, "> 0")
    sampler: SamplerCfg = field(default_factory=SamplerCfg)


@dataclass
class MegatronOptimizerCfg(_Section):
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False


@dataclass
class MegatronCfg(_Section):
    enabled: bool = False
    use_megatron_fsdp: bool = False
    fp8_param: bool = False
    fp8_recipe: str | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # auto: Transformer Engine's layer spec when TE imports and CUDA is present, else local
    transformer_impl: str = "auto"
    optimizer: MegatronOptimizerCfg = field(default_factory=MegatronOptimizerCfg)


@dataclass
class ModelConfig(_Section):
    """One trained model (``policy`` or ``critic``)."""

    model_path: str | None = None
    # the tiny model's sizes (no model_path): ppo_trainer.ModelSpec's defaults
    hidden_size: int = ModelSpec.hidden_size
    intermediate_size: int = ModelSpec.intermediate_size
    num_hidden_layers: int = ModelSpec.num_hidden_layers
    num_attention_heads: int = ModelSpec.num_attention_heads
    num_key_value_heads: int = ModelSpec.num_key_value_heads
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    train_micro_batch_size: int | None = None
    # auto | host_copy | memory_saver: how sleep moves the model off its device (auto:
    # memory_saver on CUDA with torch_memory_saver and the torch backend, else host_copy)
    offload_backend: str = "auto"
    # float32 | bfloat16: the weights' dtype (the engine's too). bfloat16 needs
    # megatron_cfg.enabled (bf16 compute, fp32 master weights in the optimizer)
    dtype: str = "float32"
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)


@dataclass
class ClusterConfig(_Section):
    """Devices: actor and critic share ``actor_gpus``; generation gets ``rollout_gpus``."""

    actor_gpus: int = 1
    rollout_gpus: int = 1
    colocate: bool = False
    # true: the local cluster declares the layout's GPUs as logical Ray resources (CPU
    # runs); false: it offers the machine's CUDA devices (validate checks there are enough)
    logical_gpus: bool = True
    num_cpus: int | None = bounded(None, ">= 1")
    # null: start a local Ray cluster; "auto" or "host:port": join the existing cluster
    # (`ray start`) at that GCS address, and leave it running at the end.
    address: str | None = None


@dataclass
class RolloutConfig(_Section):
    # The prompts: null, the built-in task; else a JSONL file, one object per line with
    # a `prompt_key` field (every field reaches the reward as `record`).
    dataset_path: str | None = None
    prompt_key: str = "prompt"
    # The tokenizer's chat template around each prompt (a string, or a list of
    # {"role", "content"} messages); needs policy.model_path's tokenizer to have one.
    apply_chat_template: bool = False
    # Held-out prompts (JSONL, same prompt_key), evaluated every run.eval_every steps.
    eval_dataset_path: str | None = None
    reward: str | None = None
    max_new_tokens: int = bounded(12, ">= 1")
    temperature: float = bounded(1.0, ">= 0 (0: greedy)")
    top_p: float = bounded(1.0, "in (0, 1]", example=1.0)
    num_engines: int = bounded(1, ">= 1")
    # Groups an engine gets in one generate call. A call returns when all of its groups
    # are done: 1 hands each group to the trainers the moment it finishes (what long
    # generation tails need); more cost the driver and the engine less CPU per group.
    # null: 4 with the embedded engine (its calls' CPU is taken from the cores the
    # trainers and its own decoding use), 1 with sglang or a decode_delay_s (which
    # emulates a generation device of its own).
    groups_per_call: int | None = bounded(None, ">= 1")
    # Seconds each decode step of the embedded engine takes at least (it sleeps what its
    # compute left): emulates a slower generation device on CPU (tests, what-if
    # benchmarks) whose speed does not depend on the trainers' load; 0 in real runs.
    decode_delay_s: float = bounded(0.0, ">= 0")
    # A reward call that takes longer fails its group (0: no limit).
    reward_timeout_s: float = bounded(60.0, ">= 0")
    # The run stops with the first failure's traceback when this many groups fail in a
    # row (reward raised, timed out, or returned something that is not a real number).
    max_consecutive_group_failures: int = bounded(32, ">= 1")
    extra: dict[str, Any] = field(default_factory=dict)
    # The generation engine: "embedded" (plain torch, CPU or GPU) or "sglang" (the extra
    # ppo-driver[sglang], CUDA); engine_kwargs: extra sglang.Engine server arguments.
    engine: str = "embedded"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DriverConfig(_Section):
    run: RunConfig = field(default_factory=RunConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    policy: ModelConfig = field(default_factory=ModelConfig)
    critic: ModelConfig = field(default_factory=lambda: ModelConfig(lr=3e-3))
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    # ------------------------------------------------------------- derived values
    @property
    def batch_groups(self) -> int:
        return self.ppo.num_prompts_per_step

    @property
    def max_in_flight(self) -> int:
        """Groups the rollout manager keeps dispatched at most (``max_prompts_in_flight``;
        0: the batch times ``1 + max_lookahead_versions``)."""
        lookahead = self.async_rl.sampler.max_lookahead_versions
        return self.async_rl.max_prompts_in_flight or self.batch_groups * (1 + lookahead)

    @property
    def groups_per_call(self) -> int:
        """Groups per generate call (``rollout.groups_per_call``; null:
        :data:`EMBEDDED_GROUPS_PER_CALL` for the embedded engine without a
        ``decode_delay_s``, else 1)."""
        ro = self.rollout
        return groups_per_call(
            ro.groups_per_call, engine=ro.engine, decode_delay_s=ro.decode_delay_s
        )

    @property
    def block_order(self) -> str:
        """``async_rl.block_order`` resolved (:func:`block_order`)."""
        ro = self.rollout
        given = self.async_rl.block_order
        return block_order(given, engine=ro.engine, decode_delay_s=ro.decode_delay_s)

    @property
    def fixed_chunks(self) -> bool:
        """``async_rl.deterministic_chunks`` resolved (:func:`deterministic_chunks`: null
        is true with an ``in_order`` sampler without look-ahead where generation shares
        the trainers' cores or the blocks follow response length, else false)."""
        ro, sampler = self.rollout, self.async_rl.sampler
        return deterministic_chunks(
            self.async_rl.deterministic_chunks,
            engine=ro.engine,
            decode_delay_s=ro.decode_delay_s,
            sampler=sampler.name,
            lookahead=sampler.max_lookahead_versions,
            order=self.block_order,
        )

    @property
    def min_groups(self) -> int:
        return self.async_rl.min_groups_for_streaming_train

    @property
    def streaming(self) -> bool:
        """True when the readiness minimum is below the batch (streaming rules apply)."""
        return self.min_groups < self.batch_groups

    def model(self, role: Role) -> ModelConfig:
        """The section of ``role``: ``policy`` (also for ``actor``) or ``critic``."""
        return self.critic if role == "critic" else self.policy

    def model_parallel_sizes(self, role: Role) -> tuple[int, int]:
        """``(tensor, pipeline)`` parallel sizes of ``role``'s model: its
        ``megatron_cfg`` sizes with the Megatron backend, ``(1, 1)`` with plain torch."""
        mc = self.model(role).megatron_cfg
        if not mc.enabled:
            return 1, 1
        return mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size

    def dp_size(self, role: Role) -> int:
        """Data-parallel size of ``role``'s model: ``cluster.actor_gpus / (tp * pp)``
        (one rank per training GPU for both models; ranks of one tensor x pipeline group
        see the same rows, so rows and chunks split over this many ranks only).
        ``ValueError`` naming the key when ``tp * pp`` does not divide
        ``cluster.actor_gpus`` or a size is below 1 (``validate`` reports it)."""
        tp, pp = self.model_parallel_sizes(role)
        gpus = self.cluster.actor_gpus
        if gpus < 1:
            raise ValueError(f"cluster.actor_gpus={gpus} is invalid: use at least 1")
        prefix = f"{'critic' if role == 'critic' else 'policy'}.megatron_cfg"
        return data_parallel_size(
            world_size=gpus, tp=tp, pp=pp, prefix=prefix, world_key="cluster.actor_gpus"
        )

    @property
    def group_alignment(self) -> int:
        """Batch and minimum must be multiples of this: ``ppo_sampler.group_alignment``
        over both models' data-parallel sizes (:meth:`dp_size`) and micro-batch sizes,
        so every chunk splits evenly over each model's data-parallel ranks.
        ``ValueError`` if impossible (a bad mesh, a non-positive size)."""
        return int(
            group_alignment(
                generations_per_prompt=self.ppo.num_generations_per_prompt,
                actor_dp=self.dp_size("policy"),
                critic_dp=self.dp_size("critic"),
                actor_micro_batch=self.policy.train_micro_batch_size,
                critic_micro_batch=self.critic.train_micro_batch_size,
            )
        )

    @property
    def samples_per_step(self) -> int:
        return self.ppo.num_prompts_per_step * self.ppo.num_generations_per_prompt

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
