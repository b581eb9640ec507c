"""A bigram language model and an in-memory input, built only from module/config
primitives, for trainer tests that do not depend on the layer library."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.module import FanAxes, Module, Normal, ParameterSpec, ones


class Bigram(Module):
    class Config(Module.Config):
        vocab_size: int = REQUIRED

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        v = self.config.vocab_size
        return {"table": ParameterSpec((v, v), ("vocab", "embed"),
                                       initializer=Normal.default_config().set(stddev=0.02))}

    def forward(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits = self.parameters["table"][batch["input_ids"]]
        labels = batch["target_labels"]
        weights = batch["target_weights"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        ce = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        loss = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        return loss, {"num_target_tokens": jnp.sum(weights)}


class FactoredBigram(Module):
    """Embedding [vocab, dim] -> scale [dim] (read in f32) -> projection [dim, vocab], the
    matmul weights read cast to the compute dtype (`dtype="bfloat16"`), as the layers do."""

    class Config(Module.Config):
        vocab_size: int = REQUIRED
        dim: int = 8

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        v, d = self.config.vocab_size, self.config.dim
        init = Normal.default_config().set(stddev=0.3)
        return {
            "emb": ParameterSpec((v, d), ("vocab", "embed"), initializer=init,
                                 fan_axes=FanAxes((1,), (0,))),
            "scale": ParameterSpec((d,), ("embed",), initializer=ones()),
            "proj": ParameterSpec((d, v), ("embed", "vocab"), initializer=init,
                                  fan_axes=FanAxes((0,), (1,))),
        }

    def forward(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        p = self.parameters
        x = p["emb"][batch["input_ids"]].astype(self.dtype)
        x = (x.astype(jnp.float32) * p["scale"].astype(jnp.float32)).astype(self.dtype)
        logits = jnp.dot(x, p["proj"].astype(self.dtype), preferred_element_type=jnp.float32)
        weights = batch["target_weights"]
        logp = jax.nn.log_softmax(logits)
        ce = -jnp.take_along_axis(logp, batch["target_labels"][..., None], axis=-1)[..., 0]
        loss = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)
        return loss, {"num_target_tokens": jnp.sum(weights)}


class _Iterator:
    def __init__(self, data: np.ndarray, batch: int, process_index: int, process_count: int):
        self._data, self._batch = data, batch
        self._pi, self._pc = process_index, process_count
        self._pos = 0

    def __next__(self) -> dict[str, np.ndarray]:
        n, seq = self._data.shape
        rows = [(self._pos * self._batch + i) % n for i in range(self._batch)]
        per = self._batch // self._pc
        rows = rows[self._pi * per:(self._pi + 1) * per]
        self._pos += 1
        x = self._data[rows]
        w = np.ones_like(x[:, :-1], dtype=np.float32)
        return {"input_ids": x[:, :-1], "target_labels": x[:, 1:], "target_weights": w}

    def get_state(self) -> bytes:
        return json.dumps({"pos": self._pos}).encode()

    def set_state(self, state: bytes) -> None:
        self._pos = json.loads(state)["pos"]


class ToyInput(Configurable):
    class Config(Configurable.Config):
        vocab_size: int = 16
        seq_len: int = 17
        global_batch_size: int = 8
        num_sequences: int = 64
        seed: int = 0

    def check(self) -> None:
        pass

    def iterator(self, process_index: int = 0, process_count: int = 1) -> _Iterator:
        c = self.config
        rng = np.random.default_rng(c.seed)
        # A deterministic "language": next token = (3 * token + 1) mod vocab, with noise.
        start = rng.integers(0, c.vocab_size, size=(c.num_sequences, 1))
        seqs = [start]
        for _ in range(c.seq_len - 1):
            nxt = (3 * seqs[-1] + 1) % c.vocab_size
            noise = rng.random(nxt.shape) < 0.1
            seqs.append(np.where(noise, rng.integers(0, c.vocab_size, nxt.shape), nxt))
        data = np.concatenate(seqs, axis=1).astype(np.int32)
        return _Iterator(data, c.global_batch_size, process_index, process_count)


def toy_trainer_config(output_dir: str, **kw: Any) -> Any:
    from jaxlearn.runtime.trainer import Trainer

    cfg = Trainer.default_config().set(
        model=Bigram.default_config().set(vocab_size=16),
        input=ToyInput.default_config(),
        output_dir=output_dir,
        max_step=20,
        log_every_n_steps=5,
        save_every_n_steps=10,
    )
    cfg.learner.set(learning_rate=0.1, warmup_steps=0, weight_decay=0.0)
    cfg.summary_writer.set(progress=False)
    return cfg.set(**kw)
