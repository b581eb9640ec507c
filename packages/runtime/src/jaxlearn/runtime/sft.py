"""Supervised fine-tuning data: chat, prompt/completion and text rows from JSONL files,
tokenised with loss masks and packed into fixed-length rows.

    cfg = SFTInput.default_config().set(
        source=SFTSource.default_config().set(paths=["chat.jsonl"]),
        seq_len=512, global_batch_size=8, eval_fraction=0.0)
    data = cfg.instantiate().iterator()   # the same iterator API and JSON state as Input
    batch = next(data)                    # input_ids, target_labels, target_weights, ...

Row kinds, detected by their keys (other keys, e.g. an "id", are ignored; every row of a
file must be of one kind):

    {"messages": [{"role": ..., "content": ...}, ...]}   loss on the assistant turns
    {"prompt": ..., "completion": ...}                    loss on the completion and EOS
    {"text": ...}                                         loss on every token and EOS

A conversation is rendered with `SFTInput.chat_template` (HF Jinja source; `CHATML_TEMPLATE`
by default, for models trained with the byte tokenizer) and its special tokens
`bos_token`/`eos_token` (text; the `--init_from` loader fills them from a pretrained model).
The text of assistant message k is found by rendering the conversation prefix by prefix:
it is what `render(messages[:k+1])` adds to `render(messages[:k], add_generation_prompt=
True)`, less trailing whitespace, so it holds the content and the end-of-turn token
(`<|im_end|>` for ChatML) but not the newline after it. A template whose renderings are not
prefixes of each other is refused. Those prefix renders stop at the first assistant
message that starts after the kept tokens, so a long conversation costs renders in
proportion to what fits in `seq_len`, not to its length. The rendered text is encoded once
(`jaxlearn.text.chat_encoding.tokenize_chat`); a character boundary maps to the tokens
that end before it, from that encoding's offsets (`Tokenizer.encode_offsets`; a token
straddling a boundary belongs to the part after it). A tokenizer without offsets maps it by
the longest common prefix of `encode(text)` and `encode(text[:boundary])`.

Special tokens typed into a row stay text: `<|im_end|>` inside a message's content (or a
prompt, completion or text row) is encoded as the characters it is made of, while the
template's own `<|im_end|>` is the special token (see `jaxlearn.text.chat_encoding`).
`SFTInput.parse_special_in_content=True` parses them in content too, for data that writes
control tokens on purpose.

Token sequences: messages `[bos] + encode(rendered)` (no BOS id when `add_bos` is off or the
rendered text already starts with `bos_token`); prompt/completion and text
`[bos] + encode(...) + [eos]`. Each sequence of n tokens gives one example of n - 1 inputs
and targets (`target_weights[i]` is the weight of token i + 1). Examples are packed whole by
grain's `FirstFitPackIterDataset` into rows of `seq_len` with per-example segment ids and
positions (0 at each example's start), so examples never attend across each other and are
never split across rows. Streams, shuffling, sharding across processes, finite epochs and
the exact JSON resume state are those of `input_pipeline.InputIterator`.

Every row is parsed, rendered and tokenised when the first iterator is built, before any
batch. A bad row raises `DataError` naming `file:line`: a line over
`SFTSource.max_row_chars` characters (8 Mi by default), not JSON (or nested too deeply, or
a number of over 4300 digits), not an object, no known kind or several kinds, a value of the
wrong type, text holding a lone surrogate, an empty text or message list, an unknown role,
no assistant message, a template that fails, or an example longer than `seq_len` while
`truncate` is off.

With `truncate` on, long examples keep their first `seq_len` targets, and a row is cut
before it is tokenised: to `CHARS_PER_TOKEN` (8) characters per token of `seq_len + 1`
plus a margin (a conversation keeps the messages whose content fits, the last one cut).
The kept tokens are those the whole row would give: tokens that end near the cut (within
32 characters, or after the last word start before that) are not used, and a cut that gave
too few tokens is redone twice as long. So a 50 MB row costs about its own size, not the
size of its tokens. `SFTInput.truncated_rows` counts the cut rows. A row left without any
trained token (a prompt longer than `seq_len` leaves no room for its completion) is
dropped: `SFTInput.dropped_rows` counts them, the one log line about truncation reports
both, and a split where no row is left raises DataError.

The source file is read and parsed once per process, and each split tokenised once: the
train and eval inputs of a run (and every evaluation's fresh eval input) share them
through a small process-wide cache keyed by the files (path, size, modification time) and
every setting that decides the tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
from typing import Any, Iterator, Optional, Sequence

import grain
import numpy as np
from grain.experimental import FirstFitPackIterDataset

from jaxlearn.config import REQUIRED, ConfigError, InstantiableConfig, to_flat_text
from jaxlearn.runtime.data import DataError, Document, InlineSource, Source
from jaxlearn.runtime.input_pipeline import Input, InputIterator, rows_per_process
from jaxlearn.runtime.row_files import identity as row_identity
from jaxlearn.runtime.row_files import row_files, row_lines
from jaxlearn.runtime.sft_encode import (
    Example,
    Rendered,
    RowSettings,
    encode_row,
    render_row,
    tokenize,
)
from jaxlearn.runtime.sft_rows import DEFAULT_ROLES, TRAINED_ROLE, SFTRow, parse_row
from jaxlearn.text.chat import ChatTemplate

_log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUNDLED_PREFIX = "bundled:"
CHAT_EXAMPLE = BUNDLED_PREFIX + "chat_example.jsonl"
# Preference pairs on the same facts (a correct and a wrong answer), for DPO examples.
PREFERENCE_EXAMPLE = BUNDLED_PREFIX + "preference_example.jsonl"
# Arithmetic questions with numeric answers, for RL (GRPO) examples with `numeric_match`.
ARITHMETIC_PROMPTS = BUNDLED_PREFIX + "arithmetic_prompts.jsonl"
_HERE = os.path.dirname(os.path.abspath(__file__))


def resolve_path(path: str) -> str:
    """`path` itself, or for `bundled:NAME` the file NAME shipped with this package."""
    if path.startswith(BUNDLED_PREFIX):
        return os.path.join(_HERE, path[len(BUNDLED_PREFIX) :])
    return path


class _Shared:
    """The last few files read and splits tokenised, shared by the inputs of one process
    (least recently used dropped first)."""

    def __init__(self, size: int):
        self._items: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_SHARED = _Shared(8)


def _file_identity(path: Optional[str]) -> Any:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (path, st.st_size, st.st_mtime_ns, st.st_ino)


@dataclasses.dataclass(frozen=True)
class SFTDocument(Document):
    """A document of `SFTSource`: its line's text and origin plus the parsed row."""

    row: Optional[SFTRow] = None


