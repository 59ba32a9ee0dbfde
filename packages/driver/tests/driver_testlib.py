"""Shared by the tests that run the real driver: the overrides of a tiny, reproducible run,
and the comparison of two runs' checkpoints within bounds derived from what is compared."""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ppo_driver.batch import ChunkBatch
from ppo_trainer import ModelSpec
from ppo_trainer.testing import (
    EPS32,
    adam_step_bound,
    adam_update_cap,
    assert_within,
    clipped_grad_bound,
    model_terms,
    rounding_bound,
)
from safetensors.torch import load_file


def chunk_batch(pids: list[int], width: int) -> ChunkBatch:
    """A filled ``ChunkBatch`` of one sample per entry of ``pids`` (its prompt index),
    ``width`` tokens each: distinct token ids, rewards ``0, 1, ...``, zeros elsewhere."""
    b = len(pids)
    zeros = torch.zeros(b, width)
    return ChunkBatch(
        input_ids=torch.arange(b * width).reshape(b, width) + 3,
        attention_mask=torch.ones(b, width, dtype=torch.long),
        loss_mask=torch.ones(b, width),
        rewards=zeros,
        engine_logprobs=zeros,
        sample_rewards=torch.arange(float(b)),
        weight_versions=torch.zeros(b, dtype=torch.long),
        prompt_indices=torch.tensor(pids),
        old_values=zeros,
        advantages=zeros,
        returns=zeros,
    )


TINY_MODELS = [
    f"{role}.{key}={value}"
    for role in ("policy", "critic")
    for key, value in (
        ("hidden_size", 32),
        ("intermediate_size", 64),
        ("num_hidden_layers", 1),
        ("num_attention_heads", 2),
        ("num_key_value_heads", 1),
    )
]
"""Policy and critic of a few thousand parameters."""

MEMORY_MODELS = [
    f"{role}.{key}={value}"
    for role in ("policy", "critic")
    for key, value in (
        ("hidden_size", 512),
        ("intermediate_size", 1024),
        ("num_hidden_layers", 4),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
    )
]
"""Policy and critic of ~12 M parameters each: their weights show in a process's RSS."""


