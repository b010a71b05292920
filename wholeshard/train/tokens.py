"""Training data as a stream of token ids (or bytes), built once and memory-mapped from a cache.

[Note: tokens]
`load_data` turns `--data` into a `Corpus`. Plain text read as bytes (no tokenizer) is
`data.load_corpus`, in memory. Everything else (record files: `.jsonl`, `.json`,
`.parquet`, read with Hugging Face `datasets` from local files; or any text with a tokenizer) is
one stream: each document's ids (its utf-8 bytes without a tokenizer), documents joined by the
tokenizer's EOS id (by b"\\n" for bytes). A plain text file is one document; empty records
and empty or binary files are skipped.

The stream is cut by `data.split_blocks` and written train blocks first, validation blocks after,
to `tokens-<key>.bin` in the cache directory (uint8 bytes; uint16 ids when the tokenizer has at
most 65536 tokens, else uint32), so `train` and `val` are contiguous views of one memory map and
nothing is read into memory up front. `<key>` is a hash of: the data files' absolute paths,
sizes and mtimes, the record field (of record files), the tokenizer (its serialized state: the
fast tokenizer's JSON, else its saved files; its EOS id and size), the split and `_FORMAT`.
Change any and the key changes: the data is built again; else a restart or a second run reuses
it (the builder's temp files are `*.tmp-*`; a killed build leaves them to delete). The file is
written to a temp name, fsynced and renamed; then `tokens-<key>.json` (the key's fields, token
count, train length, dtype, max id) likewise: the sidecar exists only beside a whole file.

Ranks (`builder`, `agree`): every rank first checks what is cheap (the files exist, are not
empty, the field is present, the extras are installed), so bad input raises on every rank.
Then the builder (the trainer's local rank 0) builds the cache if it is missing, while the
others do nothing, and every rank calls `agree(ok)` exactly once (ok: this rank's step
succeeded); `agree` returns whether every rank was ok (an all-reduce: it is also the barrier
the others wait at). If not, the builder re-raises its own error and the others raise saying
the tokenizing rank failed. Then every rank maps the cache. No path past the cheap checks skips
`agree`, so no rank waits forever on another that raised.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .data import (
    Corpus,
    load_corpus,
    split_blocks,
    split_fraction,
    stdlib_files,
    stdlib_root,
    text_files,
)
from .extras import require
from .sections import DataConfig

RECORD_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Record-file suffixes and the `datasets` builder that reads them."""
_FORMAT = 1  # bump when the cache's layout or contents change
_DOCS_PER_BATCH = 1000  # records encoded per tokenizer call (a fast tokenizer runs it threaded)
_FILES_PER_BATCH = 64  # text files read per tokenizer call
_COPY = 1 << 24  # items per chunk when laying out the split


def token_dtype(tokens: int) -> str:
    """The narrowest unsigned numpy dtype holding ids below `tokens`: uint16 or uint32."""
    return "uint16" if tokens <= 1 << 16 else "uint32"


def find_inputs(path: str | os.PathLike | None) -> tuple[list[Path], str | None, str]:
    """(files, `datasets` builder name or None for text, source): `path` a text file, a record
    file, a directory (its record files if it has any, else all its files) or None (stdlib)."""
    if path is None:
        return stdlib_files(), None, f"python stdlib ({stdlib_root()})"
    files = text_files(path)
    records = [f for f in files if f.suffix.lower() in RECORD_FORMATS]
    if not records:
        return files, None, str(path)
    kinds = {RECORD_FORMATS[f.suffix.lower()] for f in records}
    if len(kinds) > 1:
        raise ValueError(f"{path} mixes .parquet and .json/.jsonl files; keep one format")
    return records, kinds.pop(), str(path)


def _first_record(path: Path, builder: str) -> list[str]:
    """The field names of `path`'s first record (its schema, for parquet), reading only as much
    of the file as that record takes."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    head, size, want = b"", path.stat().st_size, 1 << 16
    with open(path, "rb") as f:
        while True:
            head += f.read(want - len(head))
            text = head.decode("utf-8", "ignore").lstrip().removeprefix("[").lstrip()
            try:
                record, _ = json.JSONDecoder().raw_decode(text)
                break
            except json.JSONDecodeError as e:
                if len(head) < size:
                    want *= 2
                    continue
                if not text or text.startswith("]"):
                    raise ValueError(f"no records in {path}") from None
                raise ValueError(f"{path} is not JSON or JSON lines: {e}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: records must be JSON objects, got {type(record).__name__}")
    return list(record)


def check_inputs(files: list[Path], builder: str | None, field: str) -> None:
    """The cheap checks every rank makes: there are files; for record files, `datasets` is
    installed, and each file is not empty and its first record has `field`."""
    if not files:
        raise ValueError("no data files found")
    if builder is None:
        return
    require("datasets", "hf")
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{f} is empty")
        names = _first_record(f, builder)
        if field not in names:
            raise ValueError(
                f"{f} has no field {field!r} (its fields: {', '.join(names) or 'none'}); "
                "name the text field with --data-field"
            )


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's serialized state, its EOS id and its size."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        with tempfile.TemporaryDirectory() as d:
            tokenizer.save_pretrained(d)
            for f in sorted(Path(d).rglob("*")):
                if f.is_file():
                    h.update(f.relative_to(d).as_posix().encode() + b"\0" + f.read_bytes())
    h.update(f"eos={tokenizer.eos_token_id} len={len(tokenizer)}".encode())
    return h.hexdigest()


def cache_key(
    files: list[Path], builder: str | None, field: str, tokenizer: Any, val_fraction: float
) -> dict:
    """What the cache depends on (see [Note: tokens]), as JSON-able data."""
    stats = [(str(f.resolve()), f.stat()) for f in files]
    return {
        "format": _FORMAT,
        "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats],
        "reader": builder or "text",
        "field": field if builder else None,
        "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        "split": list(split_fraction(val_fraction)),
    }


def cache_paths(cache_dir: str | os.PathLike, key: dict) -> tuple[Path, Path]:
    """(the token file, its JSON sidecar) for `key` under `cache_dir`, named by its hash."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    stem = Path(cache_dir) / f"tokens-{digest}"
    return stem.with_suffix(".bin"), stem.with_suffix(".json")