class SFTSource(Source):
    """JSONL rows for fine-tuning, one document per non-blank line (text: the line, origin:
    `file:line`). Every row is checked when the documents are first read (see the module
    doc); a file mixing row kinds is refused at its first row of another kind.

    max_row_chars: the longest line read (8 Mi characters by default); a longer one is a
    DataError naming it, before it is parsed.
    """

    class Config(Source.Config):
        paths: Sequence[str] = REQUIRED
        roles: Sequence[str] = DEFAULT_ROLES
        max_row_chars: int = 1 << 23

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        if TRAINED_ROLE not in self.config.roles:
            raise ConfigError(
                f"SFTSource.roles {list(self.config.roles)} must include {TRAINED_ROLE!r}"
            )
        if self.config.max_row_chars < 1:
            raise ConfigError(
                f"SFTSource.max_row_chars must be >= 1, got {self.config.max_row_chars}"
            )

    def describe(self) -> str:
        paths = self.config.paths
        return f"SFTSource({', '.join([paths] if isinstance(paths, str) else paths)})"

    def identity(self) -> Any:
        """What decides the documents: the config and each file's path, size, mtime."""
        files = tuple(row_identity(f) for f in row_files(self.paths(), type(self).__name__))
        return (to_flat_text(self.config), files)

    def _load(self) -> list[Document]:
        key = ("rows", self.identity())
        shared = _SHARED.get(key)
        if shared is None:
            shared = self._read()
            _SHARED.put(key, shared)
        return list(shared)

    def lines(self) -> Iterator[tuple[str, str, str]]:
        """(path, `path:row`, JSON text) of every row of the files (`row_files.row_lines`:
        JSONL lines, Parquet records, saved datasets), in order; a row over
        `max_row_chars` is a DataError naming it, before it is parsed."""
        yield from row_lines(self.paths(), self.config.max_row_chars, type(self).__name__)

    def paths(self) -> list[str]:
        """`paths` with `bundled:` names resolved."""
        paths = self.config.paths
        return [resolve_path(p) for p in ([paths] if isinstance(paths, str) else paths)]

    def _read(self) -> list[Document]:
        docs: list[Document] = []
        first: dict[str, SFTRow] = {}
        for path, where, line in self.lines():
            row = parse_row(line, where, self.config.roles)
            kind = first.setdefault(path, row)
            if row.kind != kind.kind:
                raise DataError(
                    f"{where}: a {row.kind!r} row in a file of {kind.kind!r} rows "
                    f"(from {kind.origin}); put each kind in its own file"
                )
            docs.append(SFTDocument(line.strip(), where, row))
        return docs


