"""Replay buffer of scored prompt groups, and the [B, T] batch builder.

Life of a row: ``add`` (ready) -> ``claim`` (trained on in this step) -> ``release``
(gone, only after both the policy and the critic update of the step). Checkpoints are a
JSON file plus a safetensors file (never pickle); claimed rows are saved as claimed and
a restore puts them back to ready, because a checkpoint is never taken inside an update.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

import torch
from safetensors.torch import load_file, save_file

from ._task import ScoredGroup
from ._types import FinishReason, GroupOutput, SampleOutput

RowState = Literal["ready", "claimed"]
_FORMAT = 1


class SampleMeta(TypedDict):
    """One sample of a buffered group in ``replay.json`` (its tokens are tensors)."""

    length: int
    finish_reason: str


class RowMeta(TypedDict):
    """One buffered group in ``replay.json``."""

    group_id: int
    step: int
    state: str
    prompt_length: int
    weight_version: int
    engine_id: str
    samples: list[SampleMeta]


class BufferMeta(TypedDict):
    """``replay.json``: the JSON half of :meth:`ReplayBuffer.state_dict`."""

    format: int
    rows: list[RowMeta]


@dataclass(slots=True)
class _Row:
    group: ScoredGroup
    step: int
    state: RowState


class ReplayBuffer:
    """Scored groups keyed by group id (the prompt index), in insertion order."""

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._rows

    def add(self, group: ScoredGroup, *, step: int) -> None:
        gid = group.prompt_index
        if gid in self._rows:
            raise ValueError(f"ReplayBuffer.add: group {gid} is already buffered; ids are unique")
        self._rows[gid] = _Row(group=group, step=step, state="ready")

    def ready_ids(self) -> list[int]:
        return [g for g, r in self._rows.items() if r.state == "ready"]

    def claimed_ids(self) -> list[int]:
        return [g for g, r in self._rows.items() if r.state == "claimed"]

    def get(self, group_id: int) -> ScoredGroup:
        return self._row(group_id, "ReplayBuffer.get").group

    def step_of(self, group_id: int) -> int:
        return self._row(group_id, "ReplayBuffer.step_of").step

    def _row(self, group_id: int, fn: str) -> _Row:
        row = self._rows.get(group_id)
        if row is None:
            raise ValueError(f"{fn}: group {group_id} is not in the replay buffer")
        return row

    def _check(self, fn: str, ids: Iterable[int], state: RowState) -> list[int]:
        out = list(ids)
        if len(set(out)) != len(out):
            raise ValueError(f"{fn}: a group id is listed twice in {out}; nothing was changed")
        for gid in out:
            if self._row(gid, fn).state != state:
                raise ValueError(f"{fn}: group {gid} is not {state}; nothing was changed")
        return out

    def claim(self, group_ids: Iterable[int]) -> list[ScoredGroup]:
        """Mark ready rows as claimed and return them in the given order."""
        ids = self._check("ReplayBuffer.claim", group_ids, "ready")
        for gid in ids:
            self._rows[gid].state = "claimed"
        return [self._rows[g].group for g in ids]

    def unclaim(self, group_ids: Iterable[int]) -> None:
        """Return claimed rows to ready (a failed chunk)."""
        for gid in self._check("ReplayBuffer.unclaim", group_ids, "claimed"):
            self._rows[gid].state = "ready"

    def drop(self, group_ids: Iterable[int]) -> None:
        """Drop ready rows (e.g. groups a ``ready_first`` sampler evicted as stale)."""
        for gid in self._check("ReplayBuffer.drop", group_ids, "ready"):
            del self._rows[gid]

    def release(self, group_ids: Iterable[int]) -> None:
        """Drop claimed rows: call only after both updates of the step finished."""
        for gid in self._check("ReplayBuffer.release", group_ids, "claimed"):
            del self._rows[gid]

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> tuple[BufferMeta, dict[str, torch.Tensor]]:
        """(JSON-serialisable metadata, flat tensors) describing every row."""
        meta_rows: list[RowMeta] = []
        prompt: list[int] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        rewards: list[float] = []
        for gid, row in self._rows.items():
            out = row.group.output
            prompt.extend(out.prompt_ids)
            samples: list[SampleMeta] = []
            for s, r in zip(out.samples, row.group.rewards, strict=True):
                tokens.extend(s.token_ids)
                logprobs.extend(s.logprobs)
                rewards.append(r)
                samples.append({"length": len(s.token_ids), "finish_reason": s.finish_reason})
            meta_rows.append(
                {
                    "group_id": gid,
                    "step": row.step,
                    "state": row.state,
                    "prompt_length": len(out.prompt_ids),
                    "weight_version": out.weight_version,
                    "engine_id": out.engine_id,
                    "samples": samples,
                }
            )
        tensors = {
            "prompt_ids": torch.tensor(prompt, dtype=torch.int64),
            "token_ids": torch.tensor(tokens, dtype=torch.int64),
            "logprobs": torch.tensor(logprobs, dtype=torch.float64),
            "rewards": torch.tensor(rewards, dtype=torch.float64),
        }
        return {"format": _FORMAT, "rows": meta_rows}, tensors

    def load_state_dict(self, meta: BufferMeta, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the contents with a ``state_dict()`` snapshot; claimed rows become
        ready again (their update never completed from the snapshot's point of view)."""
        if meta.get("format") != _FORMAT:
            raise ValueError(f"ReplayBuffer.load_state_dict: unknown format {meta.get('format')!r}")
        prompt = tensors["prompt_ids"].tolist()
        tokens = tensors["token_ids"].tolist()
        logprobs = tensors["logprobs"].tolist()
        rewards = tensors["rewards"].tolist()
        p = t = r = 0
        rows: dict[int, _Row] = {}
        for m in meta["rows"]:
            plen = int(m["prompt_length"])
            prompt_ids = tuple(int(x) for x in prompt[p : p + plen])
            p += plen
            samples: list[SampleOutput] = []
            group_rewards: list[float] = []
            for s in m["samples"]:
                n = int(s["length"])
                reason: FinishReason = "stop" if s["finish_reason"] == "stop" else "length"
                samples.append(
                    SampleOutput(
                        token_ids=tuple(int(x) for x in tokens[t : t + n]),
                        logprobs=tuple(float(x) for x in logprobs[t : t + n]),
                        finish_reason=reason,
                    )
                )
                t += n
                group_rewards.append(float(rewards[r]))
                r += 1
            gid = int(m["group_id"])
            if gid in rows:
                raise ValueError(f"ReplayBuffer.load_state_dict: group {gid} appears twice")
            out = GroupOutput(
                prompt_index=gid,
                prompt_ids=prompt_ids,
                samples=tuple(samples),
                weight_version=int(m["weight_version"]),
                engine_id=str(m["engine_id"]),
            )
            rows[gid] = _Row(
                group=ScoredGroup(output=out, rewards=tuple(group_rewards)),
                step=int(m["step"]),
                state="ready",
            )
        if (p, t, r) != (len(prompt), len(tokens), len(rewards)):
            raise ValueError("ReplayBuffer.load_state_dict: tensor sizes do not match the metadata")
        self._rows = rows

    def save(self, path: str | Path) -> None:
        """Write ``replay.json`` and ``replay.safetensors`` into directory ``path``
        (each file written aside, then renamed)."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        meta, tensors = self.state_dict()
        tmp_t = d / "replay.safetensors.tmp"
        save_file(tensors, str(tmp_t))
        os.replace(tmp_t, d / "replay.safetensors")
        tmp_j = d / "replay.json.tmp"
        tmp_j.write_text(json.dumps(meta))
        os.replace(tmp_j, d / "replay.json")

    @classmethod
    def load(cls, path: str | Path) -> ReplayBuffer:
        d = Path(path)
        buf = cls()
        buf.load_state_dict(
            json.loads((d / "replay.json").read_text()), load_file(str(d / "replay.safetensors"))
        )
        return buf


def build_batch(groups: Sequence[ScoredGroup], *, pad_id: int) -> dict[str, torch.Tensor]:
    """The training batch for ``groups`` in the layout of docs/interfaces.md.

    Rows are group by group, sample by sample (B = sum of group sizes);
    T = the longest prompt + response. [B, T] keys: ``input_ids`` (long, right padded
    with ``pad_id``), ``attention_mask`` (long), ``loss_mask`` (float, 1 at response
    tokens), ``rewards`` (float, the sample's reward at its last response token),
    ``engine_logprobs`` (float, the engine's log-prob of each response token at its own
    position, shifted convention; 0 elsewhere). [B] keys: ``sample_rewards`` (float),
    ``weight_versions`` (long), ``prompt_indices`` (long).
    """
    if not groups:
        raise ValueError("build_batch: no groups given")
    rows: list[tuple[tuple[int, ...], SampleOutput, float, int, int]] = []
    for g in groups:
        out = g.output
        for s, r in zip(out.samples, g.rewards, strict=True):
            rows.append((out.prompt_ids, s, r, out.weight_version, out.prompt_index))
    bsz = len(rows)
    seq = max(len(p) + len(s.token_ids) for p, s, *_ in rows)
    # one tensor per field from Python lists (a few tensor ops per field, not per row)
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    bounds: list[tuple[int, int]] = []  # (prompt end, response end) per row
    for prompt, sample, _, _, pidx in rows:
        plen, rlen = len(prompt), len(sample.token_ids)
        if rlen == 0:
            raise ValueError(f"build_batch: prompt {pidx} has an empty response")
        tail = seq - plen - rlen
        ids.append([*prompt, *sample.token_ids, *([pad_id] * tail)])
        logprobs.append([*([0.0] * plen), *sample.logprobs, *([0.0] * tail)])
        bounds.append((plen, plen + rlen))
    _, _, reward_list, version_list, index_list = zip(*rows, strict=True)
    sample_rewards = torch.tensor(reward_list, dtype=torch.float32)
    versions = torch.tensor(version_list, dtype=torch.long)
    prompts = torch.tensor(index_list, dtype=torch.long)
    input_ids = torch.tensor(ids, dtype=torch.long)
    engine_lp = torch.tensor(logprobs, dtype=torch.float32)
    start, end = torch.tensor(bounds, dtype=torch.long).unbind(dim=1)
    start, end = start[:, None], end[:, None]
    pos = torch.arange(seq)[None, :]
    attention = (pos < end).long()
    loss_mask = ((pos >= start) & (pos < end)).to(torch.float32)
    rewards = torch.zeros((bsz, seq), dtype=torch.float32)
    rewards[torch.arange(bsz), end[:, 0] - 1] = sample_rewards
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rewards": rewards,
        "engine_logprobs": engine_lp,
        "sample_rewards": sample_rewards,
        "weight_versions": versions,
        "prompt_indices": prompts,
    }
