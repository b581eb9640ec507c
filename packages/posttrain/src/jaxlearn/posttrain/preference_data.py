"""Preference pairs for DPO: JSONL rows rendered with the model's chat template.

    {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}
    {"messages": [{"role": "system", ...}, {"role": "user", ...}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}

The context is `prompt` (one user message) or `messages` (any conversation ending where
the response starts); `chosen` / `rejected` are the response text or a one-message
assistant list (TRL's conversational form). Each side is the conversation + one assistant
message, encoded exactly as `SFTInput` encodes a chat row (`sft_encode.encode_row`: the
template, BOS, truncation), with weights on the final assistant message only (earlier
assistant turns of the context are context).

Layout (`shared_prompt`, on by default): one pair per row of [global_batch, seq_len],
`[prompt | chosen | rejected]`. The prompt (the two sides' common token prefix, up to the
first trained label) is computed once and both responses attend to it as branches of a
shared prefix (`kernels.segments`: segment ids `1 << 16` for the prompt, `+ 1` chosen,
`+ 2` rejected; each branch's positions continue from the prompt's), so each response
computes exactly what it would in a row of its own while the prompt's tokens (most of a
chat pair: system prompt, template) pass through the model once instead of twice. A pair
whose prompt and two responses exceed seq_len loses tokens from the end of its longer
response first. `shared_prompt=False`: [global_batch, 2, seq_len] for every feature (0
chosen, 1 rejected; `segment_ids` 1 on real tokens, padding 0). No packing; streams,
shuffling, process sharding, epochs and the JSON resume state are `InputIterator`'s. A
bad row raises `DataError` naming `file:line`; a pair with no trained token left on either
side after truncation (or with no slot left for a response beside the prompt) is dropped
with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional, Sequence

import grain
import numpy as np

from jaxlearn.kernels import shared_segment
from jaxlearn.runtime.data import DataError, Document
from jaxlearn.runtime.input_pipeline import FEATURES, InputIterator, rows_per_process
from jaxlearn.runtime.sft import SFTInput, SFTSource
from jaxlearn.runtime.sft_encode import encode_row
from jaxlearn.runtime.sft_rows import DEFAULT_ROLES, TRAINED_ROLE, SFTRow

__all__ = ["PreferenceDocument", "PreferenceInput", "PreferenceSource", "parse_pair"]

_log = logging.getLogger(__name__)


def _response(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        if value[0].get("role") != TRAINED_ROLE:
            raise DataError(f"{where}: {key}[0].role must be {TRAINED_ROLE!r}")
        value = value[0].get("content")
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {key!r} must be a non-empty string or one "
                        f"{TRAINED_ROLE!r} message")
    return value


def parse_context(record: dict[str, Any], where: str,
             roles: Sequence[str]) -> tuple[tuple[str, str], ...]:
    if ("prompt" in record) == ("messages" in record):
        raise DataError(f"{where}: a preference row needs exactly one of 'prompt' and "
                        "'messages'")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string")
        return (("user", record["prompt"]),)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: messages[{i}] must be an object with string 'role' "
                            "and 'content'")
        if m["role"] not in roles:
            raise DataError(f"{where}: messages[{i}].role {m['role']!r} is not one of "
                            f"{', '.join(map(repr, roles))}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def json_object(line: str, where: str) -> dict[str, Any]:
    """The JSON object on one JSONL line at `where`; DataError when it is not one."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{where}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def parse_pair(line: str, where: str,
               roles: Sequence[str] = DEFAULT_ROLES) -> tuple[SFTRow, SFTRow]:
    """(chosen, rejected) chat rows of one JSONL preference line at `where`."""
    record = json_object(line, where)
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(f"{where}: a preference row needs 'chosen' and 'rejected' (no "
                            f"{key!r})")
    context = parse_context(record, where, roles)
    return tuple(SFTRow("messages", where, messages=context + ((TRAINED_ROLE,
                                                                 _response(record, k, where)),))
                 for k in ("chosen", "rejected"))  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class PreferenceDocument(Document):
    """A preference line: its text and origin plus the parsed (chosen, rejected) rows."""

    pair: Optional[tuple[SFTRow, SFTRow]] = None


class PreferenceSource(SFTSource):
    """JSONL preference rows (module doc), one document per non-blank line."""

    def describe(self) -> str:
        paths = self.config.paths
        return f"PreferenceSource({', '.join([paths] if isinstance(paths, str) else paths)})"

    def _read(self) -> list[Document]:
        return [PreferenceDocument(line.strip(), where,
                                   parse_pair(line, where, self.config.roles))
                for _, where, line in self.lines()]


