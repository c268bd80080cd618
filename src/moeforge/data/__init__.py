"""Data: the embedded corpus, tokenizer, prepare (text -> token memmaps), windows, sharded loader.

Typical use::

    meta = prepare_data(cfg.data)                       # idempotent; reuses a matching data dir
    train = TokenWindows.from_meta(meta, "train", cfg.data.seq_len)
    loader = ShardedLoader(train, G, micro, rank, world_size, seed)
    micro_batches = loader.next_step()                  # list of (micro, seq_len + 1) LongTensors
"""

from moeforge.data.corpus import (
    DataError,
    Document,
    embedded_corpus_files,
    read_documents,
    sources_fingerprint,
)
from moeforge.data.dataset import TokenWindows
from moeforge.data.loader import ShardedLoader, epoch_offset, epoch_permutation, eval_batches
from moeforge.data.meta import DataMeta, SplitStats, bits_per_byte, load_meta
from moeforge.data.prepare import prepare_data, split_documents, token_dtype
from moeforge.data.tokenizer import EOS_TOKEN, Tokenizer, train_bpe

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "DataMeta",
    "Document",
    "ShardedLoader",
    "SplitStats",
    "TokenWindows",
    "Tokenizer",
    "bits_per_byte",
    "embedded_corpus_files",
    "epoch_offset",
    "epoch_permutation",
    "eval_batches",
    "load_meta",
    "prepare_data",
    "read_documents",
    "sources_fingerprint",
    "split_documents",
    "token_dtype",
    "train_bpe",
]