@dataclasses.dataclass(frozen=True)
class _Split:
    """The tokenised rows of one split: the documents kept and their examples."""

    docs: list[Document]
    examples: list[tuple[np.ndarray, np.ndarray]]
    rows: int
    truncated: int
    dropped: int


class SFTInput(Input):
    """`Input` for fine-tuning rows (see the module doc): the chat template and its special
    tokens, truncation, special tokens in content and the packer's bin count on top of
    `Input`'s fields.

    parse_special_in_content: whether special-token strings typed into the rows' text
    (`<|im_end|>` in a message) become special tokens; off by default (they stay text).
    """

    class Config(Input.Config):
        source: InstantiableConfig = SFTSource.default_config()
        chat_template: str = CHATML_TEMPLATE
        bos_token: str = ""
        eos_token: str = ""
        truncate: bool = False
        parse_special_in_content: bool = False
        num_packing_bins: int = 4

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        cfg = self.config
        if not cfg.chat_template.strip():
            raise ConfigError("SFTInput.chat_template is empty; give a chat template source")
        if cfg.num_packing_bins < 1:
            raise ConfigError(
                f"SFTInput.num_packing_bins must be >= 1, got {cfg.num_packing_bins}"
            )
        self._template = ChatTemplate(
            cfg.chat_template, bos_token=cfg.bos_token, eos_token=cfg.eos_token
        )
        self._tokenised: Optional[_Split] = None

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def truncated_rows(self) -> int:
        """How many rows of this split were cut to `seq_len` (0 until the rows are read)."""
        return 0 if self._tokenised is None else self._tokenised.truncated

    @property
    def dropped_rows(self) -> int:
        """How many rows of this split were dropped for having no trained token left."""
        return 0 if self._tokenised is None else self._tokenised.dropped

    def examples(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32 [n], weights float32 [n]) per kept document of this split, in document
        order, before the input/target shift. Raises DataError naming `file:line`."""
        return list(self._split_examples().examples)

    def _settings(self) -> RowSettings:
        cfg = self.config
        return RowSettings(seq_len=cfg.seq_len, truncate=cfg.truncate, add_bos=cfg.add_bos,
                           bos_token=cfg.bos_token,
                           parse_special_in_content=cfg.parse_special_in_content)

    def _shared_key(self) -> Any:
        """What decides this split's examples; None when the source cannot say."""
        source, cfg = self.source, self.config
        if isinstance(source, SFTSource):
            data = source.identity()
        elif isinstance(source, InlineSource):
            data = to_flat_text(source.config)
        else:
            return None
        tokenizer = (to_flat_text(cfg.tokenizer),
                     _file_identity(getattr(cfg.tokenizer, "path", None)))
        return ("examples", data, tokenizer, self._settings(), cfg.chat_template, cfg.eos_token,
                cfg.split, cfg.eval_fraction)

    def _split_examples(self) -> _Split:
        if self._tokenised is None:
            key = self._shared_key()
            split = None if key is None else _SHARED.get(key)
            if split is None:
                split = self._tokenise()
                if key is not None:
                    _SHARED.put(key, split)
            self._tokenised = split
        return self._tokenised

    def _tokenise(self) -> _Split:
        cfg = self.config
        docs, examples, truncated = [], [], 0
        all_docs = self.documents()
        for doc in all_docs:
            example = self._example(doc)
            truncated += example.truncated
            if example.weights[1:].any():
                docs.append(doc)
                examples.append((example.ids, example.weights))
        split = _Split(docs, examples, len(all_docs), truncated, len(all_docs) - len(docs))
        if split.truncated or split.dropped:
            _log.warning(
                "%s: %d of %d rows are longer than seq_len=%d and were truncated; %d rows "
                "had no trained token left and were dropped",
                self.source.describe(), split.truncated, split.rows, cfg.seq_len, split.dropped,
            )
        if not docs:
            raise DataError(
                f"{self.source.describe()}: none of the {split.rows} rows of the "
                f"{cfg.split!r} split has a trained token left (seq_len={cfg.seq_len}, "
                f"truncate={cfg.truncate}); raise seq_len or shorten the prompts"
            )
        return split

    def _example(self, doc: Document) -> Example:
        row = getattr(doc, "row", None)
        if row is None:
            roles = getattr(self.source.config, "roles", DEFAULT_ROLES)
            row = parse_row(doc.text, doc.origin, roles)
        return encode_row(row, self._template, self.tokenizer, self._settings())

    def fingerprint(self) -> dict[str, Any]:
        """What, besides `Input`'s fields and the rows, decides the examples."""
        cfg = self.config
        template = hashlib.sha256(cfg.chat_template.encode("utf-8")).hexdigest()
        out = {
            "chat_template_sha256": template,
            "bos_token": cfg.bos_token,
            "eos_token": cfg.eos_token,
            "truncate": cfg.truncate,
            "num_packing_bins": cfg.num_packing_bins,
        }
        if cfg.parse_special_in_content:  # Only when set: older states restore unchanged.
            out["parse_special_in_content"] = True
        return out

    def iterator(self, process_index: int = 0, process_count: int = 1) -> "SFTIterator":
        """Batches for process `process_index` of `process_count`; reads, checks and
        tokenises every row first (DataError before any batch)."""
        per = rows_per_process(self.config.global_batch_size, process_index, process_count)
        _, corpus = self._load()
        split = self._split_examples()
        streams = range(process_index * per, (process_index + 1) * per)
        return SFTIterator(self, split.docs, corpus, streams, list(split.examples))


