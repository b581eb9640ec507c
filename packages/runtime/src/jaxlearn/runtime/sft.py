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
prefixes of each other is refused. The rendered text is encoded once as a whole; a
character boundary maps to the tokens of the longest common prefix of `encode(text)` and
`encode(text[:boundary])` (a token straddling a boundary belongs to the part after it).

Token sequences: messages `[bos] + encode(rendered)` (no BOS id when `add_bos` is off or the
rendered text already starts with `bos_token`); prompt/completion and text
`[bos] + encode(...) + [eos]`. Each sequence of n tokens gives one example of n - 1 inputs
and targets (`target_weights[i]` is the weight of token i + 1). Examples are packed whole by
grain's `FirstFitPackIterDataset` into rows of `seq_len` with per-example segment ids and
positions (0 at each example's start), so examples never attend across each other and are
never split across rows. Streams, shuffling, sharding across processes, finite epochs and
the exact JSON resume state are those of `input_pipeline.InputIterator`.

Every row is parsed, rendered and tokenised when the first iterator is built, before any
batch. A bad row raises `DataError` naming `file:line`: not JSON, not an object, no known
kind or several kinds, a value of the wrong type, an empty text or message list, an unknown
role, no assistant message, a template that fails, or an example longer than `seq_len`
while `truncate` is off. With `truncate` on, long examples keep their first `seq_len`
targets; `SFTInput.truncated_rows` counts them and the count is logged once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any, Optional, Sequence

import grain
import numpy as np
from grain.experimental import FirstFitPackIterDataset

from jaxlearn.config import REQUIRED, ConfigError, InstantiableConfig
from jaxlearn.runtime.data import DataError, Document, Source, read_text
from jaxlearn.runtime.input_pipeline import Input, InputIterator, _per_process
from jaxlearn.runtime.sft_rows import DEFAULT_ROLES, TRAINED_ROLE, SFTRow, parse_row
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.tokenizers import Tokenizer

_log = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUNDLED_PREFIX = "bundled:"
CHAT_EXAMPLE = BUNDLED_PREFIX + "chat_example.jsonl"
_HERE = os.path.dirname(os.path.abspath(__file__))


def resolve_path(path: str) -> str:
    """`path` itself, or for `bundled:NAME` the file NAME shipped with this package."""
    if path.startswith(BUNDLED_PREFIX):
        return os.path.join(_HERE, path[len(BUNDLED_PREFIX) :])
    return path


def jsonl_files(paths: Sequence[str]) -> list[str]:
    """Files as given (`bundled:` names resolved), plus the `.jsonl` files under each
    directory, recursively and sorted. Raises DataError for no paths or a directory
    without `.jsonl` files."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise DataError("SFTSource.paths is empty; give at least one .jsonl file or directory")
    files: list[str] = []
    for path in map(resolve_path, paths):
        if os.path.isdir(path):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(path)
                for name in names
                if name.endswith(".jsonl")
            )
            if not found:
                raise DataError(f"{path}: directory has no .jsonl files")
            files.extend(found)
        else:
            files.append(path)
    return files


class SFTSource(Source):
    """JSONL rows for fine-tuning, one document per non-blank line (text: the line, origin:
    `file:line`). Every row is checked when the documents are first read (see the module
    doc); a file mixing row kinds is refused at its first row of another kind."""

    class Config(Source.Config):
        paths: Sequence[str] = REQUIRED
        roles: Sequence[str] = DEFAULT_ROLES

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        if TRAINED_ROLE not in self.config.roles:
            raise ConfigError(
                f"SFTSource.roles {list(self.config.roles)} must include {TRAINED_ROLE!r}"
            )

    def describe(self) -> str:
        paths = self.config.paths
        return f"SFTSource({', '.join([paths] if isinstance(paths, str) else paths)})"

    def _load(self) -> list[Document]:
        docs: list[Document] = []
        for path in jsonl_files(self.config.paths):
            first: Optional[SFTRow] = None
            for number, line in enumerate(read_text(path).splitlines(), 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                row = parse_row(line, where, self.config.roles)
                if first is None:
                    first = row
                elif row.kind != first.kind:
                    raise DataError(
                        f"{where}: a {row.kind!r} row in a file of {first.kind!r} rows "
                        f"(from {first.origin}); put each kind in its own file"
                    )
                docs.append(Document(line.strip(), where))
        return docs


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A row as text: `spans` are the [start, end) character ranges that carry loss;
    `add_eos` whether an EOS id follows the text, `train_eos` whether it carries loss."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_eos: bool
    train_eos: bool


def render_row(row: SFTRow, template: ChatTemplate) -> Rendered:
    """The text of `row` and its trained character spans (see the module doc)."""
    if row.kind == "text":
        return Rendered(row.text, ((0, len(row.text)),), add_eos=True, train_eos=True)
    if row.kind == "prompt_completion":
        text = row.prompt + row.completion
        return Rendered(text, ((len(row.prompt), len(text)),), add_eos=True, train_eos=True)
    messages = row.message_dicts()
    full = _render(template, messages, False, row.origin)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != TRAINED_ROLE:
            continue
        head = _render(template, messages[:k], True, row.origin)
        turn = _render(template, messages[: k + 1], False, row.origin)
        if not (turn.startswith(head) and full.startswith(turn)):
            raise DataError(
                f"{row.origin}: the chat template does not render messages[{k}] as an "
                "extension of the conversation before it, so the assistant tokens cannot "
                "be located"
            )
        spans.append((len(head), max(len(head), len(turn.rstrip()))))
    return Rendered(full, tuple(spans), add_eos=False, train_eos=False)


def _render(template: ChatTemplate, messages: list[Any], gen: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=gen)
    except Exception as e:  # A template runs arbitrary logic (TypeError, ZeroDivisionError...).
        detail = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"{where}: chat template failed: {detail}") from None


def _token_index(tok: Tokenizer, text: str, ids: np.ndarray, boundary: int) -> int:
    """The number of leading tokens of `ids` (= encode(text)) that lie before the character
    `boundary`: the longest common prefix of `ids` and `encode(text[:boundary])`."""
    if boundary <= 0:
        return 0
    if boundary >= len(text):
        return len(ids)
    head = tok.encode_array(text[:boundary])
    n = min(len(head), len(ids))
    same = head[:n] == ids[:n]
    return n if bool(same.all()) else int(np.argmin(same))


def tokenize(
    rendered: Rendered, tok: Tokenizer, *, add_bos: bool, bos_token: str
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], weights float32 [n]) of one row; weights[i] is 1.0 where token i is
    trained (as a target of token i - 1)."""
    ids = tok.encode_array(rendered.text)
    weights = np.zeros(len(ids), np.float32)
    for start, end in rendered.spans:
        a = _token_index(tok, rendered.text, ids, start)
        b = _token_index(tok, rendered.text, ids, end)
        weights[a:b] = 1.0
    if add_bos and not (bos_token and rendered.text.startswith(bos_token)):
        ids = np.concatenate([[tok.bos_id], ids])
        weights = np.concatenate([[0.0], weights])
    if rendered.add_eos:
        ids = np.concatenate([ids, [tok.eos_id]])
        weights = np.concatenate([weights, [float(rendered.train_eos)]])
    return ids.astype(np.int32), weights.astype(np.float32)


class SFTInput(Input):
    """`Input` for fine-tuning rows (see the module doc): the chat template and its special
    tokens, truncation and the packer's bin count on top of `Input`'s fields."""

    class Config(Input.Config):
        source: InstantiableConfig = SFTSource.default_config()
        chat_template: str = CHATML_TEMPLATE
        bos_token: str = ""
        eos_token: str = ""
        truncate: bool = False
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
        self._examples: Optional[list[tuple[np.ndarray, np.ndarray]]] = None
        self._truncated = 0

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def truncated_rows(self) -> int:
        """How many rows of this split were cut to `seq_len` (0 until the rows are read)."""
        return self._truncated

    def examples(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32 [n], weights float32 [n]) per document of this split, in document
        order, before the input/target shift. Raises DataError naming `file:line`."""
        if self._examples is None:
            self._examples = [self._example(doc) for doc in self.documents()]
            if self._truncated:
                _log.warning(
                    "%s: %d of %d rows are longer than seq_len=%d and were truncated",
                    self.source.describe(),
                    self._truncated,
                    len(self._examples),
                    self.config.seq_len,
                )
        return list(self._examples)

    def _example(self, doc: Document) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        roles = getattr(self.source.config, "roles", DEFAULT_ROLES)
        row = parse_row(doc.text, doc.origin, roles)
        ids, weights = tokenize(
            render_row(row, self._template),
            self.tokenizer,
            add_bos=cfg.add_bos,
            bos_token=cfg.bos_token,
        )
        if len(ids) < 2:
            raise DataError(f"{doc.origin}: the row encodes to {len(ids)} token(s); need >= 2")
        if len(ids) - 1 > cfg.seq_len:
            if not cfg.truncate:
                raise DataError(
                    f"{doc.origin}: {len(ids)} tokens, too long for seq_len={cfg.seq_len} "
                    f"(at most {cfg.seq_len + 1}); shorten the row, raise seq_len, or set "
                    "SFTInput.truncate=True"
                )
            self._truncated += 1
            ids, weights = ids[: cfg.seq_len + 1], weights[: cfg.seq_len + 1]
        return ids, weights

    def fingerprint(self) -> dict[str, Any]:
        """What, besides `Input`'s fields and the rows, decides the examples."""
        cfg = self.config
        template = hashlib.sha256(cfg.chat_template.encode("utf-8")).hexdigest()
        return {
            "chat_template_sha256": template,
            "bos_token": cfg.bos_token,
            "eos_token": cfg.eos_token,
            "truncate": cfg.truncate,
            "num_packing_bins": cfg.num_packing_bins,
        }

    def iterator(self, process_index: int = 0, process_count: int = 1) -> "SFTIterator":
        """Batches for process `process_index` of `process_count`; reads, checks and
        tokenises every row first (DataError before any batch)."""
        per = _per_process(self.config.global_batch_size, process_index, process_count)
        docs, corpus = self._load()
        streams = range(process_index * per, (process_index + 1) * per)
        return SFTIterator(self, docs, corpus, streams, self.examples())


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
    "Rendered",
    "SFTInput",
    "SFTIterator",
    "SFTSource",
    "jsonl_files",
    "render_row",
    "resolve_path",
    "tokenize",
]
