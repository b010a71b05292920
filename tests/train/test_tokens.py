"""Tokenized and record data (`wholeshard.train.tokens`): formats, the EOS-joined stream, the
memory-mapped cache and its key, the split, the builder/agree protocol, and batches."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from wholeshard.train import data, tokens
from wholeshard.train.sections import DataConfig

datasets = pytest.importorskip("datasets")
hf = pytest.importorskip("hf_support")


class CharTokenizer:
    """A stand-in tokenizer: id = offset + code point; counts its calls."""

    def __init__(self, size: int = 300, offset: int = 0) -> None:
        self.size, self.offset, self.calls = size, offset, 0
        self.eos_token_id = size - 1

    @property
    def backend_tokenizer(self):
        state = f"char size={self.size} offset={self.offset}"
        return type("Backend", (), {"to_str": lambda _self: state})()

    def __len__(self) -> int:
        return self.size

    def __call__(self, docs: list[str], add_special_tokens: bool = False) -> dict:
        self.calls += 1
        return {"input_ids": [[self.offset + ord(c) for c in d] for d in docs]}


DOCS = [f"doc {i}: " + "abc xyz " * (i % 7 + 1) for i in range(50)]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    import transformers

    out = tmp_path_factory.mktemp("tok")
    hf.train_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(out)


def write_jsonl(path: Path, docs: list[str], field: str = "text", **extra) -> Path:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, **extra}) + "\n")
    return path


def write_parquet(path: Path, docs: list[str], field: str = "text") -> Path:
    datasets.Dataset.from_dict({field: docs, "n": list(range(len(docs)))}).to_parquet(path)
    return path


def load(path: Path, cache: Path, **kw) -> data.Corpus:
    cfg = DataConfig(
        path=str(path),
        **{k: kw.pop(k) for k in ("text_field", "val_fraction") if k in kw},
    )
    tok = kw.get("tokenizer")
    kw.setdefault("vocab_size", 256 if tok is None else len(tok))
    return tokens.load_data(cfg, cache_dir=cache, **kw)


def stream(corpus: data.Corpus) -> list[int]:
    """The stream in document order, undoing the cache's train-then-val layout."""
    t, v = corpus.train.tolist(), corpus.val.tolist()
    out, ti, vi = [], 0, 0
    for a, b, is_val in data.split_blocks(len(t) + len(v)):
        n = b - a
        out += v[vi : vi + n] if is_val else t[ti : ti + n]
        vi, ti = (vi + n, ti) if is_val else (vi, ti + n)
    return out


# -- formats and the stream ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "jsonl-dir", "parquet-dir"])
def test_record_formats_decode_to_the_documents_joined_by_eos(
    tmp_path: Path, hf_tokenizer, kind: str
) -> None:
    src = tmp_path / "data"
    src.mkdir()
    if kind == "jsonl":
        path = write_jsonl(src / "a.jsonl", DOCS)
    elif kind == "json":
        path = src / "a.json"
        path.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(DOCS)]))
    elif kind == "parquet":
        path = write_parquet(src / "a.parquet", DOCS)
    else:
        write = write_jsonl if kind == "jsonl-dir" else write_parquet
        suffix = kind.split("-")[0]
        write(src / f"b.{suffix}", DOCS[25:])
        write(src / f"a.{suffix}", DOCS[:25])
        (src / "README.md").write_text("not data")
        path = src
    corpus = load(path, tmp_path / "cache", tokenizer=hf_tokenizer, vocab_size=300)
    assert corpus.unit == "tokens" and corpus.train.dtype == torch.uint16
    assert corpus.cache is not None and corpus.cache.exists()
    assert hf_tokenizer.decode(stream(corpus)) == hf.EOS.join(DOCS)


def test_bytes_of_records_and_tokens_of_text_files(tmp_path: Path) -> None:
    corpus = load(write_jsonl(tmp_path / "a.jsonl", DOCS), tmp_path / "c", vocab_size=256)
    assert corpus.unit == "bytes" and corpus.train.dtype == torch.uint8
    assert bytes(stream(corpus)) == "\n".join(DOCS).encode()
    texts = tmp_path / "texts"
    texts.mkdir()
    for name, body in [("b.txt", "second"), ("a.txt", "first"), ("c.bin", "\0x"), ("e", "")]:
        (texts / name).write_text(body)
    tok = CharTokenizer()
    corpus = load(texts, tmp_path / "c", tokenizer=tok)
    assert stream(corpus) == [ord(c) for c in "first"] + [299] + [ord(c) for c in "second"]
    assert corpus.files == 2 and corpus.source == str(texts)


