"""Prompts (JSONL or the built-in synthetic task) and pluggable rewards (a module's
function or a Python file's).

The built-in task, *repeat*: the prompt ``"c7:"`` asks for the letter ``c`` written
exactly 7 times and then the end-of-sequence token. Counts vary per prompt (1 to
``max_count``) and sampling varies lengths within a group, so response lengths have a
real long tail. The reward is rule-based with partial credit, so a random policy earns a
small but non-zero reward and every sample carries signal:

    0.5 * (fraction of the first N characters that are c)
  + 0.3 * (1 - |L - N| / N, floored at 0; only when the sample stopped by itself)
  + 0.2 * (exactly c * N and stopped)
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import queue
import random
import re
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ppo_driver._json import JSONObject, JSONValue

from ._tokenizer import Tokenizer, encode_prompt
from ._types import GroupOutput, SampleOutput

RewardFn = Callable[..., float | Awaitable[float]]
"""``reward_fn(*, response: str, record: Mapping[str, JSONValue], finish_reason: str)``, sync
or async, returning a real number: an int or a float (not a bool), finite; any
``numbers.Real`` (``numpy.float32``, ``numpy.int64``, ``fractions.Fraction``) counts and is
converted with ``float()``. Each call gets its own deep copy of the record: an edit stays
in that call."""

TASK_LETTERS = "abcdefgh"
TASK_ALPHABET = TASK_LETTERS + "0123456789:"
"""Every character of the built-in task's prompts and answers (its character tokenizer's
alphabet)."""


def repeat_reward(*, response: str, record: Mapping[str, JSONValue], finish_reason: str) -> float:
    """The built-in task's reward in [0, 1] (see the module docstring)."""
    char = str(record["char"])
    raw_count = record["count"]
    if not isinstance(raw_count, int | float | str):  # what int() takes of a JSON value
        raise TypeError(f"record['count'] must be a number, not {type(raw_count).__name__}")
    count = int(raw_count)
    length = len(response)
    match = sum(1 for ch in response[:count] if ch == char) / count
    stopped = finish_reason == "stop"
    length_score = max(0.0, 1.0 - abs(length - count) / count) if stopped else 0.0
    exact = 1.0 if stopped and response == char * count else 0.0
    return 0.5 * match + 0.3 * length_score + 0.2 * exact


MAX_COUNT = 99
"""The largest ``max_count`` of :func:`synthetic_records` (``rollout.extra.max_count``)."""


def synthetic_records(*, num_prompts: int, seed: int, max_count: int = 12) -> list[JSONObject]:
    """``num_prompts`` records ``{"prompt", "char", "count"}`` of the repeat task, counts
    uniform in [1, max_count], reproducible from ``seed``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts}: use at least 1")
    if not 1 <= max_count <= MAX_COUNT:
        raise ValueError(f"max_count={max_count}: use a value in [1, {MAX_COUNT}]")
    rng = random.Random(seed)
    out: list[JSONObject] = []
    for _ in range(num_prompts):
        char = rng.choice(TASK_LETTERS)
        count = rng.randint(1, max_count)
        out.append({"prompt": f"{char}{count}:", "char": char, "count": count})
    return out


class DataError(ValueError):
    """A prompt data set that cannot be used: ``problem`` names the file and each bad
    line (up to :data:`MAX_REPORTED_LINES`), ``fix`` says what to do."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem, self.fix = problem, fix
        super().__init__(f"{problem}; {fix}")


MAX_REPORTED_LINES = 5
"""The most bad lines one :class:`DataError` lists (then how many more there are)."""


def _prompt_problem(value: object, prompt_key: str, *, messages: bool) -> str | None:
    """What is wrong with a record's prompt value (None: nothing)."""
    if isinstance(value, str):
        return None if value else f"{prompt_key!r} is an empty string"
    if not messages:
        return f"{prompt_key!r} must be a string, not {type(value).__name__}"
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if ok:
        return None
    return (
        f"{prompt_key!r} must be a string or a non-empty list of "
        '{"role": str, "content": str} messages'
    )


