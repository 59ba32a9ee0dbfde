"""The embedded engine's sampling loop: batched KV-cache decoding of one prompt group,
with one ``torch.Generator`` per sample so every sample's tokens depend only on
(run seed, prompt index, sample index, weight version) and the weights."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ._types import FinishReason, SampleOutput, SamplingParams

_SEED_MASK = (1 << 63) - 1
_MIN_BATCH_ROWS = 4


def sample_seed(*, run_seed: int, prompt_index: int, sample_index: int, weight_version: int) -> int:
    """A 63-bit seed for one sample's random stream (stable across processes and runs)."""
    key = f"{run_seed}/{prompt_index}/{sample_index}/{weight_version}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def _top_p_filter(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """probs: [V] or [R, V] -> the same shape: per row, the smallest prefix (by
    probability) whose mass reaches ``top_p`` (a float, or one per row ``[R]``) kept
    and renormalised; the most likely token is always kept."""
    if isinstance(top_p, float):
        if top_p >= 1.0:
            return probs
        top_p = torch.tensor(top_p)
    row = probs.dim() == 1
    p = probs[None] if row else probs
    limit = top_p.reshape(-1, 1).to(p.dtype)
    sorted_probs, order = torch.sort(p, dim=-1, descending=True)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    drop = (cumulative - sorted_probs) >= limit
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(p).scatter(-1, order, sorted_probs)
    out = filtered / filtered.sum(dim=-1, keepdim=True)
    return out[0] if row else out


def draw_tokens(
    logits: torch.Tensor,
    *,
    params: SamplingParams | Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> tuple[list[int], list[float]]:
    """One decoding step: row ``i`` of ``logits`` ([R, V]) draws with ``generators[i]``
    (and ``params[i]`` when a sequence is given).

    Returns (token ids [R], log-probs [R]); the log-prob is taken under
    ``log_softmax(logits / temperature)`` (``temperature == 0``: greedy, the log-prob
    under ``log_softmax(logits)``), before top-p filtering.

    Every row is computed on its own values only (row-wise softmax, cumulative sum and
    search), so a row's token does not depend on the other rows of the batch; the one
    random number a sampled row takes per step comes from its own generator (inverse
    transform sampling: the first token whose cumulative probability exceeds it).
    """
    if logits.dim() != 2 or logits.shape[0] != len(generators):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match {len(generators)} generators"
        )
    rows = len(generators)
    per_row = [params] * rows if isinstance(params, SamplingParams) else list(params)
    scale = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in per_row])
    logp = torch.log_softmax(logits.float() / scale[:, None], dim=-1)
    tokens = torch.argmax(logp, dim=-1)  # greedy rows keep these
    sampled = [i for i, p in enumerate(per_row) if p.temperature > 0.0]
    if sampled:
        index = torch.tensor(sampled)
        probs = logp[index].exp()
        top_p = [per_row[i].top_p for i in sampled]
        if min(top_p) < 1.0:
            probs = _top_p_filter(probs, torch.tensor(top_p))
        cdf = torch.cumsum(probs.double(), dim=-1)
        u = torch.stack(
            [torch.rand((), generator=generators[i], dtype=torch.float64) for i in sampled]
        )
        threshold = (u * cdf[:, -1])[:, None]  # < the row's total: a token always exists
        drawn = torch.searchsorted(cdf, threshold, right=True)[:, 0]
        tokens[index] = drawn.clamp_max(logp.shape[1] - 1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return [int(t) for t in tokens.tolist()], [float(x) for x in chosen.tolist()]


class _KVCache(Protocol):
    """The part of a Hugging Face KV cache (``past_key_values``) used here."""

    def batch_select_indices(self, indices: torch.Tensor) -> None: ...


@torch.inference_mode()
def generate_rows(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    device: torch.device | str = "cpu",
    between_steps: Callable[[], None] | None = None,
    on_finish: Callable[[int, SampleOutput], None] | None = None,
) -> list[SampleOutput]:
    """Sample one continuation per row with a Hugging Face causal LM and its KV cache.

    prompts: R token sequences of EQUAL length (no padding is ever used); row ``i``
    samples with ``params[i]`` and a generator seeded with ``seeds[i]``. Rows leave the
    batch as they finish (``batch_select_indices`` on the cache), but the batch never
    shrinks below 4 rows: torch's CPU GEMM rounds differently for fewer rows, and with
    that floor each row's arithmetic is bitwise independent of the other rows (tested),
    so a sample depends only on its prompt, its seed and the weights, not on which rows
    shared its batch. ``on_finish(row, sample)`` is called as each row finishes (while
    the others go on decoding).
    """
    rows = _check_rows(prompts, params=params, seeds=seeds)
    gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    # slots[k]: the row decoded in batch position k, or -1 for a ballast row that keeps
    # the batch at >= _MIN_BATCH_ROWS (CPU GEMM kernels round differently below that)
    slots = list(range(rows)) + [-1] * max(0, _MIN_BATCH_ROWS - rows)
    ids = torch.tensor(
        [list(prompts[r if r >= 0 else 0]) for r in slots], dtype=torch.long, device=device
    )
    past, logits = _forward(model, ids, None)
    decoded = _Decoded(params, rows)
    while True:
        live = [k for k, r in enumerate(slots) if r >= 0]
        drawn, lps = draw_tokens(
            logits[live],
            params=[params[slots[k]] for k in live],
            generators=[gens[slots[k]] for k in live],
        )
        feed = [0] * len(slots)
        for k, tok, lp in zip(live, drawn, lps, strict=True):
            feed[k] = tok
            if decoded.add(slots[k], tok, lp, on_finish=on_finish):
                slots[k] = -1
        keep = [k for k, r in enumerate(slots) if r >= 0]
        if not keep:
            break
        if between_steps is not None:
            between_steps()
        ballast = [k for k, r in enumerate(slots) if r < 0][: max(0, _MIN_BATCH_ROWS - len(keep))]
        keep = sorted(keep + ballast)
        if len(keep) < len(slots):
            past.batch_select_indices(torch.tensor(keep, dtype=torch.long, device=device))
            slots = [slots[k] for k in keep]
            feed = [feed[k] for k in keep]
        step_ids = torch.tensor([[t] for t in feed], dtype=torch.long, device=device)
        past, logits = _forward(model, step_ids, past)
    return [decoded.sample(r) for r in range(rows)]


def _check_rows(
    prompts: Sequence[Sequence[int]], *, params: Sequence[SamplingParams], seeds: Sequence[int]
) -> int:
    """The number of rows; ``ValueError`` unless every row has params, a seed, and a
    prompt as long as the others."""
    rows = len(prompts)
    if not (len(params) == len(seeds) == rows) or rows == 0:
        raise ValueError(f"generate_rows: {rows} prompts, {len(params)} params, {len(seeds)} seeds")
    length = len(prompts[0])
    if any(len(p) != length for p in prompts):
        raise ValueError("generate_rows: prompts must have equal lengths (no padding)")
    return rows


def _forward(
    model: torch.nn.Module, input_ids: torch.Tensor, past: _KVCache | None
) -> tuple[_KVCache, torch.Tensor]:
    """One forward pass with the KV cache (none: the prompts); returns the cache and the
    last position's logits on the CPU, ``[B, V]``."""
    if past is None:
        out = model(input_ids=input_ids, use_cache=True)
    else:
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
    return out.past_key_values, out.logits[:, -1, :].to("cpu")


