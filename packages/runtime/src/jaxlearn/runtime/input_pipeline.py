"""The training/eval input pipeline on grain: documents -> tokens -> packed batches.

    cfg = Input.default_config().set(seq_len=256, global_batch_size=32)
    data = cfg.instantiate().iterator(process_index=0, process_count=1)
    batch = next(data)             # dict of numpy arrays [per_process_batch, seq_len]
    saved = data.get_state()       # JSON bytes
    data.set_state(saved)          # exact resume

Each document becomes `[bos] + encode(text) + [eos]` (BOS only if `add_bos`), seen as the
pair `inputs = seq[:-1]`, `targets = seq[1:]`, so every input token has its next token as
target, always inside its own document. Pairs are packed by grain's
`ConcatThenSplitIterDataset` into rows of `seq_len`: documents are concatenated and split at
row ends (a long document continues in the stream's next row, with positions restarting at
0 there). A batch has, each `[per_process_batch, seq_len]`:

    input_ids       int32    token ids; `pad_id` at padding
    target_labels   int32    the next token of the same document; -1 at padding
    target_weights  float32  1.0 where target_labels is a real target, else 0.0
    segment_ids     int32    1..k for the k document pieces of a row; 0 at padding
    positions       int32    position inside the document piece (0 at each segment start)

Sharding, determinism, resume. Row `r` of every global batch comes from packing stream `r`
(`r < global_batch_size`); stream `r` packs the documents at positions `r, r + B, r + 2B, ...`
of the split's document order (shuffled per epoch by grain from `seed`, repeated for
`num_epochs`, forever when None). Process `i` of `n` runs only streams
`[i*B/n, (i+1)*B/n)`, so processes share no work, and their batches concatenated along the
batch axis are exactly the batches of one process with the same global batch. The state is
the grain state of each stream plus the batch count, as JSON; `merge_states` combines the
states of all processes into one that any process count can restore (elastic restart).

With `num_epochs` set, the pipeline is finite: every process yields the same number of
batches (the longest stream's row count, computed by tokenizing the split once up front);
rows of streams that ran out are all padding.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Literal, Optional, Sequence

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset

from jaxlearn.config import REQUIRED, ConfigError, Configurable, InstantiableConfig
from jaxlearn.runtime.bundled import BundledSource
from jaxlearn.runtime.data import DataError, Document, Source, split_documents
from jaxlearn.text.tokenizers import ByteTokenizer, Tokenizer

STATE_FORMAT = "jaxlearn.input/1"
FEATURES: dict[str, Any] = {
    "input_ids": np.int32,
    "target_labels": np.int32,
    "target_weights": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}


class Input(Configurable):
    """Tokenised, packed, sharded, resumable batches from a document source."""

    class Config(Configurable.Config):
        source: InstantiableConfig = BundledSource.default_config()
        tokenizer: InstantiableConfig = ByteTokenizer.default_config()
        seq_len: int = REQUIRED
        global_batch_size: int = REQUIRED
        seed: int = 0
        split: Literal["train", "eval"] = "train"
        eval_fraction: float = 0.1
        shuffle: bool = True
        num_epochs: Optional[int] = None
        add_bos: bool = True

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        cfg = self.config
        for name in ("seq_len", "global_batch_size"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"Input.{name} must be >= 1, got {getattr(cfg, name)}")
        if cfg.num_epochs is not None and cfg.num_epochs < 1:
            raise ConfigError(f"Input.num_epochs must be None or >= 1, got {cfg.num_epochs}")
        if not 0.0 <= cfg.eval_fraction <= 1.0:
            raise ConfigError(f"Input.eval_fraction must be in [0, 1], got {cfg.eval_fraction}")
        self._source = cfg.source.instantiate()
        self._tokenizer = cfg.tokenizer.instantiate()
        if not isinstance(self._source, Source):
            raise ConfigError(f"Input.source must build a Source, got {type(self._source)}")
        if not isinstance(self._tokenizer, Tokenizer):
            raise ConfigError(
                f"Input.tokenizer must build a Tokenizer, got {type(self._tokenizer)}"
            )
        self._split: Optional[tuple[list[Document], str]] = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def source(self) -> Source:
        return self._source

    def documents(self) -> list[Document]:
        """The documents of this split, in source order. Reads the source on first use;
        raises DataError for unusable files or an empty split."""
        return list(self._load()[0])

    def _load(self) -> tuple[list[Document], str]:
        if self._split is None:
            cfg = self.config
            docs, digests = split_documents(self.source.documents(), cfg.split, cfg.eval_fraction)
            if not docs:
                raise DataError(
                    f"{self.source.describe()}: the {cfg.split!r} split is empty (none of the "
                    f"documents falls in it with eval_fraction={cfg.eval_fraction})"
                )
            corpus = hashlib.sha256(b"".join(digests)).hexdigest()
            self._split = (docs, corpus)
        return self._split

    def batch_shapes(self, process_count: int = 1) -> dict[str, tuple[tuple[int, int], Any]]:
        """{feature: ((per_process_batch, seq_len), numpy dtype)} of every batch."""
        shape = (rows_per_process(self.config.global_batch_size, 0, process_count),
                 self.config.seq_len)
        return {name: (shape, np.dtype(dtype)) for name, dtype in FEATURES.items()}

    def iterator(self, process_index: int = 0, process_count: int = 1) -> "InputIterator":
        """Batches for process `process_index` of `process_count` (see the module doc).
        Reads and checks every input file first: raises DataError before any batch."""
        per = rows_per_process(self.config.global_batch_size, process_index, process_count)
        docs, corpus = self._load()
        return InputIterator(
            self, docs, corpus, streams=range(process_index * per, (process_index + 1) * per)
        )


def batch_rows(input_cfg: Any) -> Optional[int]:
    """Rows of the global batch an input config yields: its `batch_rows()` where it has one
    (an input whose rows are not its examples: GRPO's prompt rows), else its
    `global_batch_size`; None without either."""
    if hasattr(input_cfg, "batch_rows"):
        return int(input_cfg.batch_rows())
    return getattr(input_cfg, "global_batch_size", None)


def rows_per_process(global_batch: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index {process_index} is not in [0, {process_count})")
    if global_batch % process_count:
        raise ConfigError(
            f"Input.global_batch_size={global_batch} is not divisible by the "
            f"{process_count} processes"
        )
    return global_batch // process_count


class InputIterator:
    """Batches of one process: `next()`, `get_state() -> bytes`, `set_state(bytes)`."""

    def __init__(self, owner: Input, docs: list[Document], corpus: str, streams: Sequence[int]):
        cfg = owner.config
        self._cfg = cfg
        self._docs = docs
        self._tok = owner.tokenizer
        self._streams = list(streams)
        self._fingerprint = {
            "seq_len": cfg.seq_len,
            "global_batch_size": cfg.global_batch_size,
            "seed": cfg.seed,
            "shuffle": cfg.shuffle,
            "num_epochs": cfg.num_epochs,
            "split": cfg.split,
            "eval_fraction": cfg.eval_fraction,
            "add_bos": cfg.add_bos,
            "tokenizer": self._tok.describe(),
            "documents": len(docs),
            "corpus_sha256": corpus,
        }
        self._order = grain.MapDataset.range(len(docs))
        if cfg.shuffle:
            seed = hashlib.sha256(f"jaxlearn.input.shuffle:{cfg.seed}".encode()).digest()
            self._order = self._order.shuffle(seed=int.from_bytes(seed[:4], "big"))
        self._order = self._order.repeat(cfg.num_epochs)
        self._iters = {r: self._stream(r) for r in self._streams}
        self._done = {r: False for r in self._streams}
        self._batches = 0
        self._total = None if cfg.num_epochs is None else self._count_batches()

    # ---- pipeline -------------------------------------------------------------------------

    def _example(self, index: int) -> Optional[dict[str, np.ndarray]]:
        tok = self._tok
        ids = tok.encode_array(self._docs[index].text)
        parts: list[Any] = ([[tok.bos_id]] if self._cfg.add_bos else []) + [ids, [tok.eos_id]]
        seq = np.concatenate(parts).astype(np.int32)
        if len(seq) < 2:  # Nothing to learn from (no tokens and no BOS).
            return None
        return {"inputs": seq[:-1], "targets": seq[1:]}

    def _stream(self, r: int) -> Any:
        ds = self._order[r :: self._cfg.global_batch_size].map(self._example)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        length = {"inputs": self._cfg.seq_len, "targets": self._cfg.seq_len}
        return iter(ConcatThenSplitIterDataset(ds, length_struct=length))

    def _count_batches(self) -> int:
        """Rows of the longest global stream: ceil(tokens / seq_len) (concat-then-split
        leaves only a stream's last row partly filled)."""
        cfg = self._cfg
        lengths = []
        for doc in self._docs:
            n = len(self._tok.encode_array(doc.text)) + int(cfg.add_bos)
            lengths.append(n if n >= 1 else 0)
        tokens = [0] * cfg.global_batch_size
        for position in range(len(self._order)):
            tokens[position % cfg.global_batch_size] += lengths[self._order[position]]
        return max(math.ceil(t / cfg.seq_len) for t in tokens)

    def _row(self, r: int) -> dict[str, np.ndarray]:
        seq_len = self._cfg.seq_len
        if not self._done[r]:
            try:
                packed = next(self._iters[r])
            except StopIteration:
                self._done[r] = True
            else:
                segments = packed["inputs_segment_ids"].astype(np.int32)
                valid = segments > 0
                return {
                    "input_ids": np.where(valid, packed["inputs"], self._tok.pad_id),
                    "target_labels": np.where(valid, packed["targets"], -1),
                    # An example may carry per-target loss weights (fine-tuning masks).
                    "target_weights": np.where(valid, packed.get("weights", 1.0), 0.0),
                    "segment_ids": segments,
                    "positions": np.where(valid, packed["inputs_positions"], 0),
                }
        return {
            "input_ids": np.full(seq_len, self._tok.pad_id),
            "target_labels": np.full(seq_len, -1),
            "target_weights": np.zeros(seq_len, bool),
            "segment_ids": np.zeros(seq_len),
            "positions": np.zeros(seq_len),
        }

    def __iter__(self) -> "InputIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._total is not None and self._batches >= self._total:
            raise StopIteration
        rows = [self._row(r) for r in self._streams]
        if self._total is None and all(self._done.values()):
            raise StopIteration
        self._batches += 1
        return self._collate(rows)

    def _collate(self, rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One batch of the rows of every stream of this process."""
        return {
            name: np.stack([row[name] for row in rows]).astype(dtype)
            for name, dtype in FEATURES.items()
        }

    # ---- state ----------------------------------------------------------------------------

    @property
    def batches_produced(self) -> int:
        return self._batches

    def get_state(self) -> bytes:
        """The position of this iterator as UTF-8 JSON bytes (no pickle)."""
        state = {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint,
            "batches": self._batches,
            "streams": {
                str(r): {"done": self._done[r], "packer": _tag(self._iters[r].get_state())}
                for r in self._streams
            },
        }
        return json.dumps(state, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def set_state(self, state: bytes | str) -> None:
        """Restores a position saved by `get_state` (or combined by `merge_states`): the
        following batches are exactly those that followed the save. Raises DataError if the
        state belongs to another input config, data or tokenizer."""
        parsed = _parse_state(state)
        saved = parsed["fingerprint"]
        if saved != self._fingerprint:
            diffs = [
                f"{k}: saved {saved.get(k)!r}, now {self._fingerprint.get(k)!r}"
                for k in sorted(set(saved) | set(self._fingerprint))
                if saved.get(k) != self._fingerprint.get(k)
            ]
            raise DataError(f"input state is for another input ({'; '.join(diffs)})")
        missing = [r for r in self._streams if str(r) not in parsed["streams"]]
        if missing:
            raise DataError(
                f"input state has no entry for stream(s) {missing}: it was saved by another "
                "process; combine the states of all processes with merge_states()"
            )
        for r in self._streams:
            stream = parsed["streams"][str(r)]
            self._iters[r].set_state(_untag(stream["packer"]))
            self._done[r] = bool(stream["done"])
        self._batches = int(parsed["batches"])


def merge_states(states: Sequence[bytes | str]) -> bytes:
    """One state holding every stream of `states` (the states of all processes, saved at
    the same step), restorable by any process of any process count."""
    if not states:
        raise DataError("merge_states needs at least one state")
    parsed = [_parse_state(s) for s in states]
    first = parsed[0]
    streams: dict[str, Any] = {}
    for p in parsed:
        if p["fingerprint"] != first["fingerprint"] or p["batches"] != first["batches"]:
            raise DataError("merge_states: the states are from different inputs or steps")
        streams.update(p["streams"])
    merged = dict(first, streams=streams)
    return json.dumps(merged, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _parse_state(state: bytes | str) -> dict[str, Any]:
    try:
        parsed = json.loads(state)
    except (ValueError, TypeError) as e:
        raise DataError(f"input state is not valid JSON ({e})") from None
    if not isinstance(parsed, dict) or parsed.get("format") != STATE_FORMAT:
        raise DataError(f"input state is not a {STATE_FORMAT} state")
    return parsed


# grain's packer state holds tuples, which JSON would turn into lists; tag them.
_TUPLE = "__tuple__"


def _tag(x: Any) -> Any:
    if isinstance(x, tuple):
        return {_TUPLE: [_tag(v) for v in x]}
    if isinstance(x, list):
        return [_tag(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _tag(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot save {type(x).__name__} in the input state")


def _untag(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {_TUPLE}:
            return tuple(_untag(v) for v in x[_TUPLE])
        return {k: _untag(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_untag(v) for v in x]
    return x


__all__ = ["FEATURES", "Input", "InputIterator", "batch_rows", "merge_states",
           "rows_per_process"]
