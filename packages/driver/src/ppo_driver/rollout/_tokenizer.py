"""Tokenizers that need no download: a character-level one the project builds (the
built-in task's), or a local Hugging Face tokenizer directory given by path (a
``policy.model_path`` model directory), with its chat template and stop tokens."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ppo_driver._json import JSONValue

DEFAULT_ALPHABET = "abcdefgh0123456789:"
"""The synthetic task's alphabet (letters to repeat, digits for counts, a separator)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the rollout side needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """Character-level tokenizer: ids 0, 1, 2 are pad, bos, eos; then one id per
    alphabet character. ``encode`` prepends bos; ``decode`` drops special ids and maps
    ids outside the vocabulary (a model may have a larger embedding) to ``unknown``.
    ``vocab_size`` may be padded up to the model's vocabulary size."""

    PAD = 0
    BOS = 1
    EOS = 2

    def __init__(
        self, alphabet: str = DEFAULT_ALPHABET, *, vocab_size: int | None = None, unknown: str = "?"
    ) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(
                f"alphabet={alphabet!r}: use a non-empty string of distinct characters"
            )
        self.alphabet = alphabet
        self.unknown = unknown
        self._to_id = {ch: i + 3 for i, ch in enumerate(alphabet)}
        natural = len(alphabet) + 3
        if vocab_size is not None and vocab_size < natural:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the {natural} ids the alphabet "
                f"needs; use vocab_size >= {natural}"
            )
        self._vocab_size = natural if vocab_size is None else vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> int | None:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end generation: ``(eos_id,)``."""
        return (self.EOS,)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        bad = sorted({ch for ch in text if ch not in self._to_id})
        if bad:
            raise ValueError(
                f"text {text!r} has characters {bad} outside the alphabet {self.alphabet!r}"
            )
        ids = [self._to_id[ch] for ch in text]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            if i in (self.PAD, self.BOS, self.EOS):
                continue
            j = int(i) - 3
            out.append(self.alphabet[j] if 0 <= j < len(self.alphabet) else self.unknown)
        return "".join(out)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` (this class's own small format) into ``path``."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        data = {"kind": "ppo_char", "alphabet": self.alphabet, "vocab_size": self._vocab_size}
        (d / "ppo_char_tokenizer.json").write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        data = json.loads((Path(path) / "ppo_char_tokenizer.json").read_text())
        return cls(str(data["alphabet"]), vocab_size=int(data["vocab_size"]))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A Hugging Face tokenizer directory holds at least one of these."""


class HFTokenizer:
    """A local Hugging Face tokenizer directory (never downloads: ``local_files_only``),
    e.g. the ``policy.model_path`` model directory.

    ``eos_id`` is the tokenizer's end-of-sequence token (required); ``pad_id`` its pad
    token, else ``eos_id``. ``stop_ids``: ``eos_id`` plus the ``eos_token_id`` (one id
    or a list) of a ``generation_config.json`` in the same directory, which chat models
    use for their end-of-turn token. ``encode`` adds what the tokenizer's post-processor
    adds (e.g. a BOS token); :meth:`encode_chat` renders the tokenizer's chat template
    (with the generation prompt) and encodes the result without adding special tokens
    again (the template writes its own).
    """

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
        if not any((self.path / name).is_file() for name in TOKENIZER_FILES):
            # AutoTokenizer would build an EMPTY tokenizer from config.json's model type
            raise ValueError(
                f"{str(path)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                "the directory needs the tokenizer's files, as save_pretrained writes them"
            )
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            first = " ".join(str(exc).split())[:300]
            raise ValueError(
                f"no tokenizer loads from {str(path)!r} (transformers.AutoTokenizer, local "
                f"files only: {type(exc).__name__}: {first}); the directory needs the "
                "tokenizer's files (tokenizer.json and tokenizer_config.json, as "
                "save_pretrained writes them)"
            ) from exc
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"the tokenizer at {str(path)!r} has no eos token (generation could not "
                "stop); set eos_token in its tokenizer_config.json"
            )
        self._stop_ids = (self.eos_id, *_generation_eos_ids(self.path, exclude=self.eos_id))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else int(self._tok.eos_token_id)

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text)]

    def encode_chat(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        """The chat template around ``prompt`` (a string: one user message; or a list
        of ``{"role", "content"}`` messages), ending with the generation prompt."""
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer at {str(self.path)!r} has no chat template; set "
                "rollout.apply_chat_template=false, or use a tokenizer that has one"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
        return [int(i) for i in self._tok.encode(str(text), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def _generation_eos_ids(path: Path, *, exclude: int) -> list[int]:
    """``eos_token_id`` of ``path/generation_config.json`` (an id or a list), if any."""
    try:
        data = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    ids = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = ids if isinstance(ids, list) else [ids]
    out: list[int] = []
    for i in ids:
        if isinstance(i, int) and not isinstance(i, bool) and i != exclude and i not in out:
            out.append(i)
    return out


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: str | Sequence[Mapping[str, str]] | JSONValue,
    *,
    chat_template: bool,
) -> list[int]:
    """The token ids of a prompt: ``tokenizer.encode(prompt)``, or with ``chat_template``
    the tokenizer's chat template around it (:meth:`HFTokenizer.encode_chat`). A data
    set record's value (a JSON value) is checked here: a string, or with the chat
    template whatever the template accepts (a list of messages)."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a prompt must be a string (message lists need the chat template)")
        return list(tokenizer.encode(prompt))
    encode_chat = getattr(tokenizer, "encode_chat", None)
    if encode_chat is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template (only a Hugging Face "
            "tokenizer, from policy.model_path, can have one)"
        )
    return list(encode_chat(prompt))


def load_tokenizer(path: str | Path | None = None, *, vocab_size: int | None = None) -> Tokenizer:
    """``None``: the built-in :class:`CharTokenizer` (padded to ``vocab_size`` if given);
    a directory holding ``ppo_char_tokenizer.json``: that char tokenizer; any other
    directory: a local Hugging Face tokenizer."""
    if path is None:
        return CharTokenizer(vocab_size=vocab_size)
    if (Path(path) / "ppo_char_tokenizer.json").is_file():
        return CharTokenizer.load(path)
    return HFTokenizer(path)
