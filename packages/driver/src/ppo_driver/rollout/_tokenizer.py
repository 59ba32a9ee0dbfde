"""Tokenizers that need no download: a character-level one the project builds, or a
local Hugging Face tokenizer directory given by path."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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


class HFTokenizer:
    """A local Hugging Face tokenizer directory (never downloads: ``local_files_only``)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
        self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {str(path)!r} has no eos token; set one")

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

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(path: str | Path | None = None, *, vocab_size: int | None = None) -> Tokenizer:
    """``None``: the built-in :class:`CharTokenizer` (padded to ``vocab_size`` if given);
    a directory holding ``ppo_char_tokenizer.json``: that char tokenizer; any other
    directory: a local Hugging Face tokenizer."""
    if path is None:
        return CharTokenizer(vocab_size=vocab_size)
    if (Path(path) / "ppo_char_tokenizer.json").is_file():
        return CharTokenizer.load(path)
    return HFTokenizer(path)
