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
    table = _ParamTable([params] * rows if isinstance(params, SamplingParams) else list(params))
    uniforms = torch.zeros(rows, dtype=torch.float64)
    for i in torch.nonzero(table.sampled)[:, 0].tolist():
        uniforms[i] = torch.rand((), generator=generators[i], dtype=torch.float64)
    tokens, chosen = table.draw(logits, torch.arange(rows), uniforms)
    return [int(t) for t in tokens.tolist()], [float(x) for x in chosen.tolist()]


class _ParamTable:
    """The sampling parameters of a batch's rows as tensors (built once per batch)."""

    def __init__(self, params: Sequence[SamplingParams]) -> None:
        self.scale = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        self.sampled = torch.tensor([p.temperature > 0.0 for p in params], dtype=torch.bool)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
        self.max_new = torch.tensor([p.max_new_tokens for p in params])
        width = max((len(p.stop_token_ids) for p in params), default=0)
        self.stops = torch.full((len(params), max(width, 1)), -1, dtype=torch.long)
        for i, p in enumerate(params):
            self.stops[i, : len(p.stop_token_ids)] = torch.tensor(
                p.stop_token_ids, dtype=torch.long
            )

    def draw(
        self, logits: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their log-probs ``[R]`` for ``logits`` ``[R, V]`` of the table's
        ``rows`` ``[R]``, a sampled row drawing with its number of ``uniforms`` ``[R]``
        (float64 in [0, 1)); as :func:`draw_tokens` describes."""
        logp = torch.log_softmax(logits.float() / self.scale[rows][:, None], dim=-1)
        tokens = torch.argmax(logp, dim=-1)  # greedy rows keep these
        index = torch.nonzero(self.sampled[rows])[:, 0]
        if len(index):
            probs = logp[index].exp()
            top_p = self.top_p[rows[index]]
            if bool((top_p < 1.0).any()):
                probs = _top_p_filter(probs, top_p)
            cdf = torch.cumsum(probs.double(), dim=-1)
            threshold = (uniforms[index] * cdf[:, -1])[:, None]  # < the row's total
            drawn = torch.searchsorted(cdf, threshold, right=True)[:, 0]
            tokens[index] = drawn.clamp_max(logp.shape[1] - 1)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        return tokens, chosen


class _KVCache(Protocol):
    """The part of a Hugging Face KV cache (``past_key_values``) used here."""

    def batch_select_indices(self, indices: torch.Tensor) -> None: ...


#: Uniforms a sampled row draws from its generator at once (one per decode step).
_UNIFORM_BLOCK = 16


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

    Each step is a few tensor operations over the batch, whatever its rows: a sampled
    row's generator gives its uniforms ``_UNIFORM_BLOCK`` steps at a time (the same
    numbers, in the same order, as one per step: the generator is the row's alone).
    """
    rows = _check_rows(prompts, params=params, seeds=seeds)
    table = _ParamTable(params)
    gens = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]
    # slots[k]: the row decoded in batch position k, or -1 for a ballast row that keeps
    # the batch at >= _MIN_BATCH_ROWS (CPU GEMM kernels round differently below that)
    slots = list(range(rows)) + [-1] * max(0, _MIN_BATCH_ROWS - rows)
    ids = torch.tensor(
        [list(prompts[r if r >= 0 else 0]) for r in slots], dtype=torch.long, device=device
    )
    past, logits = _forward(model, ids, None)
    history = _History(rows, max(p.max_new_tokens for p in params))
    uniforms = torch.zeros(rows, _UNIFORM_BLOCK, dtype=torch.float64)
    finished: dict[int, SampleOutput] = {}  # row -> its sample, as rows finish
    step = 0
    while True:
        live = [k for k, r in enumerate(slots) if r >= 0]
        live_rows = torch.tensor([slots[k] for k in live])
        if step % _UNIFORM_BLOCK == 0:
            for r in live_rows[table.sampled[live_rows]].tolist():
                uniforms[r] = torch.rand(_UNIFORM_BLOCK, generator=gens[r], dtype=torch.float64)
        drawn, lps = table.draw(logits[live], live_rows, uniforms[live_rows, step % _UNIFORM_BLOCK])
        history.add(live_rows, step, drawn, lps)
        step += 1
        stopped = (drawn[:, None] == table.stops[live_rows]).any(dim=1)
        done = stopped | (table.max_new[live_rows] <= step)
        feed = torch.zeros(len(slots), dtype=torch.long)
        feed[live] = drawn
        for i in torch.nonzero(done)[:, 0].tolist():  # in batch order, as they finish
            r = slots[live[i]]
            finished[r] = history.sample(r, step, "stop" if bool(stopped[i]) else "length")
            slots[live[i]] = -1
            if on_finish is not None:
                on_finish(r, finished[r])
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
            feed = feed[keep]
        past, logits = _forward(model, feed[:, None].to(device), past)
    return [finished[r] for r in range(rows)]


class _History:
    """The tokens and log-probabilities every row drew so far, ``[rows, steps]``."""

    def __init__(self, rows: int, max_steps: int) -> None:
        self.max_steps = max_steps
        width = min(max_steps, 64)  # grows (doubling) up to max_steps
        self.tokens = torch.zeros(rows, width, dtype=torch.long)
        self.logprobs = torch.zeros(rows, width)

    def add(self, rows: torch.Tensor, step: int, tokens: torch.Tensor, lps: torch.Tensor) -> None:
        if step == self.tokens.shape[1]:
            width = min(2 * step, self.max_steps)
            self.tokens = torch.cat(
                [self.tokens, self.tokens.new_zeros(len(self.tokens), width - step)], 1
            )
            self.logprobs = torch.cat(
                [self.logprobs, self.logprobs.new_zeros(len(self.tokens), width - step)], 1
            )
        self.tokens[rows, step] = tokens
        self.logprobs[rows, step] = lps

    def sample(self, row: int, steps: int, reason: FinishReason) -> SampleOutput:
        return SampleOutput(
            token_ids=tuple(self.tokens[row, :steps].tolist()),
            logprobs=tuple(self.logprobs[row, :steps].tolist()),
            finish_reason=reason,
        )


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