def read_jsonl(
    path: str | Path, *, prompt_key: str = "prompt", messages: bool = False
) -> tuple[list[JSONObject], list[int]]:
    """The records of a JSONL file and the line number of each.

    One JSON object per line, each with ``prompt_key``: a non-empty string, or (with
    ``messages``, i.e. the chat template applies) also a list of ``{"role", "content"}``
    messages; any other fields are kept for the reward. Blank lines are skipped.
    Raises :class:`DataError` naming the file: missing, not a file, unreadable, not
    UTF-8, no records, or each bad line (not JSON, not an object, no usable prompt).
    """
    src = Path(path)
    fix = (
        f"write one JSON object per line, each with a {prompt_key!r} field (e.g. "
        f'{{"{prompt_key}": "What is 2 + 3?", "answer": 5}}); blank lines are skipped'
    )
    if not src.exists():
        raise DataError(f"{src} does not exist", "check the path")
    if not src.is_file():
        raise DataError(f"{src} is not a file", "point at the JSONL file itself")
    try:
        raw = src.read_bytes()
    except OSError as exc:
        raise DataError(
            f"{src} cannot be read ({exc.strerror or exc})", "fix its permissions"
        ) from None
    records: list[JSONObject] = []
    lines: list[int] = []
    bad: list[str] = []
    for lineno, line_bytes in enumerate(raw.splitlines(), start=1):
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(f"{src}:{lineno}: not UTF-8 (byte offset {exc.start} in the line)")
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            bad.append(f"{src}:{lineno}: not valid JSON ({exc.msg}, column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            bad.append(f"{src}:{lineno}: a JSON {type(obj).__name__}, not an object")
            continue
        if prompt_key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:6]) or "none"
            bad.append(f"{src}:{lineno}: no {prompt_key!r} field (its keys: {keys})")
            continue
        problem = _prompt_problem(obj[prompt_key], prompt_key, messages=messages)
        if problem is not None:
            bad.append(f"{src}:{lineno}: {problem}")
            continue
        records.append(obj)
        lines.append(lineno)
    if bad:
        raise DataError(_bad_lines(bad), fix)
    if not records:
        raise DataError(f"{src} holds no records (it is empty or only blank lines)", fix)
    return records, lines


def _bad_lines(bad: Sequence[str]) -> str:
    more = len(bad) - MAX_REPORTED_LINES
    shown = "; ".join(bad[:MAX_REPORTED_LINES]) + (f"; and {more} more" if more > 0 else "")
    return f"{len(bad)} bad line(s): {shown}"


def load_jsonl(
    path: str | Path, *, prompt_key: str = "prompt", messages: bool = False
) -> list[JSONObject]:
    """The records of a JSONL file (see :func:`read_jsonl`)."""
    return read_jsonl(path, prompt_key=prompt_key, messages=messages)[0]