def _read_sidecar(key: dict, bin_path: Path, meta_path: Path) -> dict | None:
    """The sidecar if it and its token file are whole and match `key`, else None."""
    try:
        meta = json.loads(meta_path.read_text())
        size = bin_path.stat().st_size
    except (OSError, ValueError):
        return None
    import numpy as np

    whole = size == meta.get("count", -1) * np.dtype(meta.get("dtype", "uint8")).itemsize
    return meta if meta.get("key") == key and whole else None


def _documents(
    files: list[Path], builder: str | None, field: str
) -> Iterator[tuple[list[str], int]]:
    """(documents, progress) batches: each text file's text (empty files and files with a NUL
    byte skipped, as `data.read_text_bytes` does), or each record's `field` (empty or null
    ones skipped)."""
    if builder is None:
        for i in range(0, len(files), _FILES_PER_BATCH):
            group = [f.read_bytes() for f in files[i : i + _FILES_PER_BATCH]]
            docs = [b.decode("utf-8", "replace") for b in group if b and b"\0" not in b[:8192]]
            yield docs, len(group)
        return
    import datasets

    ds = datasets.load_dataset(
        builder, data_files=[str(f) for f in files], split="train", streaming=True
    ).select_columns([field])
    for batch in ds.iter(batch_size=_DOCS_PER_BATCH):
        yield [str(t) for t in batch[field] if t], len(batch[field])


def _encoder(tokenizer: Any) -> tuple[Callable[[list[str]], list], int]:
    """(documents -> their id sequences, the separator id: EOS, or b"\\n" for bytes)."""
    import numpy as np

    if tokenizer is None:
        return (lambda docs: [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]), 10

    fast = getattr(getattr(tokenizer, "backend_tokenizer", None), "encode_batch_fast", None)

    def encode(docs: list[str]) -> list:
        if fast is not None:  # the same ids, threaded in Rust, without offsets: ~1.5x faster
            return [e.ids for e in fast(docs, add_special_tokens=False)]
        return tokenizer(docs, add_special_tokens=False)["input_ids"]

    return encode, int(tokenizer.eos_token_id)


