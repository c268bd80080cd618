"""A thin wrapper over a Hugging Face ``tokenizers`` tokenizer, and byte-level BPE training.

moeforge trains its own byte-level BPE on the training documents (seconds for
the embedded corpus) unless the user names a ``tokenizer.json``; both load
through :class:`Tokenizer`. Every document ends with an end-of-document token
(``<|endoftext|>`` for the trained BPE).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from moeforge.data.corpus import DataError

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, tried in order for a user tokenizer.json.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer:
    """Text <-> token ids, with the vocabulary size and the end-of-document id.

    Special-token strings inside the text are encoded as plain text, so a
    document can never inject an end-of-document token; ``encode`` adds no
    BOS/EOS (the data pipeline appends ``eos_id`` after each document).
    """

    def __init__(self, tokenizer: HFTokenizer, source: str = "<memory>") -> None:
        self._tok = tokenizer
        self._tok.encode_special_tokens = True
        self.source = source
        eos = next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(
                f"{source}: tokenizer has no end-of-document token (looked for {list(EOS_CANDIDATES)}); "
                f"add {EOS_TOKEN!r} to it as a special token"
            )
        self.eos_token = eos
        self._eos_id = int(tokenizer.token_to_id(eos))

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json`` (ours or any Hugging Face one)."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file not found; fix data.tokenizer or leave it empty to train one")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise DataError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
        return cls(tok, str(path))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        """Id of the end-of-document token."""
        return self._eos_id

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry ``token``, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (in parallel threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; the end-of-document token shows as text unless skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (temp file, then rename)."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        self._tok.save(str(tmp))
        os.replace(tmp, path)

    def to_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text."""
        return self._tok.to_str()


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>``.

    Every byte is in the initial alphabet, so any text round-trips exactly.
    """
    min_size = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < min_size:
        raise DataError(f"data.bpe_vocab_size: must be >= {min_size} (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    logger.info("trained a byte-level BPE with %d tokens", tok.get_vocab_size())
    return Tokenizer(tok, f"<byte-level BPE {vocab_size}>")
