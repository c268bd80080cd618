"""Data: embedded corpus, tokenizer, prepare, windows, sharded resumable loader, eval batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from moeforge.config import DataConfig
from moeforge.data import (
    EOS_TOKEN,
    DataError,
    ShardedLoader,
    Tokenizer,
    TokenWindows,
    bits_per_byte,
    embedded_corpus_files,
    epoch_offset,
    eval_batches,
    load_meta,
    prepare_data,
    split_documents,
    train_bpe,
)

TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n",
    "And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end\n",
    "The heart-ache and the thousand natural shocks\nThat flesh is heir to, 'tis a consummation\n",
    "Devoutly to be wish'd. To die, to sleep;\nTo sleep: perchance to dream: ay, there's the rub;\n",
    "Ünïcödé line — with “quotes”, 日本語 and an emoji 🎭 so bytes != characters.\n",
]


def write_corpus(root: Path, texts: list[str] = TEXTS) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        p = root / f"doc{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    return paths


def cfg_for(tmp_path: Path, sources: list[str], **kw) -> DataConfig:
    kw.setdefault("bpe_vocab_size", 300)
    kw.setdefault("val_fraction", 0.34)
    return DataConfig(sources=sources, data_dir=str(tmp_path / "data"), **kw)


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """Cut a flat token array at EOS; every document must end with one."""
    assert tokens[-1] == eos
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


def file_ids(data_dir: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(data_dir.iterdir())}


# ---------------------------------------------------------------------------
# corpus and tokenizer


def test_embedded_corpus_lists_the_gutenberg_plays():
    files = embedded_corpus_files()
    assert len(files) == 42
    assert files == sorted(files)
    assert all(f.name.endswith("_gut.txt") and f.stat().st_size > 0 for f in files)
    assert "hamlet_gut.txt" in {f.name for f in files}


def test_tokenizer_roundtrip_and_eos():
    tok = train_bpe(TEXTS * 3, vocab_size=300)
    assert 257 <= tok.vocab_size <= 300
    assert tok.eos_id == tok.token_to_id(EOS_TOKEN) == 0
    samples = [*TEXTS, "", "  leading spaces\r\n\ttabs\x00nul", "bytes never seen: ☃ ∑ 𝄞 Ωμέγα"]
    for text in samples:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(samples) == [tok.encode(s) for s in samples]
    # A literal special-token string in a document is plain text, never the EOS id.
    injected = f"end{EOS_TOKEN}start"
    assert tok.eos_id not in tok.encode(injected)
    assert tok.decode(tok.encode(injected)) == injected
    assert tok.decode([*tok.encode("hi"), tok.eos_id]) == "hi" + EOS_TOKEN
    assert tok.decode([*tok.encode("hi"), tok.eos_id], skip_special_tokens=True) == "hi"


def test_bits_per_byte():
    assert bits_per_byte(math.log(2), 100, 100) == pytest.approx(1.0)
    # 2.0 nats/token, 3 tokens over 12 bytes: 6 nats / 12 bytes = 0.5 nats/byte.
    assert bits_per_byte(2.0, 3, 12) == pytest.approx(0.5 / math.log(2))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 10, 0)


# ---------------------------------------------------------------------------
# prepare


def test_prepare_writes_token_memmaps_and_exact_meta(tmp_path):
    sources = write_corpus(tmp_path / "corpus")
    cfg = cfg_for(tmp_path, sources)
    meta = prepare_data(cfg)
    data_dir = Path(cfg.data_dir)
    assert sorted(p.name for p in data_dir.iterdir()) == [
        "meta.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]
    assert meta == load_meta(data_dir)
    assert json.loads((data_dir / "meta.json").read_text())["train"]["documents"] == meta.train.documents

    val_idx = split_documents(len(TEXTS), 0.34)
    assert len(val_idx) == round(0.34 * len(TEXTS)) == 2
    expected = {
        "val": [TEXTS[i] for i in val_idx],
        "train": [t for i, t in enumerate(TEXTS) if i not in val_idx],
    }
    tok = Tokenizer.from_file(meta.tokenizer_path)
    assert (meta.vocab_size, meta.eos_id, meta.dtype) == (tok.vocab_size, tok.eos_id, "uint16")
    for split, texts in expected.items():
        stats = meta.split(split)
        tokens = np.fromfile(meta.split_path(split), dtype=np.uint16)
        assert stats.documents == len(texts)
        assert stats.tokens == tokens.size == sum(len(tok.encode(t)) + 1 for t in texts)
        assert stats.bytes == sum(len(t.encode("utf-8")) for t in texts)
        assert [tok.decode(d) for d in split_docs(tokens, meta.eos_id)] == texts


def test_split_is_deterministic_and_bounded():
    assert split_documents(100, 0.1) == split_documents(100, 0.1)
    assert split_documents(100, 0.1) != split_documents(100, 0.1, seed=7)
    assert len(split_documents(100, 0.1)) == 10
    assert len(split_documents(3, 0.01)) == 1  # at least one validation document
    assert len(split_documents(3, 0.99)) == 2  # at least one training document


def test_prepare_is_idempotent_and_redoes_work_on_change(tmp_path):
    sources = write_corpus(tmp_path / "corpus")
    cfg = cfg_for(tmp_path, sources)
    meta = prepare_data(cfg)
    before = file_ids(Path(cfg.data_dir))
    assert prepare_data(cfg) == meta
    assert file_ids(Path(cfg.data_dir)) == before  # nothing rewritten

    cfg.val_fraction = 0.5  # other settings: refused (see test_prepared_data_of_other_sources_is_never_overwritten)
    with pytest.raises(DataError, match="prepared from other val_fraction"):
        prepare_data(cfg)
    assert file_ids(Path(cfg.data_dir)) == before
    meta2 = prepare_data(cfg, overwrite=True)
    assert meta2.val.documents == 3
    after = file_ids(Path(cfg.data_dir))
    assert after["meta.json"] != before["meta.json"] and after["val.bin"] != before["val.bin"]

    Path(sources[0]).write_text("An edited first document.\n")
    meta3 = prepare_data(cfg)
    assert meta3.sources_fingerprint != meta2.sources_fingerprint
    assert file_ids(Path(cfg.data_dir))["meta.json"] != after["meta.json"]


def test_prepare_jsonl_one_document_per_line(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS[:4])]
    jsonl.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n", encoding="utf-8")
    txt = write_corpus(tmp_path / "corpus", TEXTS[4:5])
    meta = prepare_data(cfg_for(tmp_path, [str(jsonl), *txt], val_fraction=0.2))
    assert (meta.train.documents, meta.val.documents) == (4, 1)
    assert meta.train.bytes + meta.val.bytes == sum(len(t.encode()) for t in TEXTS[:5])


def test_user_tokenizer_loads_and_gives_the_same_tokens(tmp_path):
    sources = write_corpus(tmp_path / "corpus")
    ref = prepare_data(cfg_for(tmp_path / "a", sources))
    user_tok = tmp_path / "user_tokenizer.json"
    user_tok.write_bytes(ref.tokenizer_path.read_bytes())
    meta = prepare_data(cfg_for(tmp_path / "b", sources, tokenizer=str(user_tok)))
    assert meta.tokenizer_key.startswith("file:")
    assert meta.tokenizer_path.read_bytes() == user_tok.read_bytes()
    for split in ("train", "val"):
        assert meta.split_path(split).read_bytes() == ref.split_path(split).read_bytes()


def test_embedded_corpus_prepares_by_default(tmp_path):
    cfg = DataConfig(data_dir=str(tmp_path / "shakespeare"))  # the demo's settings: BPE 4096
    meta = prepare_data(cfg)
    files = embedded_corpus_files()
    assert meta.sources == [str(f) for f in files]
    assert (meta.train.documents, meta.val.documents) == (40, 2)  # round(0.05 * 42) = 2 held-out plays
    assert meta.train.bytes + meta.val.bytes == sum(f.stat().st_size for f in files)
    val = np.fromfile(meta.split_path("val"), dtype=meta.dtype)
    tok = Tokenizer.from_file(meta.tokenizer_path)
    held_out = [files[i].read_text() for i in split_documents(len(files), cfg.val_fraction)]
    assert [tok.decode(d) for d in split_docs(val, meta.eos_id)] == held_out


# ---------------------------------------------------------------------------
# errors


def test_missing_and_empty_files_name_the_file(tmp_path):
    sources = write_corpus(tmp_path / "corpus")
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match=r"nope.txt: file not found"):
        prepare_data(cfg_for(tmp_path, [*sources, missing]))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty.txt: file is empty"):
        prepare_data(cfg_for(tmp_path, [*sources, str(empty)]))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n")
    with pytest.raises(DataError, match=r"blank.txt: file holds only whitespace"):
        prepare_data(cfg_for(tmp_path, [*sources, str(blank)]))
    with pytest.raises(DataError, match=r"doc0.txt: the sources hold 1 document"):
        prepare_data(cfg_for(tmp_path, sources[:1]))
    assert not (tmp_path / "data" / "meta.json").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"content": "no text field"}', r'bad.jsonl:2: no "text" field'),
        ("{not json", r"bad.jsonl:2: not valid JSON"),
        ('{"text": 42}', r'bad.jsonl:2: "text" must be a string'),
        ('["text"]', r'bad.jsonl:2: no "text" field'),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        prepare_data(cfg_for(tmp_path, [*write_corpus(tmp_path / "corpus"), str(bad)]))


def test_non_utf8_file_is_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not valid UTF-8"):
        prepare_data(cfg_for(tmp_path, [*write_corpus(tmp_path / "corpus"), str(bad)]))


def word_level_tokenizer(path: Path, vocab: dict[str, int]) -> Path:
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    HFTokenizer.from_str(json.dumps(spec)).save(str(path))
    return path


def test_token_ids_beyond_the_vocab_are_rejected_and_leave_no_complete_dir(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", ["hello world", "hello hello", "world hello"])
    good = prepare_data(cfg_for(tmp_path, corpus, val_fraction=0.34))
    assert load_meta(good.data_dir) == good
    # "world" has id 999 in a 4-token vocabulary: ids are not contiguous.
    tok = word_level_tokenizer(tmp_path / "gappy.json", {"[UNK]": 0, EOS_TOKEN: 1, "hello": 2, "world": 999})
    assert Tokenizer.from_file(tok).vocab_size == 4
    with pytest.raises(DataError, match=r"doc0.txt: tokenizer .*gappy.json produced token id 999 >= its vocab"):
        prepare_data(cfg_for(tmp_path, corpus, tokenizer=str(tok)), overwrite=True)
    # The failed re-prepare removed the stale meta first and left no temp files behind (its marker stays).
    names = sorted(p.name for p in good.data_dir.iterdir())
    assert names == [".preparing.json", "tokenizer.json", "train.bin", "val.bin"]
    with pytest.raises(DataError, match=r"meta.json: not found"):
        load_meta(good.data_dir)


def test_user_tokenizer_without_eos_is_rejected(tmp_path):
    tok = word_level_tokenizer(tmp_path / "noeos.json", {"[UNK]": 0, "hello": 1})
    with pytest.raises(DataError, match=r"noeos.json: tokenizer has no end-of-document token"):
        prepare_data(cfg_for(tmp_path, write_corpus(tmp_path / "corpus"), tokenizer=str(tok)))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{]")
    with pytest.raises(DataError, match=r"garbage.json: not a valid Hugging Face tokenizer.json"):
        prepare_data(cfg_for(tmp_path, write_corpus(tmp_path / "corpus"), tokenizer=str(garbage)))


def test_load_meta_detects_absent_corrupt_and_truncated_data(tmp_path):
    with pytest.raises(DataError, match=r"meta.json: not found; run `moeforge prepare`"):
        load_meta(tmp_path)
    meta = prepare_data(cfg_for(tmp_path, write_corpus(tmp_path / "corpus")))
    train = meta.split_path("train")
    train.write_bytes(train.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"train.bin: missing or not the"):
        load_meta(meta.data_dir)
    assert prepare_data(cfg_for(tmp_path, meta.sources)) == meta  # a broken dir is prepared again
    (meta.data_dir / "meta.json").write_text('{"tokenizer": "tokenizer.json"')
    with pytest.raises(DataError, match=r"meta.json: corrupt"):
        load_meta(meta.data_dir)


# ---------------------------------------------------------------------------
# windows


def arange_windows(tmp_path: Path, n_tokens: int, seq_len: int) -> TokenWindows:
    path = tmp_path / f"arange_{n_tokens}.bin"
    np.arange(n_tokens, dtype=np.uint32).tofile(path)
    return TokenWindows(path, "uint32", seq_len)


def test_windows_are_non_overlapping_with_one_shared_boundary_token(tmp_path):
    ds = arange_windows(tmp_path, 41, seq_len=8)
    assert len(ds) == 5
    for i in range(len(ds)):
        w = ds[i]
        assert w.dtype == torch.long and w.shape == (9,)
        assert w.tolist() == list(range(8 * i, 8 * i + 9))
    assert ds[-1].tolist() == ds[4].tolist()
    with pytest.raises(IndexError):
        ds[5]
    # 40 tokens: the 5th window would lack its last target.
    assert len(arange_windows(tmp_path, 40, seq_len=8)) == 4
    with pytest.raises(DataError, match=r"arange_8.bin: holds 8 tokens, fewer than one window"):
        arange_windows(tmp_path, 8, seq_len=8)


# ---------------------------------------------------------------------------
# loader


def window_ids(batch: torch.Tensor, seq_len: int) -> list[int]:
    return (batch[:, 0] // seq_len).tolist()


def run_loader(loader: ShardedLoader, steps: int) -> list[list[int]]:
    """Window indices of each step (this rank's micro-batches concatenated)."""
    seq = loader.dataset.seq_len
    out = []
    for _ in range(steps):
        micro = loader.next_step()
        assert all(m.shape == (loader.micro_batch_size, seq + 1) for m in micro)
        assert len(micro) == loader.grad_accum_steps
        out.append([i for m in micro for i in window_ids(m, seq)])
    return out


def test_loader_epochs_are_seeded_permutations(tmp_path):
    ds = arange_windows(tmp_path, 4 * 43 + 1, seq_len=4)  # 43 windows, G=8: 5 steps an epoch, 3 dropped
    a = run_loader(ShardedLoader(ds, 8, 4, seed=3), 15)
    assert a == run_loader(ShardedLoader(ds, 8, 4, seed=3), 15)
    assert a != run_loader(ShardedLoader(ds, 8, 4, seed=4), 15)
    for epoch in range(3):
        seen = [i for step in a[5 * epoch : 5 * epoch + 5] for i in step]
        assert len(set(seen)) == 40 and set(seen) <= set(range(43))
    assert a[:5] != a[5:10]  # each epoch reshuffles
    ordered = run_loader(ShardedLoader(ds, 8, 8, shuffle=False), 6)
    assert ordered[0] == list(range(8)) and ordered[5] == list(range(8))


@pytest.mark.parametrize(("world_size", "micro"), [(2, 4), (2, 2), (4, 1), (4, 2)])
def test_rank_shards_are_disjoint_and_union_to_the_global_batch(tmp_path, world_size, micro):
    ds = arange_windows(tmp_path, 3 * 50 + 1, seq_len=3)
    G = 8
    single = run_loader(ShardedLoader(ds, G, G // 2, seed=11), 13)
    per_rank = [run_loader(ShardedLoader(ds, G, micro, r, world_size, seed=11), 13) for r in range(world_size)]
    for step in range(13):
        shards = [per_rank[r][step] for r in range(world_size)]
        assert all(len(s) == G // world_size for s in shards)
        assert len(set().union(*map(set, shards))) == G  # disjoint
        assert [i for s in shards for i in s] == single[step]  # same rows, same order


def test_loader_resumes_exactly_mid_epoch_and_across_epochs(tmp_path):
    ds = arange_windows(tmp_path, 2 * 30 + 1, seq_len=2)  # 30 windows, G=4: 7 steps an epoch
    straight = ShardedLoader(ds, 4, 2, rank=1, world_size=2, seed=5)
    expected = run_loader(straight, 20)
    for cut in (3, 7, 9, 14):  # mid-epoch, exactly at an epoch's end, and in later epochs
        first = ShardedLoader(ds, 4, 2, rank=1, world_size=2, seed=5)
        got = run_loader(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        assert set(state) == {"epoch", "position"}
        resumed = ShardedLoader(ds, 4, 2, rank=1, world_size=2, seed=5)
        resumed.load_state_dict(state)
        got += run_loader(resumed, 20 - cut)
        assert got == expected, cut
    assert straight.state_dict() == {"epoch": 2, "position": 6}
    with pytest.raises(ValueError, match=r"position 9 is past the 7 steps"):
        resumed.load_state_dict({"epoch": 0, "position": 9})


def first_tokens(loader: ShardedLoader, steps: int) -> list[list[int]]:
    """The first token of every row of each step (the arange corpus: a row's position in the token file)."""
    return [[int(m[j, 0]) for m in loader.next_step() for j in range(m.shape[0])] for _ in range(steps)]


def test_shift_windows_tiles_later_epochs_from_a_seeded_offset(tmp_path):
    ds = arange_windows(tmp_path, 8 * 20 + 1, seq_len=8)  # 20 windows of 8; G=4: 5 steps in epoch 0
    plain = first_tokens(ShardedLoader(ds, 4, 2, seed=7), 30)
    shifted_loader = ShardedLoader(ds, 4, 2, seed=7, shift_windows=True)
    shifted = first_tokens(shifted_loader, 30)
    assert shifted[:5] == plain[:5]  # epoch 0 is the unshifted tiling
    offsets = [epoch_offset(8, 7, e) for e in range(1, 7)]
    assert len(set(offsets)) > 1 and all(0 <= o < 8 for o in offsets)
    assert offsets == [epoch_offset(8, 7, e) for e in range(1, 7)] != [epoch_offset(8, 8, e) for e in range(1, 7)]
    assert epoch_offset(8, 7, 3, shift=False) == 0
    starts = [t for step in shifted[5:] for t in step]
    assert {t % 8 for t in starts} >= {o for o in offsets if o} and all(t % 8 in offsets for t in starts)
    for row in ShardedLoader(ds, 4, 2, seed=7, shift_windows=True).next_step():  # rows are contiguous tokens
        assert all(r.tolist() == list(range(int(r[0]), int(r[0]) + 9)) for r in row)
    # an epoch with an offset > 0 has one window fewer (19): 4 steps, its windows all distinct
    e1 = next(e for e in range(1, 7) if epoch_offset(8, 7, e))
    loader = ShardedLoader(ds, 4, 2, seed=7, shift_windows=True)
    loader.load_state_dict({"epoch": e1, "position": 0})
    assert loader.steps_per_epoch == 4
    epoch_rows = [t for step in first_tokens(loader, 4) for t in step]
    assert len(set(epoch_rows)) == 16 and all(t % 8 == epoch_offset(8, 7, e1) for t in epoch_rows)
    # resumable across the shifted epochs, and the same rows on 2 ranks as on one
    first = ShardedLoader(ds, 4, 2, seed=7, shift_windows=True)
    got = first_tokens(first, 12)
    resumed = ShardedLoader(ds, 4, 2, seed=7, shift_windows=True)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert got + first_tokens(resumed, 18) == shifted
    ranks = [first_tokens(ShardedLoader(ds, 4, 2, r, 2, seed=7, shift_windows=True), 30) for r in range(2)]
    assert [a + b for a, b in zip(*ranks)] == shifted
    with pytest.raises(ValueError, match=rf"position 5 is past the 4 steps of epoch {e1}"):
        resumed.load_state_dict({"epoch": e1, "position": 5})
    # 8 windows fill a global batch of 8 unshifted, but a shifted epoch holds only 7
    eight = arange_windows(tmp_path, 8 * 8 + 1, seq_len=8)
    ShardedLoader(eight, 8, 8)
    with pytest.raises(DataError, match=r"holds 7 windows of 9 tokens, fewer than one global batch"):
        ShardedLoader(eight, 8, 8, shift_windows=True)


def test_loader_validates_batch_layout(tmp_path):
    ds = arange_windows(tmp_path, 2 * 30 + 1, seq_len=2)
    with pytest.raises(ValueError, match=r"global_batch_size \(12\) must be a multiple of .* \(4 \* 2 = 8\)"):
        ShardedLoader(ds, 12, 4, rank=0, world_size=2)
    with pytest.raises(DataError, match=r"holds 30 windows of 3 tokens, fewer than one global batch"):
        ShardedLoader(ds, 32, 4)
    with pytest.raises(ValueError, match=r"rank must be in"):
        ShardedLoader(ds, 8, 4, rank=2, world_size=2)


def test_eval_batches_are_deterministic_disjoint_rank_shards(tmp_path):
    ds = arange_windows(tmp_path, 4 * 37 + 1, seq_len=4)  # 37 windows
    full = eval_batches(ds, 8, 3)
    assert [window_ids(b, 4) for b in full] == [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    assert len(eval_batches(ds, 8, 0)) == len(eval_batches(ds, 8, 100)) == 4  # all complete batches
    for world_size in (2, 4):
        shards = [eval_batches(ds, 8, 3, r, world_size) for r in range(world_size)]
        assert all(len(s) == 3 and s[0].shape == (8 // world_size, 5) for s in shards)
        for b in range(3):
            assert torch.equal(torch.cat([shards[r][b] for r in range(world_size)]), full[b])
    with pytest.raises(ValueError, match=r"multiple of the data-parallel size"):
        eval_batches(ds, 6, 1, 0, 4)
    with pytest.raises(DataError, match=r"fewer than one evaluation batch"):
        eval_batches(ds, 40, 1)