def _last_span(weights: np.ndarray) -> np.ndarray:
    """`weights` with only its last run of trained tokens kept (the final response)."""
    on = np.flatnonzero(weights > 0)
    if not len(on):
        return weights
    gaps = np.flatnonzero(np.diff(on) > 1)
    start = on[gaps[-1] + 1] if len(gaps) else on[0]
    out = np.zeros_like(weights)
    out[start:] = weights[start:]
    return out


def shared_length(ids_c: np.ndarray, w_c: np.ndarray, ids_r: np.ndarray,
                  w_r: np.ndarray) -> int:
    """k: the input slots a pair's two sides share. Tokens 0..k are the same on both sides
    and none of 1..k is trained, so slots 0..k-1 (inputs ids[:k], labels ids[1:k+1]) are
    one prompt; each branch keeps at least one slot."""
    most = min(len(ids_c), len(ids_r)) - 1
    same = np.flatnonzero(ids_c[:most + 1] != ids_r[:most + 1])
    common = int(same[0]) if len(same) else most + 1  # tokens 0..common-1 are equal
    trained = np.flatnonzero((w_c[1:most + 1] > 0) | (w_r[1:most + 1] > 0))
    first = int(trained[0]) + 1 if len(trained) else most + 1
    return max(0, min(common - 1, first - 1, most - 1))


def fit_shared(ids_c: np.ndarray, w_c: np.ndarray, ids_r: np.ndarray, w_r: np.ndarray, *,
               seq_len: int) -> Optional[tuple[np.ndarray, ...]]:
    """The pair cut so that its shared row fits `seq_len` slots: the longer response loses
    tokens from its end first (module doc); None when the prompt leaves no slot for one
    of the responses."""
    k = shared_length(ids_c, w_c, ids_r, w_r)
    if k + 2 > seq_len:
        return None
    n = [len(ids_c) - 1, len(ids_r) - 1]  # input slots, each >= k + 1
    excess = n[0] + n[1] - k - seq_len
    while excess > 0:
        i = 0 if n[0] >= n[1] else 1
        cut = min(excess, n[i] - (k + 1))
        n[i] -= cut
        excess -= cut
    return ids_c[:n[0] + 1], w_c[:n[0] + 1], ids_r[:n[1] + 1], w_r[:n[1] + 1]


