"""Text classification data: Amazon-review-style JSON Lines or CSV, tokenized into a converted set.

A review is a record with text fields (``summary`` and ``reviewText`` by
default, joined with a space) and a numeric label field (``overall``: Amazon's
1-5 stars; ``--label-offset 1`` makes them classes 0-4). Rows are tokenized to
``max_len`` int32 ids, truncated, padded with 0 (the padding id), and written
as a ``tokens`` converted set (:mod:`.converted`), so training reads them like
any other converted set: mapped, by shard. Two tokenizers:

- ``wordpiece``: a Hugging Face ``tokenizers`` WordPiece model (lower-cased,
  BERT pre-tokenizer, ``[PAD]`` = 0, ``[UNK]`` = 1) trained on the source's
  text in a first pass and saved as ``tokenizer.json`` beside the data, for
  every worker (and any later text) to load. It sees the held-out rows' text
  (not their labels): use ``hash`` where that matters.
- ``hash``: feature hashing (Weinberger et al. 2009) of lower-cased words,
  ``1 + crc32(word) % (vocab_size - 1)``; nothing trained, nothing saved.

:func:`generate_reviews` writes a seeded synthetic file with a stated
vocabulary and label rule, for tests and benchmarks.

The real data: ``python -m dniasync.data convert reviews_Books_5.json.gz
books --text --label-offset 1`` (one JSON object per line, as the UCSD
Amazon review files are).
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import numpy as np

from .readers import DatasetError

if TYPE_CHECKING:
    from .convert import ConvertOptions

__all__ = ["NEGATIVE_WORDS", "POSITIVE_WORDS", "convert_text", "generate_reviews", "hash_tokens", "iter_reviews"]

_WORD: Final = re.compile(r"\w+")
_CHUNK: Final = 2048

#: The generator's label rule: a review's label is how many of its 4 sentiment words are positive (0-4),
#: written as ``overall`` = label + 1 (Amazon's stars).
POSITIVE_WORDS: Final = ("great", "excellent", "love", "perfect", "wonderful", "best", "amazing", "superb")
NEGATIVE_WORDS: Final = ("bad", "poor", "awful", "terrible", "broken", "worst", "boring", "waste")


def generate_reviews(path: str | Path, n: int, *, seed: int = 0, neutral: int = 500) -> Path:
    """``n`` seeded reviews as JSON Lines (``.gz`` if the name says so): ``summary``, ``reviewText``, ``overall``.

    Vocabulary: ``neutral`` filler words ``w0``... plus :data:`POSITIVE_WORDS` and
    :data:`NEGATIVE_WORDS`. Each review has 4 sentiment words, k of them positive
    (k uniform in 0-4), and 8 to 40 filler words; ``overall`` = k + 1.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for _ in range(n):
            k = int(rng.integers(0, 5))
            words = [str(w) for w in rng.choice(POSITIVE_WORDS, k)] + [str(w) for w in rng.choice(NEGATIVE_WORDS, 4 - k)]
            words += [f"w{int(i)}" for i in rng.integers(0, neutral, int(rng.integers(8, 41)))]
            rng.shuffle(words)
            cut = int(rng.integers(1, 4))
            f.write(json.dumps({"summary": " ".join(words[:cut]), "reviewText": " ".join(words[cut:]),
                                "overall": float(k + 1)}) + "\n")
    return path


def iter_reviews(path: Path, fields: Sequence[str], label: str, label_offset: int = 0
                 ) -> Iterator[tuple[int, str, int]]:
    """(row, text, class) of each review in a JSON Lines or CSV file; errors name the file, row and field."""
    lower = path.name.lower()
    opener: Any = gzip.open if lower.endswith(".gz") else open
    is_csv = lower.endswith((".csv", ".csv.gz"))
    try:
        f: IO[str] = opener(path, "rt", encoding="utf-8", newline="" if is_csv else None)
    except OSError as e:
        raise DatasetError(f"cannot open {path}: {e}") from None
    with f:
        records: Iterator[tuple[int, Any]]
        if is_csv:
            records = ((i + 2, doc) for i, doc in enumerate(csv.DictReader(f)))
        else:
            records = ((i + 1, line) for i, line in enumerate(f) if line.strip())
        try:
            for row, doc in records:
                if not is_csv:
                    try:
                        doc = json.loads(doc)
                    except ValueError as e:
                        raise DatasetError(f"{path}: row {row}: not JSON: {e}") from None
                    if not isinstance(doc, dict):
                        raise DatasetError(f"{path}: row {row}: not a JSON object")
                if label not in doc or doc[label] in (None, ""):
                    raise DatasetError(f"{path}: row {row}: no label field {label!r}")
                try:
                    value = float(doc[label])
                except (TypeError, ValueError):
                    raise DatasetError(f"{path}: row {row}, field {label}: {doc[label]!r} is not a number") from None
                if value != round(value) or value - label_offset < 0:
                    raise DatasetError(f"{path}: row {row}, field {label}: {doc[label]!r} minus the label offset "
                                       f"{label_offset} is not a whole number >= 0")
                present = [doc[k] for k in fields if isinstance(doc.get(k), str)]
                if not present:
                    raise DatasetError(f"{path}: row {row}: none of the text fields {list(fields)} holds text")
                yield row, " ".join(present), int(round(value)) - label_offset
        except (UnicodeDecodeError, EOFError, csv.Error, OSError) as e:
            raise DatasetError(f"{path}: {e}") from None