def _durable(tmp: Path, final: Path) -> None:
    """fsync `tmp`, rename it to `final`, fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_cache(
    files: list[Path],
    builder: str | None,
    data: DataConfig,
    tokenizer: Any,
    key: dict,
    cache_dir: str | os.PathLike,
    progress: bool = False,
) -> dict:
    """Encode the documents of `files` (read by the `datasets` `builder`, or as text when None;
    `data.text_field` of each record) into the cache, split by `data.val_fraction` (see [Note:
    tokens]); returns the sidecar."""
    import numpy as np

    bin_path, meta_path = cache_paths(cache_dir, key)
    bin_path.parent.mkdir(parents=True, exist_ok=True)
    vocab = 256 if tokenizer is None else len(tokenizer)
    dtype = "uint8" if tokenizer is None else token_dtype(vocab)
    encode, sep = _encoder(tokenizer)
    tag = f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    stream = bin_path.with_name(bin_path.name + tag)  # the stream in document order
    laid = bin_path.with_name(bin_path.name + tag + "-split")  # train blocks, then val blocks
    bar = None
    if progress and importlib.util.find_spec("tqdm") is not None:
        from .outputs import progress_bar

        unit, total = ("doc", None) if builder else ("file", len(files))
        bar = progress_bar(total=total, desc="tokenize", unit=unit, leave=False)
    count = docs = max_id = 0
    separator = np.array([sep], np.int64)
    try:
        with open(stream, "wb") as out:
            for batch, advanced in _documents(files, builder, data.text_field):
                parts = []
                for ids in encode(batch):
                    parts += [separator, np.asarray(ids, np.int64)] if docs else [ids]
                    docs += 1
                flat = np.concatenate(parts).astype(np.int64) if parts else separator[:0]
                if len(flat):
                    max_id = max(max_id, int(flat.max()))
                    if max_id > np.iinfo(dtype).max:
                        raise ValueError(f"token id {max_id} does not fit {dtype} ({vocab=})")
                    flat.astype(dtype).tofile(out)
                count += len(flat)
                if bar is not None:
                    bar.update(advanced)
        if count == 0:
            raise ValueError(f"no text found in {data.path or 'the python stdlib'}")
        n_train = _lay_out(stream, laid, dtype, count, data.val_fraction)
        _durable(laid, bin_path)
        meta = dict(key=key, files=len(files) if builder else docs, documents=docs)
        unit = "bytes" if tokenizer is None else "tokens"
        meta |= dict(unit=unit, dtype=dtype, count=count, train=n_train, max_id=max_id)
        tmp_meta = meta_path.with_name(meta_path.name + tag)
        tmp_meta.write_text(json.dumps(meta, indent=1))
        _durable(tmp_meta, meta_path)
        return meta
    finally:
        if bar is not None:
            bar.close()
        stream.unlink(missing_ok=True)
        laid.unlink(missing_ok=True)


def _lay_out(stream: Path, out_path: Path, dtype: str, count: int, val_fraction: float) -> int:
    """Copy the stream, its train blocks first, then its validation blocks (`split_blocks`);
    returns the train length."""
    import numpy as np

    src = np.memmap(stream, dtype=dtype, mode="r", shape=(count,))
    blocks = split_blocks(count, val_fraction)
    with open(out_path, "wb") as out:
        for want in (False, True):
            for a, b, is_val in blocks:
                for i in range(a, b, _COPY) if is_val == want else ():
                    src[i : min(i + _COPY, b)].tofile(out)
    return sum(b - a for a, b, is_val in blocks if not is_val)


def open_cache(bin_path: Path, meta: dict, source: str) -> Corpus:
    """The cache as a `Corpus` whose `train` and `val` are views of one read-only-on-disk map
    (copy-on-write: writing to them never changes the file)."""
    import numpy as np

    mapped = torch.from_numpy(np.memmap(bin_path, dtype=meta["dtype"], mode="c"))
    train, val = mapped[: meta["train"]], mapped[meta["train"] :]
    return Corpus(train, val, source, meta["files"], meta["unit"], bin_path)


def load_data(
    data: DataConfig,
    *,
    tokenizer: Any = None,
    vocab_size: int = 256,
    cache_dir: str | os.PathLike,
    builder: bool = True,
    agree: Callable[[bool], bool] = lambda ok: ok,
    progress: bool = False,
) -> Corpus:
    """`data.path` as a `Corpus` of bytes or of `tokenizer`'s ids, built by the `builder` rank
    into `cache_dir` once, split by `data.val_fraction` (see [Note: tokens]).

    Raises on every rank for bad input (missing files or field, no tokenizer with
    `vocab_size < 256`, a tokenizer without EOS); past those checks every rank calls
    `agree(ok)` exactly once, and raises if any rank failed.
    """
    if tokenizer is None and vocab_size < 256:
        raise ValueError(
            f"the model's vocab_size is {vocab_size}: reading text as bytes needs a vocab "
            ">= 256, or a tokenizer (--tokenizer DIR, or an hf: model with tokenizer files)"
        )
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError("the tokenizer has no EOS token to join documents with")
    files, reader, source = find_inputs(data.path)
    check_inputs(files, reader, data.text_field)
    if tokenizer is None and reader is None:  # plain text as bytes, in memory
        return _agreed(
            lambda: load_corpus(data.path, val_fraction=data.val_fraction),
            agree,
            "another rank failed to read the data",
        )
    found: dict = {}

    def step() -> None:
        found["key"] = key = cache_key(files, reader, data.text_field, tokenizer, data.val_fraction)
        found["paths"] = paths = cache_paths(cache_dir, key)
        found["meta"] = meta = _read_sidecar(key, *paths)
        if builder and meta is None:
            found["meta"] = build_cache(files, reader, data, tokenizer, key, cache_dir, progress)

    failed = (
        "another rank failed to build the token cache"
        if builder
        else f"the tokenizing rank (local rank 0) failed to build the token cache in {cache_dir}"
        "; its error is in its output"
    )
    _agreed(step, agree, failed)
    bin_path, meta_path = found["paths"]
    meta = found["meta"] or _read_sidecar(found["key"], bin_path, meta_path)
    if meta is None:
        raise RuntimeError(
            f"the token cache {bin_path} is missing after the tokenizing rank built it: "
            "every node's local rank 0 builds its own, so cache_dir must be visible to its node"
        )
    if meta["max_id"] >= vocab_size:
        raise ValueError(
            f"the data has token id {meta['max_id']} but the model's vocab_size is {vocab_size}: "
            "use the model's own tokenizer or a model with a larger vocab"
        )
    return open_cache(bin_path, meta, source)


def _agreed(run: Callable[[], Any], agree: Callable[[bool], bool], failed: str) -> Any:
    """`run()`, then `agree` on whether it succeeded: exactly one call whatever happens."""
    try:
        out = run()
    except BaseException:
        agree(False)
        raise
    if not agree(True):
        raise RuntimeError(failed)
    return out
