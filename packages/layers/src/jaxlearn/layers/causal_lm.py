"""Causal language model: a Decoder plus the training loss and the decode-state methods.

input_batch keys: `input_ids [batch, seq]`, `target_labels [batch, seq]` (-1 = ignore),
optional `positions`, `segment_ids`, `target_weights` [batch, seq].
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import InstantiableConfig
from jaxlearn.layers.decoder import Decoder
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

    def __init__(self, cfg: "CausalLM.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("decoder", self.config.decoder)

    def forward(self, input_batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        labels = input_batch["target_labels"]
        logits = self.decoder(
            input_batch["input_ids"], input_batch.get("positions"), input_batch.get("segment_ids")
        )
        weights = (labels >= 0).astype(jnp.float32)
        if input_batch.get("target_weights") is not None:
            weights = weights * input_batch["target_weights"].astype(jnp.float32)
        ce, lse, correct = cross_entropy(logits, labels, weights)
        num_tokens = jnp.sum(weights)
        denom = jnp.maximum(num_tokens, 1.0)
        ce_loss = jnp.sum(ce) / denom
        z_loss = self.config.z_loss_weight * jnp.sum(jnp.square(lse) * weights) / denom
        aux = [jnp.sum(v) for _, v in self.get_module_outputs("aux_loss")]
        aux_loss = sum(aux, jnp.zeros((), jnp.float32))
        loss = ce_loss + z_loss + aux_loss
        metrics = {
            "loss": loss,
            "cross_entropy": ce_loss,
            "z_loss": z_loss,
            "aux_loss": aux_loss,
            "accuracy": jnp.sum(correct * weights) / denom,
            "num_tokens": num_tokens,
        }
        return loss, metrics

    def logits(self, input_batch: dict[str, Array]) -> Array:
        """input_batch (input_ids, optional positions/segment_ids) -> [batch, seq, vocab]."""
        return self.decoder(
            input_batch["input_ids"], input_batch.get("positions"), input_batch.get("segment_ids")
        )

    # ---- decoding ---------------------------------------------------------------------------

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
        """{"decoder": per-layer page pools} (`jaxlearn.layers.paged`); a call adds its rows'
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
