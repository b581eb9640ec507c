"""Causal language model: a Decoder plus the training loss and the decode-state methods.

input_batch keys: `input_ids [batch, seq]`, `target_labels [batch, seq]` (-1 = ignore),
optional `positions`, `segment_ids`, `target_weights` [batch, seq].
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.config import InstantiableConfig
from jaxlearn.kernels.chunked_loss import head_cross_entropy
from jaxlearn.layers.decoder import Decoder
from jaxlearn.layers.legacy import older_param_path
from jaxlearn.module import Module

Array = jax.Array


def cross_entropy(logits: Array, labels: Array, weights: Array) -> tuple[Array, Array, Array]:
    """Per-token (cross entropy, logsumexp, correct) for logits [..., vocab] (f32) and
    labels [...] (negative labels are read as 0; weight them out)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.where(labels >= 0, labels, 0)
    label_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    # "The label has the largest logit", without argmax: XLA:CPU runs argmax's
    # (value, index) variadic reduce unvectorised, ~10% of a 60M-Llama train step.
    correct = (label_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
    return (lse - label_logit) * weights, lse, correct


class CausalLM(Module):
    """Next-token model. `forward(input_batch) -> (loss, metrics)`.

    loss = mean weighted cross entropy + z_loss_weight * mean(logsumexp^2) + the sum of
    every `aux_loss` module output recorded below this module (e.g. MoE balance losses).
    Weights: `target_weights` if given (times labels >= 0), else labels >= 0.
    """

    class Config(Module.Config):
        decoder: InstantiableConfig = Decoder.default_config()
        z_loss_weight: float = 0.0
        # Tokens per chunk of the fused LM head + cross entropy (`chunked_loss`): the f32
        # logits of the whole batch are never held. None: the plain loss over full logits.
        loss_chunk_tokens: Optional[int] = None
        # Chunked loss only: each row's weighted tokens first and the chunks of weight-0
        # tokens (prompts, padding) skipped, for an unsharded or batch-sharded sequence.
        loss_compact: bool = False
        # The model family this config is an instance of (`jaxlearn.families.registry`
        # name, e.g. "llama"), recorded by the recipe that built it; None for a model built
        # by hand. Checkpoint export reads it (a config with none is not exported).
        family: Optional[str] = None

    def __init__(self, cfg: "CausalLM.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("decoder", self.config.decoder)

    def forward(self, input_batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        labels = input_batch["target_labels"]
        weights = (labels >= 0).astype(jnp.float32)
        if input_batch.get("target_weights") is not None:
            weights = weights * input_batch["target_weights"].astype(jnp.float32)
        sums = self._loss_sums(input_batch, labels, weights)
        num_tokens = jnp.sum(weights)
        denom = jnp.maximum(num_tokens, 1.0)
        ce_loss = sums["cross_entropy"] / denom
        z_loss = self.config.z_loss_weight * sums["lse_squared"] / denom
        aux = [jnp.sum(v) for _, v in self.get_module_outputs("aux_loss")]
        aux_loss = sum(aux, jnp.zeros((), jnp.float32))
        loss = ce_loss + z_loss + aux_loss
        metrics = {
            "loss": loss,
            "cross_entropy": ce_loss,
            "z_loss": z_loss,
            "aux_loss": aux_loss,
            "accuracy": sums["correct"] / denom,
            "num_tokens": num_tokens,
        }
        return loss, metrics

    def _loss_sums(self, input_batch: dict, labels: Array, weights: Array) -> dict[str, Array]:
        """Weighted sums {"cross_entropy", "lse_squared", "correct"}: chunked through the
        head (`chunked_loss`) when `loss_chunk_tokens` is set and the head is a plain
        matmul, else from the full f32 logits."""
        ids, pos, seg = (input_batch.get(k) for k in ("input_ids", "positions", "segment_ids"))
        head = self.decoder.head_weight() if self.config.loss_chunk_tokens else None
        if head is not None:
            w, dtype, gemm, transposed = head
            sums = head_cross_entropy(
                self.decoder.hidden(ids, pos, seg).astype(dtype),
                w,
                labels,
                weights,
                z_loss_weight=self.config.z_loss_weight,
                soft_cap=self.decoder.config.logits_soft_cap,
                chunk_tokens=self.config.loss_chunk_tokens,
                gemm=gemm,
                transposed=transposed,
                compact=self.config.loss_compact,
            )
            # The differentiable total carries the cross entropy and z-loss gradients.
            extra = sums["total"] - lax.stop_gradient(sums["total"])
            return {**sums, "cross_entropy": sums["cross_entropy"] + extra}
        ce, lse, correct = cross_entropy(self.decoder(ids, pos, seg), labels, weights)
        return {
            "cross_entropy": jnp.sum(ce),
            "lse_squared": jnp.sum(jnp.square(lse) * weights),
            "correct": jnp.sum(correct * weights),
        }

    @staticmethod
    def older_param_path(path: str) -> Optional[str]:
        """Where a checkpoint in the flat projection layout stored the param at `path`
        (`layers.legacy`); restore sites pass it as `restore_subtree(aliases=...)`."""
        return older_param_path(path)

    def logits(self, input_batch: dict[str, Array]) -> Array:
        """input_batch (input_ids, optional positions/segment_ids) -> [batch, seq, vocab]."""
        return self.decoder(
            input_batch["input_ids"], input_batch.get("positions"), input_batch.get("segment_ids")
        )

    def init_states(self, batch_size: int, max_len: int) -> dict[str, Any]:
        """{"time_step": [batch] int32 (next cache slot), "decoder": per-layer KV caches}."""
        return {
            "time_step": jnp.zeros((batch_size,), jnp.int32),
            "decoder": self.decoder.init_states(batch_size, max_len),
        }

    def prefill(
        self, states: dict[str, Any], input_ids: Array, lengths: Optional[Array] = None
    ) -> tuple[dict[str, Any], Array]:
        """Prompt input_ids [batch, seq] (right-padded; `lengths` [batch], default seq) ->
        (states with time_step = lengths, logits [batch, seq, vocab]). The next token of
        row i is predicted by logits[i, lengths[i] - 1]."""
        b, s = input_ids.shape
        cache, logits = self.decoder.prefill(states["decoder"], input_ids)
        t = jnp.full((b,), s, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
        return {"time_step": t, "decoder": cache}, logits

    def init_paged_states(self, num_pages: int, page_size: int) -> dict[str, Any]:
        """{"decoder": per-layer page pools} (`jaxlearn.kernels.paged`); a call adds its rows'
        "time_step" [batch] and "page_table" [batch, pages]."""
        return {"decoder": self.decoder.init_paged_states(num_pages, page_size)}

    def extend_step(
        self, states: dict[str, Any], input_ids: Array, logits_index: Optional[Array] = None
    ) -> tuple[dict[str, Any], Array]:
        """input_ids [batch, steps] (usually steps=1) -> (states, logits [b, steps, vocab]).

        states: {"time_step" [batch], "decoder"} (+ "page_table" [batch, pages] for a paged
        cache; it is passed through). logits_index [batch, k]: logits of those steps only
        ([b, k, vocab])."""
        t = states["time_step"]
        table = states.get("page_table")
        cache, logits = self.decoder.extend_step(
            states["decoder"], input_ids, t, page_table=table, logits_index=logits_index
        )
        out = {"time_step": t + input_ids.shape[1], "decoder": cache}
        if table is not None:
            out["page_table"] = table
        return out, logits