def rss_bytes(pid: int) -> int:
    """A process's resident memory (``/proc/<pid>/statm``), bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples the RSS of the registered processes (``pids``: name -> pid), one row per
    tick: ``(time.monotonic(), {name: bytes})``; a tick where a process just exited is
    skipped."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.pids: dict[str, int] = {}
        self.rows: list[tuple[float, dict[str, int]]] = []
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            pids = dict(self.pids)
            if pids:
                try:
                    row = {role: rss_bytes(pid) for role, pid in pids.items()}
                except OSError:  # a worker that just exited
                    row = {}
                if row:
                    self.rows.append((time.monotonic(), row))
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


TINY_RUN = [
    "run.checkpoint_every=1",
    "run.keep_checkpoints=5",
    "ppo.num_prompts_per_step=8",
    "ppo.num_generations_per_prompt=2",
    "ppo.critic_mini_batch_size=8",
    "ppo.ppo_epochs=1",
    # per-chunk whitening would make the result depend on where chunk boundaries fall
    # (arrival timing), which differs between any two runs; without it it does not
    "ppo.adv_estimator.normalize_advantages=false",
    "async_rl.min_groups_for_streaming_train=2",  # streaming: several chunks per step
    # chunks cut as groups arrive: every ready group goes, so steps stream in several
    # chunks (the default's fixed blocks would merge whatever blocks are ready into one)
    "async_rl.deterministic_chunks=false",
    "async_rl.sampler.max_lookahead_versions=0",
    *TINY_MODELS,
]


# -- comparing checkpoints: tolerances derived from what is compared --------------------
#
# The runs compared here train on the same samples; they differ in where the chunk
# boundaries fall (streaming vs full batch, or arrival timing after a resume), so the
# summed gradients differ by float32 rounding of another summation order, and a run's
# critic inputs (values computed per chunk) by the same. The bounds use the generic ones
# of ``ppo_trainer.testing`` (their derivations are there):
#
# * gradients: ``rounding_bound`` over ``model_terms`` of the model, with the run's
#   token count taken as ``samples * max_position_embeddings`` (an upper bound on the
#   positions, padding included) and the tensor's largest |gradient| as the magnitude.
#   The checkpoints keep only the summed gradient, not the chunks' absolute
#   contributions the classical bound wants; ``terms`` here is ~1e4 while the
#   differences measured are 1-7 eps x that scale, so chunk sums would have to cancel
#   by 1e3 for this to be too small. It is still 4x below a relative gradient change of
#   1e-2 (what a wrong denominator or a dropped chunk causes).
# * ONE Adam step (``steps == 1``): the gradient is recovered from the reference
#   checkpoint, ``g = exp_avg / (1 - beta1)`` (clipped; unclipped with the clip
#   coefficient of the reported grad norm); ``exp_avg = (1-b1) g`` and ``exp_avg_sq =
#   (1-b2) g^2`` differ by what g's bound implies, plus the rounding of those products;
#   the weights by ``adam_step_bound`` (per element: up to 2 lr where g is within
#   rounding of 0, a few ulps where |g| >> its bound).
# * SEVERAL Adam steps (the critic's mini-batches and epochs, later driver steps): each
#   step's gradient is held to the rounding bound at that step's scale, bounded per
#   element by the reference run's ``exp_avg_sq`` (``|g_s| <= sqrt(v_K / c_s)``, ``c_s =
#   (1-b2) b2^(K-s)``), which bounds both moments (formulas in ``_moment_bounds``).
#   That the weights' earlier differences move later gradients by no more than rounding
#   does is an assumption (bounding it needs the loss's curvature, which no checkpoint
#   holds); the measured differences use < 1e-2 of the bound. The weights are held to
#   what Adam can move them at all: ``lr * adam_update_cap(t)`` per step and run (the
#   scheduler's multiplier is at most 1), plus one ulp per step and run.

ADAM_PREFIX = "/backend/optimizer/state"


@dataclass
class RoleState:
    """One role's torch-backend checkpoint (a single rank): the worker config, the
    parameters and AdamW's moments under the parameters' names, the Adam step count."""

    config: dict[str, Any]
    params: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    steps: int


def load_role(ckpt: Path, role: str, *, rank: int | None = None) -> RoleState:
    """``ckpt/<role>/rank<rank>/state.{json,safetensors}`` (``None``: the only rank;
    the checkpoint must have one). Torch backend: the optimizer's state index ``i`` is
    the ``i``-th parameter (``model.parameters()`` order, which is the order of the saved
    model's keys; shapes are checked). Megatron (float32, no distributed optimizer:
    ``_megatron_role``)."""
    if rank is None:
        ranks = sorted((ckpt / role).glob("rank*"))
        assert [r.name for r in ranks] == ["rank00000"], ranks
    where = ckpt / role / f"rank{rank or 0:05d}"
    meta = json.loads((where / "state.json").read_text())
    tensors = load_file(str(where / "state.safetensors"))
    if meta["config"]["backend"] == "megatron":
        return _megatron_role(meta, tensors)
    assert meta["config"]["backend"] == "torch", meta["config"]["backend"]
    names = list(meta["backend"]["model"])
    state = RoleState(meta["config"], {}, {}, {}, steps=-1)
    steps = set()
    for i, name in enumerate(names):
        state.params[name] = tensors[f"/backend/model/{name}"]
        state.exp_avg[name] = tensors[f"{ADAM_PREFIX}/{i}/exp_avg"]
        state.exp_avg_sq[name] = tensors[f"{ADAM_PREFIX}/{i}/exp_avg_sq"]
        assert state.exp_avg[name].shape == state.params[name].shape, name
        steps.add(int(tensors[f"{ADAM_PREFIX}/{i}/step"]))
    assert len(steps) == 1 and len(tensors) == 4 * len(names), (steps, len(tensors))
    state.steps = steps.pop()
    return state


def _megatron_role(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RoleState:
    """A Megatron-backend checkpoint as a ``RoleState``: its optimizer saves each
    parameter's Adam state by index with the main (float32) copy of that parameter;
    without mixed precision or the distributed optimizer the main copy IS the parameter,
    so each index is matched to the one model tensor equal to it."""
    names = list(meta["backend"]["model"])
    (group,) = meta["backend"]["optimizer"]  # one chained optimizer: no expert parameters
    state = RoleState(meta["config"], {}, {}, {}, steps=-1)
    for name in names:
        state.params[name] = tensors[f"/backend/model/{name}"]
    steps = set()
    prefix = "/backend/optimizer/0"
    for i in range(int(group["num_params"])):
        main = tensors[f"{prefix}/main_params/{i}"]
        (name,) = [
            n for n, p in state.params.items() if p.shape == main.shape and torch.equal(p, main)
        ]
        state.exp_avg[name] = tensors[f"{prefix}/state/{i}/exp_avg"]
        state.exp_avg_sq[name] = tensors[f"{prefix}/state/{i}/exp_avg_sq"]
        steps.add(int(tensors[f"{prefix}/state/{i}/step"]))
    assert state.exp_avg.keys() == state.params.keys() and len(steps) == 1, steps
    state.steps = steps.pop()
    return state


def _grad_terms(ref: RoleState, samples: int) -> int:
    spec = ModelSpec(**ref.config["model"])
    seq_len = spec.max_position_embeddings
    return model_terms(spec, tokens=samples * seq_len, seq_len=seq_len)


def _one_step_bounds(
    ref: RoleState, *, samples: int, grad_norm: float
) -> dict[str, dict[str, torch.Tensor]]:
    cfg = ref.config
    b1, b2 = cfg["betas"]
    terms = _grad_terms(ref, samples)
    max_norm = cfg["max_grad_norm"]
    clip = 1.0 if max_norm is None else min(1.0, max_norm / (grad_norm + 1e-6))
    grads = {k: m.double() / (1 - b1) / clip for k, m in ref.exp_avg.items()}  # unclipped
    grad_bound = {
        k: torch.full_like(g, rounding_bound(terms=terms, magnitude=float(g.abs().max())))
        for k, g in grads.items()
    }
    clip, seen = clipped_grad_bound(
        grads=grads, grad_bound=grad_bound, grad_norm=grad_norm, max_grad_norm=max_norm
    )
    exp_avg, exp_avg_sq = {}, {}
    for k, g in grads.items():
        d, x = seen[k], (clip * g).abs()
        exp_avg[k] = (1 - b1) * d + 2 * EPS32 * ref.exp_avg[k].double().abs()
        sq = ref.exp_avg_sq[k].double()
        exp_avg_sq[k] = (1 - b2) * (2 * x * d + d * d) + 8 * EPS32 * sq
    params = adam_step_bound(
        grads=grads,
        grad_bound=grad_bound,
        params=ref.params,
        lr=cfg["lr"],
        adam_eps=cfg["adam_eps"],
        grad_norm=grad_norm,
        max_grad_norm=max_norm,
    )
    return {"params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _moment_bounds(ref: RoleState, *, samples: int) -> dict[str, dict[str, torch.Tensor]]:
    """K = ``ref.steps`` Adam steps. ``a_s = (1-b1) b1^(K-s)``; with ``r = 2 terms eps``
    and ``V`` the tensor's largest ``exp_avg_sq``: ``|d exp_avg| <= sum_s a_s r |g_s|``
    ``<= r sqrt(V) sum_s a_s / sqrt(c_s)``; ``|d exp_avg_sq| <= sum_s c_s (2 |g_s| d_s +
    d_s^2) <= K V (2 r + r^2)``; plus the EMAs' own rounding (a few ulps of their scale
    per step, ``b2^-K`` for an exp_avg_sq that was larger before it decayed)."""
    cfg, k_steps = ref.config, ref.steps
    b1, b2 = cfg["betas"]
    r = rounding_bound(terms=_grad_terms(ref, samples), magnitude=1.0)
    weights = sum((1 - b1) * b1**j / math.sqrt((1 - b2) * b2**j) for j in range(k_steps))
    exp_avg, exp_avg_sq = {}, {}
    for k, v in ref.exp_avg_sq.items():
        vmax = float(v.double().max())
        m_scale = math.sqrt(vmax) * weights
        exp_avg[k] = torch.full_like(v, (r + 4 * k_steps * EPS32) * m_scale, dtype=torch.float64)
        v_bound = k_steps * vmax * (2 * r + r * r) + 8 * k_steps * EPS32 * vmax / b2**k_steps
        exp_avg_sq[k] = torch.full_like(v, v_bound, dtype=torch.float64)
    cap = sum(adam_update_cap(t, (b1, b2)) for t in range(1, k_steps + 1))
    params = {
        k: 2 * cfg["lr"] * (cap + 8 * k_steps * EPS32) + 2 * k_steps * EPS32 * p.double().abs()
        for k, p in ref.params.items()
    }
    return {"params": params, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def assert_same_role(
    got: RoleState, ref: RoleState, *, samples: int, grad_norm: float | None = None
) -> dict[str, float]:
    """``got`` equals the reference ``ref`` within the derived bounds (module comment):
    the one-step bounds where both took exactly one Adam step (``grad_norm``: the
    reference step's reported norm, before clipping), else the several-step ones.
    Returns the largest ``|diff| / bound`` per kind (the margin used; < 1 passes)."""
    assert got.steps == ref.steps and got.params.keys() == ref.params.keys()
    if ref.steps == 1:
        assert grad_norm is not None, "one Adam step: pass the reference grad norm"
        bounds = _one_step_bounds(ref, samples=samples, grad_norm=grad_norm)
    else:
        bounds = _moment_bounds(ref, samples=samples)
    used = {}
    for kind, bound in bounds.items():
        a, b = getattr(got, kind), getattr(ref, kind)
        assert_within(a, b, bound)
        used[kind] = max(
            float(((a[k].double() - b[k].double()).abs() / bound[k]).max()) for k in bound
        )
    return used


def assert_same_checkpoint(ref_run: Path, got_run: Path, step: int, *, samples: int) -> None:
    """Actor and critic of ``got_run``'s checkpoint after ``step`` steps equal those of the
    reference ``ref_run`` (parameters and Adam moments within the derived bounds, Adam
    step counts exactly); prints how much of each bound the differences use.
    ``samples``: samples per step."""
    ckpt = Path("checkpoints") / f"step_{step:06d}"
    rows = [json.loads(x) for x in (ref_run / "metrics.jsonl").read_text().splitlines()]
    norm = next(r for r in rows if r["step"] == step - 1).get("actor/grad_norm")
    for role in ("actor", "critic"):
        ref, got = load_role(ref_run / ckpt, role), load_role(got_run / ckpt, role)
        used = assert_same_role(got, ref, samples=samples, grad_norm=norm)
        shown = ", ".join(f"{k} {v:.3g}" for k, v in used.items())
        print(f"{ckpt.name} {role} ({ref.steps} Adam steps): |diff| / bound: {shown}")


def assert_identical_checkpoint(ref_run: Path, got_run: Path, step: int) -> None:
    """Actor and critic of the two runs' checkpoints after ``step`` steps are the same
    bits, on every rank: parameters, both Adam moments and the step counts."""
    ckpt = Path("checkpoints") / f"step_{step:06d}"
    for role in ("actor", "critic"):
        ranks = sorted(r.name for r in (ref_run / ckpt / role).glob("rank*"))
        assert ranks == sorted(r.name for r in (got_run / ckpt / role).glob("rank*")), ranks
        for rank in range(len(ranks)):
            ref = load_role(ref_run / ckpt, role, rank=rank)
            got = load_role(got_run / ckpt, role, rank=rank)
            assert got.steps == ref.steps, (role, rank, got.steps, ref.steps)
            for kind in ("params", "exp_avg", "exp_avg_sq"):
                a, b = getattr(got, kind), getattr(ref, kind)
                assert a.keys() == b.keys(), (role, kind)
                differ = [k for k in a if not torch.equal(a[k], b[k])]
                assert not differ, (
                    f"{role} rank {rank} {kind} differ in {differ[:3]} ({len(differ)} tensors)"
                )


@contextmanager
def gloo_refit_pair() -> Iterator[Any]:
    """A two-rank weight-refit group over gloo on loopback, both ranks in this process
    (rank 1 joins on a thread). Yields ``send(tensors, version) -> (version, received,
    stats)``; the groups and the store stay open until the block ends (their port is
    ``send.port``)."""
    from ppo_driver.rollout import (
        broadcast_state_dict,
        connect_group,
        open_store,
        receive_state_dict,
    )

    store, port = open_store(host="127.0.0.1", world_size=2, timeout_s=60)
    join = functools.partial(
        connect_group, master_addr="127.0.0.1", world_size=2, backend="gloo", timeout_s=60
    )
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(join, store=None, master_port=port, rank=1)
        sender = join(store=store, master_port=0, rank=0)
        receiver = joining.result(timeout=120)

        def send(tensors: Mapping[str, torch.Tensor], version: int) -> tuple[int, Any, Any]:
            received = pool.submit(receive_state_dict, group=receiver)
            stats = broadcast_state_dict(dict(tensors), group=sender, version=version)
            got_version, got = received.result(timeout=120)
            return got_version, got, stats

        send.port = port  # type: ignore[attr-defined]
        yield send