def test_plain_text_without_tokenizer_is_the_old_byte_path(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(1, 256)) * 37)
    calls = []
    corpus = load(path, tmp_path / "c", agree=lambda ok: calls.append(ok) or ok)
    old = data.load_corpus(path)
    assert torch.equal(corpus.train, old.train) and torch.equal(corpus.val, old.val)
    assert corpus.cache is None and corpus.unit == "bytes" and calls == [True]
    assert not (tmp_path / "c").exists()


# -- the split -------------------------------------------------------------------------------


def old_split(blob: bytes) -> tuple[bytes, bytes]:
    """The split before val_fraction: 100 blocks, every 20th validation."""
    block = -(-len(blob) // 100)
    train, val = [], []
    for i in range(100):
        chunk = blob[i * block : (i + 1) * block]
        (val if i % 20 == 19 else train).append(chunk)
    return b"".join(train), b"".join(val)


@pytest.mark.parametrize("n", [0, 1, 19, 99, 100, 101, 1999, 12345, 100_003])
def test_default_split_is_bitwise_the_old_one(n: int) -> None:
    blob = bytes((i * 7919) % 256 for i in range(n))
    assert data.split(blob) == old_split(blob)
    assert data.split(blob, 0.05) == old_split(blob)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.1, 0.125, 0.3, 0.5])
def test_val_fraction_holds_out_that_fraction_in_blocks_covering_the_stream(
    fraction: float,
) -> None:
    n = 1_000_003
    blocks = data.split_blocks(n, fraction)
    assert [a for a, _, _ in blocks[1:]] == [b for _, b, _ in blocks[:-1]]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    val = sum(b - a for a, b, is_val in blocks if is_val)
    assert abs(val / n - fraction) < 0.002
    train, held = data.split(b"x" * n, fraction)
    assert len(train) + len(held) == n and len(held) == val


