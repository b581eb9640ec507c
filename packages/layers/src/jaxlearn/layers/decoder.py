"""Decoder: token embedding -> transformer stack -> final norm -> LM head (tied or not)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, InstantiableConfig
from jaxlearn.kernels import PackedTable
from jaxlearn.layers.dense import Linear, SgemmDot, maybe_dot
from jaxlearn.layers.embedding import Embedding
from jaxlearn.layers.norm import RMSNorm
from jaxlearn.layers.transformer import ScanStack
from jaxlearn.module import Module

Array = jax.Array


class Decoder(Module):
    """input_ids [batch, seq] -> logits [batch, seq, vocab] (f32).

    Children: emb, transformer, output_norm, lm_head (absent when `lm_head` is None: the
    embedding is tied as the output head via `Embedding.attend`).
    """

    class Config(Module.Config):
        vocab_size: int = REQUIRED
        dim: int = REQUIRED
        # Any config with `num_embeddings`, `dim`, `forward(ids)` and `attend(x)`.
        emb: InstantiableConfig = Embedding.default_config()
        transformer: InstantiableConfig = ScanStack.default_config()
        output_norm: InstantiableConfig = RMSNorm.default_config()
        # Any config with `input_dim`, `output_dim`; None: tie the head to the embedding.
        lm_head: Optional[InstantiableConfig] = Linear.default_config().set(
            weight_axes=("embed", "vocab")
        )
        # Final-logit soft cap c: logits = c * tanh(logits / c) (Gemma 2); None: off.
        logits_soft_cap: Optional[float] = None

    def __init__(self, cfg: "Decoder.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        self._add_child("emb", c.emb.clone(num_embeddings=c.vocab_size, dim=c.dim))
        self._add_child("transformer", c.transformer.clone(input_dim=c.dim))
        self._add_child("output_norm", c.output_norm.clone(input_dim=c.dim))
        if c.lm_head is not None:
            self._add_child("lm_head", c.lm_head.clone(input_dim=c.dim, output_dim=c.vocab_size))

    def _logits(self, x: Array) -> Array:
        x = self.output_norm(x)
        if self.config.lm_head is None:
            logits = self.emb.attend(x, out_dtype=jnp.float32)
        else:
            logits = self.lm_head(x, out_dtype=jnp.float32)
        cap = self.config.logits_soft_cap
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def forward(
        self,
        input_ids: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> Array:
        """input_ids / positions / segment_ids [batch, seq] -> logits [batch, seq, vocab]."""
        x = self.emb(input_ids)
        x = self.transformer(x, positions, segment_ids)
        return self._logits(x)

    def hidden(
        self,
        input_ids: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> Array:
        """input_ids [batch, seq] -> normed final hidden states [batch, seq, dim], the LM
        head's input."""
        x = self.transformer(self.emb(input_ids), positions, segment_ids)
        return self.output_norm(x)

    def head_weight(self) -> Optional[tuple[Array, Any, Optional[Callable[..., Array]], bool]]:
        """(weight, compute dtype, the 2-D GEMM its dot runs on or None for XLA's, whether
        the weight is [vocab, dim] (the tied table) rather than [dim, vocab]) when the head
        is a plain matmul (a bias-free `Linear` or the tied `Embedding`, default dot or
        `SgemmDot`); else None (e.g. LoRA, int8, packed)."""
        name = "emb" if self.config.lm_head is None else "lm_head"
        head = getattr(self, name)
        if type(head) not in (Linear, Embedding):
            return None
        dot = maybe_dot(head.config.dot)
        if not (dot is None or isinstance(dot, SgemmDot)):
            return None
        p = self.parameters[name]  # A child's params, read from this module's subtree.
        if set(p) != {"weight"} or isinstance(p["weight"], PackedTable):
            return None
        gemm = None if dot is None else dot.gemm(head.dtype)
        return p["weight"], head.dtype, gemm, name == "emb"

    def init_states(self, batch_size: int, max_len: int) -> Any:
        """Empty per-layer KV caches for `batch_size` sequences of up to `max_len` tokens."""
        return self.transformer.init_states(batch_size, max_len)

    def init_paged_states(self, num_pages: int, page_size: int) -> Any:
        """Empty per-layer page pools (see `jaxlearn.kernels.paged`)."""
        return self.transformer.init_paged_states(num_pages, page_size)

    def prefill(
        self,
        cache: Any,
        input_ids: Array,
        positions: Optional[Array] = None,
        segment_ids: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        """Prompt [batch, seq] -> (cache with slots [0, seq) filled, logits [b, seq, vocab])."""
        x = self.emb(input_ids)
        cache, x = self.transformer.prefill(cache, x, positions, segment_ids)
        return cache, self._logits(x)

    def extend_step(
        self,
        cache: Any,
        input_ids: Array,
        time_step: Array,
        positions: Optional[Array] = None,
        page_table: Optional[Array] = None,
        logits_index: Optional[Array] = None,
    ) -> tuple[Any, Array]:
        """input_ids [batch, steps] written at slot `time_step` [batch] ->
        (cache, logits [batch, steps, vocab]).

        page_table [batch, pages]: `cache` is a paged pool (`init_paged_states`; see
        `jaxlearn.kernels.paged`).
        logits_index [batch, k]: only the logits of those steps, [batch, k, vocab] (e.g. the
        last prompt token of a prefill chunk: the LM head is a large share of a chunk)."""
        x = self.emb(input_ids)
        cache, x = self.transformer.extend_step(cache, x, time_step, positions, page_table)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[..., None].astype(jnp.int32), axis=1)
        return cache, self._logits(x)