class SFTIterator(InputIterator):
    """`InputIterator` over tokenised rows with loss weights, packed first-fit."""

    def __init__(
        self,
        owner: SFTInput,
        docs: list[Document],
        corpus: str,
        streams: Sequence[int],
        examples: list[tuple[np.ndarray, np.ndarray]],
    ):
        self._examples = examples
        self._bins = owner.config.num_packing_bins
        super().__init__(owner, docs, corpus, streams)
        self._fingerprint["sft"] = owner.fingerprint()

    def _example(self, index: int) -> dict[str, np.ndarray]:
        ids, weights = self._examples[index]
        return {"inputs": ids[:-1], "targets": ids[1:], "weights": weights[1:]}

    def _stream(self, r: int) -> Any:
        ds = self._order[r :: self._cfg.global_batch_size].map(self._example)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        length = {name: self._cfg.seq_len for name in ("inputs", "targets", "weights")}
        packed = FirstFitPackIterDataset(
            ds, length_struct=length, num_packing_bins=self._bins, shuffle_bins=False
        )
        return iter(packed)

    def _count_batches(self) -> int:
        """Rows of the longest global stream, found by packing every stream once."""
        return max(
            sum(1 for _ in self._stream(r)) for r in range(self._cfg.global_batch_size)
        )


__all__ = [
    "BUNDLED_PREFIX",
    "CHATML_TEMPLATE",
    "CHAT_EXAMPLE",
    "PREFERENCE_EXAMPLE",
    "ARITHMETIC_PROMPTS",
    "Rendered",
    "SFTDocument",
    "SFTInput",
    "SFTIterator",
    "SFTSource",
    "render_row",
    "resolve_path",
    "tokenize",
]