class _Decoded:
    """The tokens, log-probabilities and finish reason of each row so far."""

    def __init__(self, params: Sequence[SamplingParams], rows: int) -> None:
        self.params = params
        self.stops = [set(p.stop_token_ids) for p in params]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.logprobs: list[list[float]] = [[] for _ in range(rows)]
        self.reasons: list[FinishReason | None] = [None] * rows

    def add(
        self,
        r: int,
        tok: int,
        lp: float,
        *,
        on_finish: Callable[[int, SampleOutput], None] | None,
    ) -> bool:
        """Append row ``r``'s next token; True when that finished the row (a stop token,
        or ``max_new_tokens``), after ``on_finish(r, sample)``."""
        self.tokens[r].append(tok)
        self.logprobs[r].append(lp)
        if tok in self.stops[r]:
            self.reasons[r] = "stop"
        elif len(self.tokens[r]) >= self.params[r].max_new_tokens:
            self.reasons[r] = "length"
        if self.reasons[r] is None:
            return False
        if on_finish is not None:
            on_finish(r, self.sample(r))
        return True

    def sample(self, r: int) -> SampleOutput:
        return _sample(self.tokens[r], self.logprobs[r], self.reasons[r])


def _sample(tokens: list[int], logprobs: list[float], reason: FinishReason | None) -> SampleOutput:
    return SampleOutput(
        token_ids=tuple(tokens), logprobs=tuple(logprobs), finish_reason=reason or "length"
    )


def generate_group(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    params: SamplingParams,
    seeds: Sequence[int],
    device: torch.device | str = "cpu",
) -> list[SampleOutput]:
    """``params.n`` samples of one prompt (:func:`generate_rows` on ``n`` copies)."""
    if len(seeds) != params.n:
        raise ValueError(f"got {len(seeds)} seeds for n={params.n} samples")
    return generate_rows(
        model, [prompt_ids] * params.n, params=[params] * params.n, seeds=seeds, device=device
    )
