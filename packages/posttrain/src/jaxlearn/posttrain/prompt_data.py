"""Prompts for RL post-training: JSONL rows rendered with the model's chat template up to
where the assistant's answer starts.

    {"prompt": "What is 7 + 5?", "answer": "12"}
    {"messages": [{"role": "system", ...}, {"role": "user", ...}], "answer": "12"}

The context is `prompt` (one user message) or `messages` (a conversation ending where the
response starts), checked as `preference_data.parse_context` checks a preference row's;
other keys (`answer`, an id, test cases...) are the row's and reach the reward functions
untouched. A prompt is encoded as the template renders it with `add_generation_prompt`
(BOS as `SFTInput` adds it), special tokens typed into content stay text.

`PromptInput` yields, per step, the indices of this process's prompts: `{"prompt_index":
int32 [prompts]}`, prompts = `global_batch_size / num_generations` (the batch counts
completions, `num_generations` per prompt, as TRL's does), with `InputIterator`'s
shuffling, process sharding, epochs and JSON resume state; index -1 is an empty slot
(a finite epoch ran out). The rollout (`rollout.GRPORollout`) turns them into the step's
batch, whose shapes `batch_shapes` gives: the GRPO features on [rows, seq_len], a row per
prompt holding the prompt once and its `num_generations` completions as branches of it
(`shared_prompt`, the default: `grpo.rollout_batch(group=G)`), or a row per completion
with its prompt (`shared_prompt=False`). `seq_len` is a row's length either way. A bad
row raises `DataError` naming `file:line`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import grain
import numpy as np

from jaxlearn.config import ConfigError
from jaxlearn.posttrain.preference_data import json_object, parse_context
from jaxlearn.runtime.data import DataError, Document
from jaxlearn.runtime.input_pipeline import FEATURES, InputIterator, rows_per_process
from jaxlearn.runtime.sft import SFTInput, SFTSource
from jaxlearn.text.chat_encoding import tokenize_chat

__all__ = ["PromptDocument", "PromptInput", "PromptSource", "parse_prompt"]

# The GRPO batch: the token features plus each row's advantage and the old policy's
# log-probability of each target.
ROLLOUT_FEATURES = {**FEATURES, "advantages": np.float32, "old_logprobs": np.float32}


@dataclasses.dataclass(frozen=True)
class PromptDocument(Document):
    """A prompt line: its text and origin, the parsed record and its context messages."""

    record: Any = None
    context: tuple[tuple[str, str], ...] = ()


def parse_prompt(line: str, where: str,
                 roles: Sequence[str]) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """(record, context messages) of one JSONL prompt line at `where`."""
    record = json_object(line, where)
    context = parse_context(record, where, roles)
    if context[-1][0] == "assistant":
        raise DataError(f"{where}: 'messages' ends with an assistant message; a prompt ends "
                        "where the response starts")
    return record, context


class PromptSource(SFTSource):
    """JSONL prompt rows (module doc), one document per non-blank line."""

    def describe(self) -> str:
        paths = self.config.paths
        return f"PromptSource({', '.join([paths] if isinstance(paths, str) else paths)})"

    def _read(self) -> list[Document]:
        return [PromptDocument(line.strip(), where, *parse_prompt(line, where,
                                                                  self.config.roles))
                for _, where, line in self.lines()]


class PromptInput(SFTInput):
    """`SFTInput`'s template and tokenizer over prompts (module doc)."""

    class Config(SFTInput.Config):
        source: Any = PromptSource.default_config()
        num_generations: int = 4  # Completions sampled per prompt (GRPO's group size G).
        # A row per prompt, its completions as branches of it (the prompt computed once);
        # False: a row per completion.
        shared_prompt: bool = True

        def batch_rows(self) -> int:  # Prompts or completions (`input_pipeline.batch_rows`).
            g = self.num_generations
            return self.global_batch_size // g if self.shared_prompt and g > 0 else \
                self.global_batch_size

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        g, batch = self.config.num_generations, self.config.global_batch_size
        if g < 1 or batch % g:
            raise ConfigError(f"PromptInput.num_generations={g} must be >= 1 and divide "
                              f"global_batch_size={batch}")
        self._prompts: Optional[list[np.ndarray]] = None

    @property
    def prompts_per_step(self) -> int:
        return self.config.global_batch_size // self.config.num_generations

    def prompt(self, index: int) -> PromptDocument:
        doc = self.documents()[index]
        assert isinstance(doc, PromptDocument)
        return doc

    def prompt_ids(self) -> list[np.ndarray]:
        """The token ids of every prompt of this split (int32, BOS included), in order."""
        if self._prompts is None:
            cfg, out = self.config, []
            for doc in self.documents():
                assert isinstance(doc, PromptDocument)
                messages = [{"role": r, "content": c} for r, c in doc.context]
                try:
                    enc = tokenize_chat(self.tokenizer, self._template, messages,
                                        add_generation_prompt=True,
                                        parse_special_in_content=cfg.parse_special_in_content)
                except Exception as e:  # ChatTemplateError, or what the template raised.
                    raise DataError(f"{doc.origin}: chat template failed: "
                                    f"{' '.join(str(e).split())}") from None
                ids = np.asarray(enc.ids, np.int32)
                if cfg.add_bos and not (cfg.bos_token and enc.text.startswith(cfg.bos_token)):
                    ids = np.concatenate([[self.tokenizer.bos_id], ids]).astype(np.int32)
                out.append(ids)
            self._prompts = out
        return self._prompts

    def batch_shapes(  # type: ignore[override]  # the rollout's batch, not the prompts
            self, process_count: int = 1) -> dict[str, tuple[tuple[int, ...], Any]]:
        rows = rows_per_process(self.config.batch_rows(), 0, process_count)
        return {name: ((rows, self.config.seq_len), np.dtype(dtype))
                for name, dtype in ROLLOUT_FEATURES.items()}

    def iterator(self, process_index: int = 0,  # type: ignore[override]
                 process_count: int = 1) -> "PromptIterator":
        per = rows_per_process(self.prompts_per_step, process_index, process_count)
        docs, corpus = self._load()
        streams = range(process_index * per, (process_index + 1) * per)
        return PromptIterator(self, docs, corpus, streams)


class PromptIterator(InputIterator):
    """`prompts_per_step` streams of prompt indices (module doc)."""

    def __init__(self, owner: PromptInput, docs: list[Document], corpus: str,
                 streams: Sequence[int]):
        self._slots = owner.prompts_per_step
        super().__init__(owner, docs, corpus, streams)
        self._fingerprint["num_generations"] = owner.config.num_generations
        self._fingerprint["prompts"] = owner.fingerprint()

    def _stream(self, r: int) -> Any:
        ds = self._order[r :: self._slots].map(lambda i: {"prompt_index": np.int32(i)})
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                                         prefetch_buffer_size=0)))

    def _count_batches(self) -> int:
        return max(len(self._order[r :: self._slots]) for r in range(self._slots))

    def _row(self, r: int) -> dict[str, np.ndarray]:
        if not self._done[r]:
            try:
                return dict(next(self._iters[r]))
            except StopIteration:
                self._done[r] = True
        return {"prompt_index": np.full((), -1, np.int32)}

    def _collate(self, rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return {"prompt_index": np.asarray([r["prompt_index"] for r in rows], np.int32)}
