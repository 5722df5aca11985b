"""Corpus for ``zero train``: text files -> byte tokens, a deterministic train/validation split, token files.

Tokens are bytes (0-255) plus specials: BOS 256, EOS 257, PAD 258; vocabulary 259. Each document becomes
``bytes + EOS``. A document goes to validation when the first byte of the sha256 of its name (path or JSONL line
number) is below ``VAL_BYTE`` (about 2%): the split depends only on the corpus, never on the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
from dataclasses import dataclass

import numpy as np

from zero.errors import InputError

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
VAL_BYTE = 6  # sha256(name)[0] < 6 -> validation (6/256 ~ 2.3%)
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".cpp", ".js", ".html", ".csv", ".tex"}


class DataError(InputError, ValueError):
    """The data path is missing, empty, unreadable, or JSONL without the text field (message names it)."""


@dataclass(frozen=True)
class Corpus:
    """Token arrays (uint16) for training and validation and where they came from."""

    train: np.ndarray
    val: np.ndarray
    source: str
    documents: int


def stdlib_dir() -> pathlib.Path:
    """The running Python's standard-library folder (sysconfig 'stdlib')."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _read_bytes(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror or e}") from None


def _documents_from_jsonl(path: pathlib.Path, field: str):
    for i, line in enumerate(_read_bytes(path).decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{str(path)!r} line {i} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or field not in obj:
            keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{str(path)!r} line {i} has no text field {field!r} (has {keys}); use --text-field")
        yield f"{path}:{i}", str(obj[field]).encode("utf-8")


def iter_documents(data: str | os.PathLike | None, text_field: str = "text", stdlib_glob: str = "**/*.py"):
    """Yield ``(name, bytes)`` per document of a text file, a folder of text files (recursive), or JSONL.

    ``None`` means the standard library's own ``.py`` files (site-packages excluded). Raises DataError.
    """
    if data is None:
        root = stdlib_dir()
        files = sorted(p for p in root.glob(stdlib_glob) if "site-packages" not in p.parts and p.is_file())
    else:
        root = pathlib.Path(data)
        if not root.exists():
            raise DataError(f"data path {str(root)!r} does not exist")
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise DataError(f"data folder {str(root)!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
        else:
            files = [root]
    for f in files:
        if f.suffix.lower() == ".jsonl":
            yield from _documents_from_jsonl(f, text_field)
        else:
            yield str(f.relative_to(root) if root.is_dir() else f.name), _read_bytes(f)


def is_validation(name: str) -> bool:
    """The deterministic split rule (see module docstring)."""
    return hashlib.sha256(name.encode()).digest()[0] < VAL_BYTE


def build_corpus(data: str | os.PathLike | None, text_field: str = "text", max_bytes: int | None = None) -> Corpus:
    """Read and tokenize a corpus; ``max_bytes`` caps the bytes read (documents in sorted order).

    Raises: DataError for a missing/empty path, unreadable file, JSONL without the field, or no text at all.
    """
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    total, docs = 0, 0
    eos = np.array([EOS], dtype=np.uint16)
    for name, raw in iter_documents(data, text_field):
        if not raw:
            continue
        parts[is_validation(name)] += [np.frombuffer(raw, dtype=np.uint8).astype(np.uint16), eos]
        total += len(raw)
        docs += 1
        if max_bytes is not None and total >= max_bytes:
            break
    source = str(data) if data is not None else f"Python standard library ({stdlib_dir()})"
    if total == 0:
        raise DataError(f"data {source!r} holds no text")
    train = np.concatenate(parts[False]) if parts[False] else np.zeros(0, np.uint16)
    val = np.concatenate(parts[True]) if parts[True] else np.zeros(0, np.uint16)
    if len(val) < 2048 or len(train) < 2048:  # tiny corpora: hold out the last 10% of the tokens instead
        every = np.concatenate([train, val])
        cut = int(len(every) * 0.9)
        train, val = every[:cut], every[cut:]
    return Corpus(train, val, source, docs)


def save_tokens(corpus: Corpus, folder: pathlib.Path) -> None:
    """Write ``train.bin`` / ``val.bin`` (uint16) atomically (temp file + rename) and ``corpus.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, arr in (("train.bin", corpus.train), ("val.bin", corpus.val)):
        tmp = folder / f".{name}.tmp"
        arr.tofile(tmp)
        os.replace(tmp, folder / name)
    meta = {"source": corpus.source, "documents": corpus.documents, "train_tokens": int(len(corpus.train)),
            "val_tokens": int(len(corpus.val)), "vocab": VOCAB}  # fmt: skip
    (folder / "corpus.json").write_text(json.dumps(meta, indent=1))


def load_tokens(folder: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """Memory-map ``train.bin`` and ``val.bin`` (uint16) written by :func:`save_tokens`."""
    return (np.memmap(folder / "train.bin", dtype=np.uint16, mode="r"),
            np.memmap(folder / "val.bin", dtype=np.uint16, mode="r"))  # fmt: skip


def sample_windows(tokens: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    """``count`` random windows of ``length + 1`` tokens (int64), from a generator seeded by ``seed``."""
    if len(tokens) <= length + 1:
        raise DataError(f"corpus has {len(tokens)} tokens; need more than sequence length + 1 = {length + 1}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length - 1, size=count)
    return np.stack([np.asarray(tokens[s : s + length + 1], dtype=np.int64) for s in starts])