class PromptDataset:
    """Prompt records addressed by a global prompt index (wrapping around epochs).

    Prompts are encoded once, with ``tokenizer.encode`` or, with ``chat_template``, the
    tokenizer's chat template (:func:`encode_prompt`). ``source`` and ``lines`` name
    where each record came from in errors (:meth:`from_jsonl` sets them).
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, JSONValue]],
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
        chat_template: bool = False,
        source: str | None = None,
        lines: Sequence[int] | None = None,
    ) -> None:
        if not records:
            raise ValueError("PromptDataset needs at least one record")
        self.records = [dict(r) for r in records]
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.chat_template = chat_template
        ids: list[tuple[int, ...]] = []
        bad: list[str] = []
        #: where each record came from (``file:line``, or ``record i``), for messages
        self.locations: list[str] = []
        for i, r in enumerate(self.records):
            where = f"{source}:{lines[i]}" if source and lines else f"record {i}"
            self.locations.append(where)
            try:
                encoded = encode_prompt(tokenizer, r[prompt_key], chat_template=chat_template)
            except Exception as exc:  # the tokenizer's or its chat template's refusal
                bad.append(f"{where}: the prompt cannot be encoded ({type(exc).__name__}: {exc})")
                continue
            if not encoded:
                bad.append(f"{where}: the prompt encodes to no tokens")
            ids.append(tuple(encoded))
        if bad:
            raise DataError(
                _bad_lines(bad),
                "change those prompts, or use a tokenizer that encodes them (the built-in "
                "task's character tokenizer knows only its own alphabet: set "
                "policy.model_path to a Hugging Face model directory with its tokenizer)",
            )
        self._ids = ids

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: Tokenizer,
        *,
        prompt_key: str = "prompt",
        chat_template: bool = False,
    ) -> PromptDataset:
        """The records of a JSONL file (:func:`read_jsonl`), encoded; every error names
        the file and line."""
        records, lines = read_jsonl(path, prompt_key=prompt_key, messages=chat_template)
        return cls(
            records,
            tokenizer,
            prompt_key=prompt_key,
            chat_template=chat_template,
            source=str(path),
            lines=lines,
        )

    def __len__(self) -> int:
        return len(self.records)

    def record(self, prompt_index: int) -> JSONObject:
        return self.records[prompt_index % len(self.records)]

    def prompt_ids(self, prompt_index: int) -> tuple[int, ...]:
        return self._ids[prompt_index % len(self._ids)]


REWARD_FORMS = "'package.module:function' or 'path/to/file.py:function'"


def load_reward_fn(path: str) -> RewardFn:
    """Resolve ``"package.module:function"`` (imported like any module) or
    ``"path/to/file.py:function"`` (a Python file, relative to the working directory,
    imported under a private module name, so it needs no package or ``PYTHONPATH``; its
    own imports resolve against ``sys.path`` as usual, its directory is not added).
    ``ValueError`` when it cannot be found; an exception the module raises while it is
    imported propagates."""
    source, sep, attr = path.rpartition(":")
    if not sep or not source or not attr:
        raise ValueError(f"reward function {path!r}: use the form {REWARD_FORMS}")
    if source.endswith(".py") or "/" in source or "\\" in source:
        module = _import_file(source, spec=path)
        where = str(source)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as exc:
            raise ValueError(f"reward function {path!r}: cannot import {source!r} ({exc})") from exc
        where = repr(source)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward function {path!r}: {where} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def _import_file(source: str, *, spec: str) -> types.ModuleType:
    """Execute the Python file ``source`` as a fresh module (registered in
    ``sys.modules`` under a name derived from its absolute path)."""
    file = Path(source).expanduser().resolve()
    if not file.is_file():
        state = "is not a file" if file.exists() else "does not exist"
        raise ValueError(f"reward function {spec!r}: {source} ({file}) {state}")
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", file.stem)
    name = f"ppo_reward_{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward function {spec!r}: {file} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it: dataclasses, pickle find it there
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


class RewardError(RuntimeError):
    """A group's reward failed: the function raised, timed out, or returned something
    that is not a real finite number. The group is not trained on."""


class RewardFailure(RuntimeError):
    """The run cannot go on: ``rollout.max_consecutive_group_failures`` prompt groups
    failed in a row (the message carries the first one's traceback)."""


REAL_NUMBER = "a reward must return a real number (int or float, not bool, finite)"


@dataclass(frozen=True, slots=True)
class ScoredGroup:
    """A generated group with one reward per sample."""

    output: GroupOutput
    rewards: tuple[float, ...]

    @property
    def prompt_index(self) -> int:
        return self.output.prompt_index

    @property
    def weight_version(self) -> int:
        return self.output.weight_version


def reward_name(fn: Callable[..., object]) -> str:
    """``module:qualname`` of a reward function, for messages."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def _checked(value: object, *, name: str, prompt: int, sample: int) -> float:
    """``value`` as a float, or :class:`RewardError` unless it is a real finite number."""
    # numbers.Real: int, float and what registers as real (numpy's integer and float
    # scalars, Fraction); not bool (nor numpy.bool_, which is not registered), not a
    # tensor or an array (a reward is one number, not data that may carry a graph)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward {name} returned {value!r} ({type(value).__name__}) for prompt {prompt} "
            f"sample {sample}; {REAL_NUMBER}"
        )
    try:
        number = float(value)
    except OverflowError:  # an int (or a Fraction) beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise RewardError(
            f"reward {name} returned {value!r} for prompt {prompt} sample {sample}; {REAL_NUMBER}"
        )
    return number


class _Overran(Exception):
    """Reward call ``index`` of a job did not return before its deadline."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class _Job:
    """Calls made in order on the reward thread; the first that raises ends the job
    (the rest are not made). ``started``: when the running call began (``None`` between
    calls); ``results`` and ``error`` are read under ``cv``."""

    __slots__ = ("abandoned", "calls", "cv", "error", "results", "started")

    def __init__(self, calls: Sequence[Callable[[], object]]) -> None:
        self.calls = calls
        self.cv = threading.Condition()
        self.results: list[object] = []
        self.error: BaseException | None = None
        self.started: float | None = None
        self.abandoned = False

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.results) == len(self.calls)


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        for call in job.calls:
            with job.cv:
                if job.abandoned:  # its caller gave up (a call overran)
                    break
                job.started = time.monotonic()
            try:
                value, error = call(), None
            except BaseException as exc:  # handed to the caller, raised there
                value, error = None, exc
            with job.cv:
                job.started = None
                if error is None:
                    job.results.append(value)
                else:
                    job.error = error
                if job.finished:  # one wake-up per job: the caller only waits for its end
                    job.cv.notify_all()
            if error is not None:
                break