def test_val_fraction_reaches_the_token_cache(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", DOCS * 10)
    a = load(path, tmp_path / "c", tokenizer=CharTokenizer())
    b = load(path, tmp_path / "c", tokenizer=CharTokenizer(), val_fraction=0.2)
    n = len(a.train) + len(a.val)
    assert len(b.train) + len(b.val) == n and a.cache != b.cache
    assert abs(len(b.val) / n - 0.2) < 0.01 and abs(len(a.val) / n - 0.05) < 0.01


# -- the cache -------------------------------------------------------------------------------


def test_cache_hit_does_not_tokenize_and_changes_invalidate_it(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", DOCS, extra_field="other")
    cache = tmp_path / "cache"
    tok = CharTokenizer()
    first = load(path, cache, tokenizer=tok)
    assert tok.calls > 0
    tok.calls = 0
    again = load(path, cache, tokenizer=tok)
    assert tok.calls == 0 and again.cache == first.cache
    assert torch.equal(again.train, first.train) and torch.equal(again.val, first.val)
    sidecar = json.loads(first.cache.with_suffix(".json").read_text())
    assert sidecar["dtype"] == "uint16" and sidecar["count"] == len(first.train) + len(first.val)
    assert sidecar["key"]["field"] == "text" and sidecar["documents"] == len(DOCS)

    def rebuilt(**kw) -> bool:
        tok.calls = 0
        load(path, cache, tokenizer=tok, **kw)
        return tok.calls > 0

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same content, newer mtime
    assert rebuilt()
    assert not rebuilt()
    write_jsonl(path, [d.upper() for d in DOCS], extra_field="other")  # new content
    assert rebuilt()
    assert rebuilt(text_field="extra_field")
    other = CharTokenizer(offset=1)
    load(path, cache, tokenizer=other)
    assert other.calls > 0
    assert len(list(cache.glob("*.bin"))) == 5 and not list(cache.glob("*tmp*"))


def test_tokenizer_fingerprint_tracks_the_serialized_tokenizer(tmp_path: Path, hf_tokenizer):
    import transformers

    hf.train_tokenizer(tmp_path / "other", text=hf.TEXT[::-1])
    other = transformers.AutoTokenizer.from_pretrained(tmp_path / "other")
    fp = tokens.tokenizer_fingerprint
    assert fp(hf_tokenizer) == fp(hf_tokenizer) != fp(other)


def test_memmap_dtype_follows_the_tokenizer_size(tmp_path: Path) -> None:
    assert tokens.token_dtype(300) == tokens.token_dtype(1 << 16) == "uint16"
    assert tokens.token_dtype((1 << 16) + 1) == "uint32"
    path = write_jsonl(tmp_path / "a.jsonl", DOCS)
    big = CharTokenizer(size=70_000, offset=65_000)
    corpus = load(path, tmp_path / "c", tokenizer=big, vocab_size=70_000)
    assert corpus.train.dtype == torch.uint32 and max(stream(corpus)) == 69_999
    assert corpus.cache.stat().st_size == 4 * (len(corpus.train) + len(corpus.val))
    small = load(path, tmp_path / "c", tokenizer=CharTokenizer(), vocab_size=300)
    assert small.train.dtype == torch.uint16
    assert stream(corpus) == [65_000 + i if i != 299 else 69_999 for i in stream(small)]


# -- errors ----------------------------------------------------------------------------------


def test_missing_field_names_the_field_the_file_and_the_flag(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", DOCS, field="body", id=1)
    for builder in (True, False):
        with pytest.raises(ValueError) as e:
            load(path, tmp_path / "c", builder=builder, agree=pytest.fail)
        msg = str(e.value)
        assert all(s in msg for s in ("'text'", str(path), "body, id", "--data-field")), msg
    pq = write_parquet(tmp_path / "p.parquet", DOCS, field="content")
    with pytest.raises(ValueError, match="content, n.*--data-field"):
        load(pq, tmp_path / "c", agree=pytest.fail)


def test_bad_inputs_raise_clearly_before_agreeing(tmp_path: Path, monkeypatch) -> None:
    good = write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(ValueError, match="vocab_size is 100.*tokenizer"):
        load(good, tmp_path / "c", vocab_size=100, agree=pytest.fail)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load(tmp_path / "empty.jsonl", tmp_path / "c", agree=pytest.fail)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.jsonl", tmp_path / "c", agree=pytest.fail)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", DOCS)
    write_parquet(mixed / "b.parquet", DOCS)
    with pytest.raises(ValueError, match="mixes"):
        load(mixed, tmp_path / "c", agree=pytest.fail)
    with pytest.raises(ValueError, match="token id 299 .* vocab_size is 200"):
        load(good, tmp_path / "c", tokenizer=CharTokenizer(), vocab_size=200)
    real = tokens.importlib.util.find_spec
    monkeypatch.setattr(
        tokens.importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n)
    )
    with pytest.raises(ImportError, match=r"wholeshard\[hf\]"):
        load(good, tmp_path / "c", agree=pytest.fail)


def test_core_imports_no_optional_package_at_module_level() -> None:
    tree = ast.parse(Path(tokens.__file__).read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert not top & {"datasets", "transformers", "numpy", "tokenizers", "tqdm", "pyarrow"}


# -- ranks: builder and agree ----------------------------------------------------------------


class Agree:
    """A fake all-reduce: records each rank's vote and answers `result` (or the vote)."""

    def __init__(self, result: bool | None = None) -> None:
        self.votes: list[bool] = []
        self.result = result

    def __call__(self, ok: bool) -> bool:
        self.votes.append(ok)
        return ok if self.result is None else self.result


def test_builder_builds_and_the_others_map_its_cache(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", DOCS)
    tok, cache = CharTokenizer(), tmp_path / "c"
    other = Agree()
    with pytest.raises(RuntimeError, match="missing after the tokenizing rank"):
        load(path, cache, tokenizer=tok, builder=False, agree=other)
    assert other.votes == [True] and tok.calls == 0
    built, follower = Agree(), Agree()
    a = load(path, cache, tokenizer=tok, builder=True, agree=built)
    b = load(path, cache, tokenizer=tok, builder=False, agree=follower)
    assert built.votes == follower.votes == [True]
    assert torch.equal(a.train, b.train) and a.cache == b.cache


def test_a_failing_builder_fails_every_rank_clearly(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [""] * 3)  # passes the cheap checks, no text
    builder = Agree(result=False)
    with pytest.raises(ValueError, match="no text found"):
        load(path, tmp_path / "c", tokenizer=CharTokenizer(), builder=True, agree=builder)
    assert builder.votes == [False]
    follower = Agree(result=False)
    with pytest.raises(RuntimeError, match="tokenizing rank .* failed"):
        load(path, tmp_path / "c", tokenizer=CharTokenizer(), builder=False, agree=follower)
    assert follower.votes == [True]
    good = write_jsonl(tmp_path / "b.jsonl", DOCS)
    lucky = Agree(result=False)  # this builder succeeded, another node's failed
    with pytest.raises(RuntimeError, match="another rank failed"):
        load(good, tmp_path / "c", tokenizer=CharTokenizer(), agree=lucky)
    assert lucky.votes == [True]
    assert not list((tmp_path / "c").glob("*tmp*"))


# -- batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [300, 70_000])
def test_token_batches_are_the_same_global_batch_at_any_world_size(
    tmp_path: Path, size: int
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", DOCS * 4)
    corpus = load(path, tmp_path / "c", tokenizer=CharTokenizer(size), vocab_size=size)
    text = corpus.train
    for step in (0, 5):
        whole = data.train_batch(text, step, 8, 16, seed=3, rank=0, world=1)
        assert whole[0].dtype == torch.long and int(whole[0].max()) < size
        assert torch.equal(whole[0][:, 1:], whole[1][:, :-1])
        for world in (2, 4):
            parts = [data.train_batch(text, step, 8, 16, 3, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    vals = [data.val_batches(corpus.val, 2, 8, 16, rank=r, world=2) for r in range(2)]
    whole_val = data.val_batches(corpus.val, 2, 8, 16, rank=0, world=1)
    for b in range(2):
        assert torch.equal(torch.cat([vals[0][b][0], vals[1][b][0]]), whole_val[b][0])
    with pytest.raises(ValueError, match="tokens, need more"):
        data.train_batch(text[:10], 0, 8, 16, seed=3, rank=0, world=1)


def test_inputs_found_and_checked_cheaply(tmp_path: Path) -> None:
    files, reader, source = tokens.find_inputs(None)
    assert reader is None and files == data.stdlib_files() and "stdlib" in source
    big = tmp_path / "big.jsonl"  # a first record longer than the first read
    write_jsonl(big, ["x" * 300_000, "y"], other=1)
    tokens.check_inputs([big], "json", "text")
    with pytest.raises(ValueError, match="other, text|text, other"):
        tokens.check_inputs([big], "json", "body")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON objects"):
        tokens.check_inputs([tmp_path / "bad.json"], "json", "text")
    (tmp_path / "none.json").write_text("[]")
    with pytest.raises(ValueError, match="no records"):
        tokens.check_inputs([tmp_path / "none.json"], "json", "text")


def test_train_and_val_are_views_of_one_map(tmp_path: Path) -> None:
    corpus = load(
        write_jsonl(tmp_path / "a.jsonl", DOCS), tmp_path / "c", tokenizer=CharTokenizer()
    )
    storage = corpus.train.untyped_storage()
    assert storage.data_ptr() == corpus.val.untyped_storage().data_ptr()
    assert storage.nbytes() == corpus.cache.stat().st_size
    before = corpus.cache.read_bytes()
    corpus.train[0] = 7  # copy-on-write: the file is untouched
    assert corpus.cache.read_bytes() == before


def test_the_fast_path_encodes_as_the_tokenizer_does(hf_tokenizer) -> None:
    encode, eos = tokens._encoder(hf_tokenizer)
    assert encode(DOCS) == hf_tokenizer(DOCS, add_special_tokens=False)["input_ids"]
    assert eos == hf_tokenizer.eos_token_id