def shared_row(ids_c: np.ndarray, w_c: np.ndarray, ids_r: np.ndarray, w_r: np.ndarray, *,
               seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row [prompt | chosen | rejected] of a pair cut by `fit_shared` (module doc)."""
    k = shared_length(ids_c, w_c, ids_r, w_r)
    out = {"input_ids": np.full(seq_len, pad_id), "target_labels": np.full(seq_len, -1),
           "target_weights": np.zeros(seq_len), "segment_ids": np.zeros(seq_len),
           "positions": np.zeros(seq_len)}
    out["input_ids"][:k], out["target_labels"][:k] = ids_c[:k], ids_c[1:k + 1]
    out["segment_ids"][:k], out["positions"][:k] = shared_segment(1, 0), np.arange(k)
    at = k
    for member, (ids, w) in enumerate(((ids_c, w_c), (ids_r, w_r)), start=1):
        m = len(ids) - 1 - k  # this branch's slots
        out["input_ids"][at:at + m] = ids[k:k + m]
        out["target_labels"][at:at + m] = ids[k + 1:k + m + 1]
        out["target_weights"][at:at + m] = w[k + 1:k + m + 1]
        out["segment_ids"][at:at + m] = shared_segment(1, member)
        out["positions"][at:at + m] = np.arange(k, k + m)
        at += m
    return out


class PreferenceInput(SFTInput):
    """`SFTInput`'s template, tokenizer and truncation over preference pairs (module doc)."""

    class Config(SFTInput.Config):
        source: Any = PreferenceSource.default_config()
        # One row [prompt | chosen | rejected] per pair, the prompt computed once (module
        # doc); False: [batch, 2, seq_len], each response in a row of its own.
        shared_prompt: bool = True

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self._encoded: Optional[tuple[list[Document], list[tuple[Any, ...]]]] = None

    def _pairs(self) -> tuple[list[Document], list[tuple[Any, ...]]]:
        """(documents kept, (chosen ids, weights, rejected ids, weights) per document)."""
        if self._encoded is not None:
            return self._encoded
        docs, pairs, dropped = [], [], 0
        for doc in self.documents():
            pair = getattr(doc, "pair", None) or parse_pair(doc.text, doc.origin)
            sides = [encode_row(row, self._template, self.tokenizer, self._settings())
                     for row in pair]
            weights = [_last_span(s.weights) for s in sides]
            pair_arrays = tuple(x for s, w in zip(sides, weights) for x in (s.ids, w))
            if self.config.shared_prompt:
                pair_arrays = fit_shared(*pair_arrays, seq_len=self.config.seq_len) or ()
            if not pair_arrays or not all(w[1:].any() for w in pair_arrays[1::2]):
                dropped += 1
                continue
            docs.append(doc)
            pairs.append(pair_arrays)
        if dropped:
            _log.warning("%s: %d pairs had no trained token left on a side (seq_len=%d) "
                         "and were dropped", self.source.describe(), dropped,
                         self.config.seq_len)
        if not pairs:
            raise DataError(f"{self.source.describe()}: no pair of the {self.config.split!r} "
                            f"split has a trained token left on both sides")
        self._encoded = (docs, pairs)
        return docs, pairs

    def batch_shapes(  # type: ignore[override]  # a pair per row: [rows, (2,) seq]
            self, process_count: int = 1) -> dict[str, tuple[tuple[int, ...], Any]]:
        rows = rows_per_process(self.config.global_batch_size, 0, process_count)
        shape = ((rows, self.config.seq_len) if self.config.shared_prompt
                 else (rows, 2, self.config.seq_len))
        return {name: (shape, np.dtype(dtype)) for name, dtype in FEATURES.items()}

    def iterator(self, process_index: int = 0,  # type: ignore[override]
                 process_count: int = 1) -> "PreferenceIterator":
        per = rows_per_process(self.config.global_batch_size, process_index, process_count)
        _, corpus = self._load()
        docs, pairs = self._pairs()
        streams = range(process_index * per, (process_index + 1) * per)
        return PreferenceIterator(self, docs, corpus, streams, pairs)


class PreferenceIterator(InputIterator):
    """One (chosen, rejected) pair per row, padded to seq_len; no packing."""

    def __init__(self, owner: PreferenceInput, docs: list[Document], corpus: str,
                 streams: Sequence[int], pairs: list[tuple[Any, ...]]):
        self._pairs = pairs
        super().__init__(owner, docs, corpus, streams)
        self._fingerprint["preference"] = owner.fingerprint()

    def _side(self, ids: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
        s = self._cfg.seq_len
        n = min(len(ids) - 1, s)
        out = {"input_ids": np.full(s, self._tok.pad_id), "target_labels": np.full(s, -1),
               "target_weights": np.zeros(s), "segment_ids": np.zeros(s),
               "positions": np.zeros(s)}
        out["input_ids"][:n], out["target_labels"][:n] = ids[:n], ids[1:n + 1]
        out["target_weights"][:n], out["segment_ids"][:n] = weights[1:n + 1], 1
        out["positions"][:n] = np.arange(n)
        return out

    def _example(self, index: int) -> dict[str, np.ndarray]:
        ids_c, w_c, ids_r, w_r = self._pairs[index]
        if self._cfg.shared_prompt:
            return shared_row(ids_c, w_c, ids_r, w_r, seq_len=self._cfg.seq_len,
                              pad_id=self._tok.pad_id or 0)
        sides = (self._side(ids_c, w_c), self._side(ids_r, w_r))
        return {k: np.stack([sides[0][k], sides[1][k]]) for k in sides[0]}

    def _stream(self, r: int) -> Any:
        ds = self._order[r :: self._cfg.global_batch_size].map(self._example)
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                                         prefetch_buffer_size=0)))

    def _count_batches(self) -> int:
        return max(len(self._order[r :: self._cfg.global_batch_size])
                   for r in range(self._cfg.global_batch_size))

    def _row(self, r: int) -> dict[str, np.ndarray]:
        if not self._done[r]:
            try:
                return dict(next(self._iters[r]))
            except StopIteration:
                self._done[r] = True
        empty = self._side(np.zeros(1, np.int32), np.zeros(1))
        if self._cfg.shared_prompt:
            return empty
        return {k: np.stack([v, v]) for k, v in empty.items()}