def hash_tokens(texts: Sequence[str], vocab_size: int, max_len: int) -> np.ndarray:
    """Feature hashing: ids ``1 + crc32(word) % (vocab_size - 1)`` of the lower-cased words, padded with 0."""
    out = np.zeros((len(texts), max_len), dtype=np.int32)
    for i, text in enumerate(texts):
        ids = [1 + zlib.crc32(w.encode()) % (vocab_size - 1) for w in _WORD.findall(text.lower())[:max_len]]
        out[i, :len(ids)] = ids
    return out


def _train_wordpiece(texts: Iterator[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"],
                                        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def convert_text(src: Path, dest: Path, opts: ConvertOptions, *, progress: IO[str] | None) -> None:
    """Tokenize the reviews of ``src`` into a ``tokens`` converted set at ``dest`` (see the module docstring)."""
    from .convert import Progress
    from .converted import ConvertedWriter

    t = opts.text or {}
    fields, label = list(t.get("fields") or ["summary", "reviewText"]), str(t.get("label") or "overall")
    offset, kind = int(t.get("label_offset", 0)), str(t.get("tokenizer", "wordpiece"))
    vocab_size, max_len = int(t.get("vocab_size", 8192)), int(t.get("max_len", 128))
    if vocab_size < 2 or max_len < 1:
        raise DatasetError(f"--vocab-size must be >= 2 and --max-len >= 1, got {vocab_size} and {max_len}")
    if not src.is_file():
        raise DatasetError(f"no such file: {src}")
    extra: list[Path] = []
    scratch = tempfile.TemporaryDirectory(prefix="dniasync-tokenizer-")
    tokenizer = None
    counted = [0]

    def texts_of_pass_1() -> Iterator[str]:  # every row is checked here, before anything is written
        for _, text, _ in iter_reviews(src, fields, label, offset):
            counted[0] += 1
            yield text

    if kind == "wordpiece":  # pass 1: the tokenizer learns the vocabulary
        tokenizer = _train_wordpiece(texts_of_pass_1(), vocab_size)
        tokenizer.save(str(Path(scratch.name) / "tokenizer.json"))
        extra.append(Path(scratch.name) / "tokenizer.json")
        vocab_size = tokenizer.get_vocab_size()
    elif kind == "hash":
        for _ in texts_of_pass_1():
            pass
    else:
        raise DatasetError(f"unknown tokenizer {kind!r}; wordpiece or hash")
    writer = ConvertedWriter(dest, dtype="int32", shape=[max_len], kind="tokens", rows_per_file=opts.rows_per_file)
    bar = Progress(f"tokenizing {src.name}", counted[0], progress) if progress is not None else None
    texts: list[str] = []
    labels: list[int] = []

    def flush() -> None:
        if tokenizer is not None:
            ids = np.zeros((len(texts), max_len), dtype=np.int32)
            for i, enc in enumerate(tokenizer.encode_batch(texts)):
                row = enc.ids[:max_len]
                ids[i, :len(row)] = row
        else:
            ids = hash_tokens(texts, vocab_size, max_len)
        writer.write(ids, np.asarray(labels, dtype=np.int64))
        texts.clear()
        labels.clear()

    try:
        for row, text, y in iter_reviews(src, fields, label, offset):
            texts.append(text)
            labels.append(y)
            if len(texts) >= _CHUNK:
                flush()
                if bar is not None:
                    bar.update(writer.rows, writer.rows)
        if texts:
            flush()
        writer.finish(source=str(src), tokenizer="tokenizer.json" if tokenizer is not None else None,
                      vocab_size=vocab_size, extra_files=extra,
                      text={"fields": fields, "label": label, "label_offset": offset, "tokenizer": kind,
                            "max_len": max_len})
    except BaseException:
        writer.abort()
        raise
    finally:
        scratch.cleanup()
        if bar is not None:
            bar.close(writer.rows)