class _RewardThread:
    """Makes the sync reward calls of one calling thread on a daemon thread, so that a
    call can be given up after its deadline. Python cannot kill a thread: a call that
    overruns is abandoned and runs on in the background (it never keeps the process
    from exiting), and the next call gets a new thread. One hand-over per group (a
    job of its calls), not per call: a hand-over is a thread switch, which cost about
    0.3 ms per sample with 256 samples a step."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def run(self, calls: Sequence[Callable[[], object]], *, timeout_s: float) -> _Job:
        """``calls`` in order, each within ``timeout_s`` of its start; returns the
        finished job (its ``error``: the first call's exception, the rest not made), or
        raises :class:`_Overran` naming the call that overran (the job is abandoned)."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="reward", daemon=True).start()
        job = _Job(calls)
        self._jobs.put(job)
        # Woken only by the job's end. A wait that times out looks at the running call:
        # the next wait ends at that call's own deadline, so each call is given up
        # exactly timeout_s after it started.
        with job.cv:
            while not job.finished:
                started = job.started
                left = timeout_s if started is None else started + timeout_s - time.monotonic()
                if started is not None and left <= 0:
                    job.abandoned = True
                    self._jobs.put(None)  # the stuck thread ends after its call, if ever
                    self._jobs = None
                    raise _Overran(len(job.results))
                job.cv.wait(left)
        return job


_THREADS = threading.local()


def _reward_thread() -> _RewardThread:
    runner = getattr(_THREADS, "runner", None)
    if runner is None:
        runner = _THREADS.runner = _RewardThread()
    return runner


async def _await_all(
    pending: Mapping[int, Awaitable[object]], timeout_s: float | None
) -> dict[int, asyncio.Future[object]]:
    """Run the awaitables together for at most ``timeout_s``; those not done by then
    are cancelled (check ``cancelled()``)."""
    tasks: dict[int, asyncio.Future[object]] = {
        j: asyncio.ensure_future(aw) for j, aw in pending.items()
    }
    _, late = await asyncio.wait(tasks.values(), timeout=timeout_s)
    for task in late:
        task.cancel()
    return tasks


def score_group(
    output: GroupOutput,
    *,
    record: Mapping[str, JSONValue],
    reward_fn: RewardFn,
    tokenizer: Tokenizer,
    timeout_s: float | None = None,
) -> ScoredGroup:
    """Reward every sample of ``output``; any failure fails the whole group with a
    :class:`RewardError` naming the reward, the prompt and the sample: the function
    raised, returned something that is not a real number (int or float, not bool,
    finite; any ``numbers.Real`` such as ``numpy.float32`` counts), or overran
    ``timeout_s``.

    Each call gets its own deep copy of ``record``: a reward that edits its argument
    changes neither the data set nor what the group's other samples see.

    ``timeout_s`` (``None`` or 0: no limit) bounds each call. A sync reward then runs on
    a worker thread, and one that overruns is abandoned: a thread cannot be killed, so
    it runs on in the background until it returns (if it ever does). Async rewards are
    awaited together, all within ``timeout_s``, and the late ones are cancelled (an
    async reward that blocks the event loop without awaiting cannot be interrupted).
    """
    name = reward_name(reward_fn)
    prompt = output.prompt_index
    limit = timeout_s or None

    def outcome(j: int, sample: SampleOutput) -> object:
        """Sample ``j``'s checked reward, or its awaitable (checked once awaited)."""
        ids = list(sample.token_ids)
        if sample.finish_reason == "stop" and ids:
            ids = ids[:-1]
        try:
            result = reward_fn(
                response=tokenizer.decode(ids),
                record=copy.deepcopy(record),
                finish_reason=sample.finish_reason,
            )
        except Exception as exc:
            raise RewardError(
                f"reward {name} failed for prompt {prompt} sample {j}: {type(exc).__name__}: {exc}"
            ) from exc
        if inspect.isawaitable(result):
            return result
        return _checked(result, name=name, prompt=prompt, sample=j)

    calls = [functools.partial(outcome, j, s) for j, s in enumerate(output.samples)]
    results: list[object] = []
    try:
        if limit is None:
            for call in calls:  # in this thread: the first failure raises here
                results.append(call())
        else:
            job = _run_on_reward_thread(calls, limit=limit, name=name, prompt=prompt)
            results = job.results
            if job.error is not None:
                raise job.error
    except BaseException:
        for aw in results:  # never awaited: a later sample's failure came first
            if inspect.iscoroutine(aw):
                aw.close()
        raise
    pending = {j: r for j, r in enumerate(results) if inspect.isawaitable(r)}
    rewards = [r if isinstance(r, float) else math.nan for r in results]  # nan: awaited below
    if pending:
        tasks = asyncio.run(_await_all(pending, limit))
        for j, task in tasks.items():
            rewards[j] = _awaited_reward(task, limit=limit, name=name, prompt=prompt, sample=j)
    return ScoredGroup(output=output, rewards=tuple(rewards))


def _run_on_reward_thread(
    calls: Sequence[Callable[[], object]], *, limit: float, name: str, prompt: int
) -> _Job:
    """The group's calls on the reward thread (one hand-over); an overrun as a
    :class:`RewardError` naming the sample."""
    try:
        return _reward_thread().run(calls, timeout_s=limit)
    except _Overran as late:
        raise RewardError(
            f"reward {name} did not return within {limit:g} s for prompt {prompt} "
            f"sample {late.index} (rollout.reward_timeout_s); the call is abandoned and "
            "runs on in the background (a thread cannot be killed)"
        ) from None


def _awaited_reward(
    task: asyncio.Future[object], *, limit: float | None, name: str, prompt: int, sample: int
) -> float:
    """An async reward's checked value once awaited, or a :class:`RewardError` (late,
    cancelled, raised)."""
    if task.cancelled():
        late = f"did not return within {limit:g} s" if limit else "was cancelled"
        raise RewardError(
            f"reward {name} {late} for prompt {prompt} sample {sample} "
            "(rollout.reward_timeout_s); the call was cancelled"
        )
    error = task.exception()
    if error is not None:
        raise RewardError(
            f"reward {name} failed for prompt {prompt} sample {sample}: "
            f"{type(error).__name__}: {error}"
        ) from error
    return _checked(task.result(), name=name, prompt=prompt, sample=sample)
