"""`Engine`: the Python API of inference on the training layers.

    engine = Engine.default_config().set(max_seq_len=512, max_batch=8).instantiate(
        model_cfg=model_cfg, params=params, tokenizer=tokenizer)
    to_flat_text(engine.config)                       # every serving setting, one per line
    engine.logits([[1, 5, 7]])                        # [batch, seq, vocab] float32
    out = engine.generate("Once upon", max_new_tokens=32, temperature=0.7, top_p=0.9,
                          seed=1, stop=["\\n\\n"])   # GenerationResult
    for delta in engine.stream("Once upon", max_new_tokens=32):
        print(delta.text, end="")

`model_cfg` is a `CausalLM` config (e.g. `jaxlearn.layers.llama_config(...)`), `params`
its parameter tree (as `initialize_parameters_recursively` returns it, or restored by
`Engine.from_checkpoint`, or converted by `jaxlearn.interop`); `tokenizer` any object of
the `Tokenizer` protocol, a `tokenizers.Tokenizer`, or interop's `LoadedModel` itself
(see `as_tokenizer`), or None for an engine of token ids only (see `Engine`). Everything
runs through the continuous-batching `Scheduler`; `generate` with a list of prompts
batches them.

While `start()`ed (the server does this), one background thread steps the scheduler and
`generate`/`stream` from other threads just enqueue and wait; otherwise they step the
scheduler themselves in the calling thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union, cast

import jax
import numpy as np
from jax.sharding import Mesh

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.decoding.grammar import response_format_grammar
from jaxlearn.decoding.sampling import SamplingParams
from jaxlearn.inference import programs
from jaxlearn.inference.adapters import AdapterBanks
from jaxlearn.inference.engine_setup import (
    SpecFn,
    build_draft,
    build_mesh,
    check_settings,
    engine_axis_rules,
    param_shardings,
    pool_spin_for,
    restore_params,
    serving_model,
)
from jaxlearn.inference.errors import InferenceError, QueueFullError, RequestError
from jaxlearn.inference.metrics import Metrics
from jaxlearn.inference.request import GenerationResult, Request
from jaxlearn.inference.rows_step import rows_invariant
from jaxlearn.inference.runner import ModelRunner, kv_window, next_pow2
from jaxlearn.inference.scheduler import Scheduler
from jaxlearn.kernels import set_pool_spin_us
from jaxlearn.layers.lora import DEFAULT_TARGETS
from jaxlearn.module import Module
from jaxlearn.text.detokenize import Delta
from jaxlearn.text.protocol import as_tokenizer

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
Stop = Union[None, str, int, Sequence[Union[str, int]]]

def split_stop(stop: Stop) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """stop strings / token ids from `stop` (one string or id, or a list mixing both)."""
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, (str, int)) else list(stop)
    strings = tuple(s for s in items if isinstance(s, str))
    ids = tuple(int(s) for s in items if isinstance(s, int) and not isinstance(s, bool))
    if len(strings) + len(ids) != len(items):
        raise RequestError(f"stop={stop!r}: expected strings and/or token ids", param="stop")
    return strings, ids


def _is_prompt_list(prompt: Any) -> bool:
    """A list of prompts (texts or id lists), as opposed to one prompt of ids."""
    return isinstance(prompt, (list, tuple)) and any(
        isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt
    )


def _resolve_add_bos(add_bos: Optional[bool], tokenizer: Any) -> bool:
    if add_bos is not None:
        return add_bos
    if tokenizer is None:
        return False
    attr = getattr(tokenizer, "add_bos", None)
    return bool(attr) if attr is not None else tokenizer.bos_id is not None


class Engine(Configurable):
    """A model, its params, a tokenizer, a paged KV cache and a continuous-batching
    scheduler, configured by `Engine.Config` (every field prints in the flat text form:
    `to_flat_text(engine.config)`).

        engine = Engine.default_config().set(max_seq_len=512, max_batch=8).instantiate(
            model_cfg=llama_config(...), params=params, tokenizer=tok)

    draft_model_cfg / draft_params: a smaller `CausalLM` sharing the tokenizer whose greedy
    guesses speculative decoding verifies (`speculative_tokens`; `inference.draft`).
    model_cfg: a `CausalLM` config; params: its parameter tree; tokenizer: a `Tokenizer`,
    a `tokenizers.Tokenizer` or interop's `LoadedModel` (`as_tokenizer`), or None: then
    the engine serves token ids only (prompts and stops as ids, `text` always "", the
    whole model vocabulary sampled) and refuses text prompts and stop strings with a
    RequestError naming the missing tokenizer.
    """

    class Config(Configurable.Config):
        """Serving settings.

        max_seq_len: prompt + generated tokens per request.
        max_batch: most requests running at once.
        prefill_chunk: prompt tokens per prefill chunk (rounded up to a power of two and
            clipped to max_seq_len).
        decode_burst: most decode steps fused into one jit call when nobody waits.
        mixed_steps: a prompt pending while others decode joins their step (its chunk and
            their next tokens in one forward, `inference.mixed`) instead of a prefill call
            of its own that stalls them (not for a length-dependent RoPE: LongRoPE, NTK).
        speculative_tokens: k > 0 turns on speculative decoding (`decoding.speculative`):
            while at most `speculative_max_rows` requests decode, one call verifies k
            draft tokens per request and emits 1 to k + 1 tokens each, identical to plain
            decoding's (greedy or seeded). The drafts are a draft model's when the engine
            has one (`draft_model_cfg`, `inference.draft`), else prompt lookups: the
            tokens after an earlier occurrence of the last (up to `speculative_ngram`).
            With quantize="int8" only on packed weights (XLA's int8 forward of several
            tokens is not bit-identical to single steps). 0 (default): off.
        max_queue: most requests waiting for a slot (beyond it: QueueFullError / 429).
        page_size: tokens per KV page (power of two <= 64).
        kv_cache_tokens: tokens the KV pool holds, all requests together (None: max_batch
            x max_seq_len, nobody is ever preempted). Smaller pools serve the same
            max_batch as long as the live tokens fit and preempt (recompute) the youngest
            request when they do not; it must hold one max_seq_len request.
        add_bos: prepend BOS to text prompts (None: the tokenizer's `add_bos` attribute if
            it has one, else whether it has a BOS id).
        model_name: the name clients use (`model` in the HTTP API).
        fuse_projections: serve with fused q/k/v and gate/up projections (one matmul each,
            `jaxlearn.layers.fuse_projections`; one device only). None (default): fused
            on one device without adapter banks or unmerged LoRA Linears (True with
            those is an error) when the dense weights are packed
            (`weight_layout`; float or int8): a one-row decode step of SmolLM2-135M bf16
            14.4 ms against 15.6-16.1 unfused (AMX Xeon), 8-32 rows within noise; or when
            they stay float32 on XLA's dot: the 60M Llama's f32 decode 1.11x / 1.02x /
            1.11x at 1 / 4 / 16 rows (Zen 4), ~5% at one row on the Xeon. XLA's own bf16
            GEMV was ~8% slower fused at one row (Xeon): unfused.
        prefix_caching: share the KV pages of prompt prefixes between requests
            (content-hashed full pages, reference counted, LRU-evicted when the pool
            needs pages); a prompt's cached full pages are not prefilled again.
        window_page_release: when every attention layer has a sliding window, return the
            KV pages behind it to the pool while a request runs (`PageTable.trim`).
        quantize: None keeps the weights' dtype; "int8": dense weights and a tied head as
            int8 + f32 per-channel scales (`inference.quantize`; one device only), with
            activations quantized per row; packed for the int8 GEMM where
            `weight_layout` packs (same products; a one-row step 1.5x packed bf16's).
        weight_layout: "auto" packs dense weights on one CPU device (`kernels.packed_gemm`)
            of a host with native bf16 instructions for bf16 ones (1.1-1.9x faster decode
            matmuls than XLA's dot at 8-32 rows), VNNI / AMX-INT8 for int8 ones
            (`quantize`), AVX512F on a non-Intel CPU for f32 ones with f32 compute (1.4-1.7x
            a 60M Llama's f32 decode on Zen 4), else stores 16-bit dense weights
            [out, in] (XLA:CPU's bf16 decode dots read them 1.0-1.5x faster);
            "packed" packs f32 or bf16 weights, "out_in" stores every float dense
            weight [out, in], "in_out" keeps the trained layout
            (`inference.weight_layout`).
        attention_kernel: "auto" attends over the KV pages with one native FFI call per
            layer that reads them in place on one CPU device (2-6x faster decode
            attention than XLA's gather + dots), else XLA; "native" / "xla" force one
            (`kernels.paged_native.choose_kernel`).
        pool_spin_us: how long a helper of the kernels' thread pool lingers for the next
            job (`kernels.set_pool_spin_us`; the process's setting, set by the latest
            engine); None: `engine_setup.POOL_SPIN_US` of the packed dense weights'
            dtype (f32 and bf16 300 us, int8 30 us), else 0. A set JAXLEARN_POOL_SPIN_US wins.
        roll_layers: where the weights will be packed, serve a decoder stack that loops
            over one repeated layer (the fine-tuning recipes' CPU rule trains one) as a
            scan of it, its params stacked (`engine_setup.rolled_layers`): every program
            compiles one layer body, and the scan slices only the packed ids (the rule of
            `weight_layout.serving_stack` for HF / GGUF models). False: the model and
            params as given (the RL sampler swaps the trainer's in).
        parse_special_in_content: whether special-token strings typed into chat messages
            (`<|im_end|>` in a user message) become special tokens in the prompt; off by
            default: they are encoded as text and only the chat template's own are special
            (`jaxlearn.text.chat_encoding`). `jaxlearn serve --engine_set
            parse_special_in_content=True` turns it on.
        max_loras: LoRA adapters servable at once, mixed in one batch (`load_adapter`,
            `SamplingParams.adapter`; `inference.adapters`); 0 (default): none. The
            `lora_targets` projections (the `use_lora` default: attention and dense FFN)
            become `layers.MultiLoraLinear`s with banks of max_loras + 1 slots of rank
            `max_lora_rank` (smaller ranks are zero-padded). Float weights of those
            projections are kept as they are under `quantize` / `weight_layout`.
        mesh_shape: None serves on one device; else the mesh over all devices (one -1
            entry allowed), with `mesh_axis_names`. Params are placed by their logical
            axes through `axis_rules` (None: INFERENCE_AXIS_RULES, the training rules
            with batch and seq replicated); the KV cache is replicated.
        """

        max_seq_len: int = 2048
        max_batch: int = 8
        prefill_chunk: int = 256
        decode_burst: int = 8
        mixed_steps: bool = True
        speculative_tokens: int = 0
        speculative_max_rows: int = 4
        speculative_ngram: int = 3
        max_queue: int = 64
        page_size: int = 16
        kv_cache_tokens: Optional[int] = None
        add_bos: Optional[bool] = None
        model_name: str = "jaxlearn"
        fuse_projections: Optional[bool] = None
        prefix_caching: bool = True
        window_page_release: bool = True
        quantize: Optional[str] = None
        weight_layout: str = "auto"
        pool_spin_us: Optional[int] = None
        attention_kernel: str = "auto"
        roll_layers: bool = True
        parse_special_in_content: bool = False
        max_loras: int = 0
        max_lora_rank: int = 16
        lora_targets: str = DEFAULT_TARGETS
        mesh_shape: Optional[tuple[int, ...]] = None
        mesh_axis_names: tuple[str, ...] = ("data", "fsdp", "model")
        axis_rules: Optional[tuple[tuple[str, Any], ...]] = None

    def __init__(self, cfg: "Engine.Config", *, model_cfg: Any, params: Any,
                 tokenizer: Any = None, draft_model_cfg: Any = None, draft_params: Any = None):
        super().__init__(cfg)
        cfg = self.config
        pool_tokens = check_settings(cfg)
        served = serving_model(cfg, model_cfg, params)
        # The model as given (no adapter banks, fusion, int8 or layout change): what an
        # adapter file is read for (`jaxlearn.interop.load_lora_adapter`).
        self.base_model_cfg = served.base_model_cfg
        # Packed weights' copies are owned by `packed_weights`, kept as long as the engine.
        self.packed_weights = served.packed_weights
        # The spin in force (a set JAXLEARN_POOL_SPIN_US wins).
        self.pool_spin_us = set_pool_spin_us(pool_spin_for(cfg.pool_spin_us,
                                                           served.packed_weights))
        self.attention_kernel = served.attention_kernel
        model_cfg, params = served.model_cfg, served.params
        self.model_cfg = model_cfg
        self.model: Module = model_cfg.instantiate()
        self.tokenizer = as_tokenizer(tokenizer) if tokenizer is not None else None
        self.model_name = cfg.model_name
        self.max_seq_len = cfg.max_seq_len
        self.max_batch = cfg.max_batch
        self.axis_rules = engine_axis_rules(cfg)
        self.mesh = build_mesh(cfg)
        spec_fn = None
        if self.mesh is not None:
            params = jax.device_put(params, self.param_shardings(self.mesh))
            spec_fn = SpecFn(self.axis_rules, self.mesh)
        else:  # Host (numpy) params would be copied to the device on every call.
            params = jax.device_put(params)
        self.vocab_size = int(
            jax.eval_shape(
                lambda p: self.model_logits_fn(p, np.zeros((1, 1), np.int32)), params
            ).shape[-1]
        )
        # Without a tokenizer every id of the model's vocabulary may be sampled.
        tok_vocab = getattr(self.tokenizer, "vocab_size", None) or self.vocab_size
        max_len = -(-cfg.max_seq_len // cfg.page_size) * cfg.page_size
        # (A one-row bf16 decode needs no padding here: `layers.dense` pads m=1 GEMVs.)
        self.runner = ModelRunner(
            self.model,
            params,
            num_slots=cfg.max_batch,
            num_pages=-(-pool_tokens // cfg.page_size) + 1,  # + page 0, which nobody owns.
            page_size=cfg.page_size,
            max_len=max_len,
            vocab_size=self.vocab_size,
            vocab_limit=min(int(tok_vocab), self.vocab_size),
            mesh=self.mesh,
            spec_fn=spec_fn,
        )
        self.adapters = AdapterBanks(self.runner, cfg.max_loras, cfg.max_lora_rank)
        self.metrics = Metrics()
        self.scheduler = Scheduler(
            self.runner,
            self.tokenizer,
            max_batch=cfg.max_batch,
            max_seq_len=cfg.max_seq_len,
            prefill_chunk=min(next_pow2(cfg.prefill_chunk), next_pow2(cfg.max_seq_len)),
            decode_burst=cfg.decode_burst,
            max_queue=cfg.max_queue,
            metrics=self.metrics,
            prefix_caching=cfg.prefix_caching,
            window=kv_window(self.model) if cfg.window_page_release else None,
            speculative_tokens=cfg.speculative_tokens,
            speculative_max_rows=cfg.speculative_max_rows,
            speculative_ngram=cfg.speculative_ngram,
            adapters=self.adapters,
            mixed_steps=cfg.mixed_steps and rows_invariant(self.model),
            draft=None if draft_model_cfg is None else build_draft(
                cfg, draft_model_cfg, draft_params, self.runner,
                min(next_pow2(cfg.prefill_chunk), next_pow2(cfg.max_seq_len))),
        )
        self.add_bos = _resolve_add_bos(cfg.add_bos, self.tokenizer)
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    # ---- construction helpers -------------------------------------------------------------

    def model_logits_fn(self, params: Any, ids: Any) -> Any:
        from jaxlearn.module import functional

        out, _ = functional(
            self.model, None, params, ({"input_ids": ids},), method="logits", is_training=False
        )
        return out

    def param_shardings(self, mesh: Mesh) -> Any:
        """NamedSharding per parameter from its logical axes and `axis_rules`."""
        return param_shardings(self.model, mesh, self.axis_rules)

    @classmethod
    def from_checkpoint(
        cls,
        directory: Union[str, Path],
        model_cfg: Any,
        tokenizer: Any = None,
        *,
        step: Optional[int] = None,
        use_ema: bool = False,
        engine_cfg: Optional["Engine.Config"] = None,
    ) -> "Engine":
        """An engine on the params of a jaxlearn checkpoint (`jaxlearn.checkpoint`).

        directory: a Checkpointer directory (holding `step_*/`) or a training output_dir
        (holding `checkpoints/`). step: default the newest step that verifies. Only the
        params (or, with use_ema, the EMA params) are read, directly into the shardings of
        the engine's mesh (`engine_cfg.mesh_shape`, whatever the training mesh was).
        engine_cfg: default `cls.default_config()`.
        """
        engine_cfg = engine_cfg if engine_cfg is not None else cls.default_config()
        if getattr(model_cfg, "name", None) is REQUIRED:
            model_cfg = model_cfg.clone(name="model")
        mesh = build_mesh(engine_cfg)
        shardings = None
        if mesh is not None:
            rules = engine_axis_rules(engine_cfg)
            shardings = param_shardings(model_cfg.instantiate(), mesh, rules)
        from jaxlearn.checkpoint import locate

        root, found = locate(directory)
        params, _ = restore_params(root, model_cfg, step=found if step is None else step,
                                   use_ema=use_ema, shardings=shardings)
        return cast(Engine, engine_cfg.instantiate(model_cfg=model_cfg, params=params,
                                                   tokenizer=tokenizer))

    def warmup(self, level: str = "auto", threads: int = 0, scoring: bool = True) -> int:
        """Compiles the prefill / decode programs of `level` ("none", "auto", "all":
        `programs.py`; scoring=False: not those of prompt_logprobs requests) before
        serving, on `threads` threads (0: one per CPU), and builds the grammar vocabulary
        when the tokenizer supports structured output. Returns the number of programs
        compiled; later compiles are counted as late."""
        if self.tokenizer is not None:
            try:
                self.scheduler.grammar_vocab()
            except (RequestError, InferenceError):  # No llguidance or no EOS: not served.
                pass
        return programs.warmup(self.scheduler, level, threads, scoring)

    # ---- LoRA adapters (`inference.adapters`) ----------------------------------------------

    def load_adapter(self, name: str, rank: int, alpha: float, params: Any) -> None:
        """Loads a LoRA adapter into a free bank slot (Engine.Config.max_loras) under
        `name`, which requests then select (`adapter=name`). params: the adapter in the
        `LoraLinear` layout (`.../adapter/lora_a [*in, rank]`, `lora_b [rank, *out]`,
        stacked [layers, ...] as the model's params; a whole LoRA model's params do, base
        weights are ignored); scale alpha / rank. The banks keep their shapes: nothing is
        recompiled. ValueError: a taken name, no free slot, rank > max_lora_rank, shapes
        or projections the engine's banks do not have."""
        arrays = self.adapters.arrays(rank, alpha, params)  # Host work outside the lock.
        with self.scheduler.step_lock:
            self.adapters.load(name, rank, alpha, arrays)

    def unload_adapter(self, name: str) -> None:
        """Frees the slot of adapter `name`. Refused (InferenceError) while queued or
        running requests use it; their prefix-cache pages are never served again."""
        sched = self.scheduler
        with sched.step_lock, sched._lock:
            self.adapters.unload(name, [*sched.waiting, *(r for r in sched.slots if r)])

    def adapter_names(self) -> list[str]:
        """The names of the loaded adapters, sorted."""
        return self.adapters.names()

    # ---- prompts ------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Text -> ids (BOS prepended when `add_bos`); ids are returned unchanged."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "this engine has no tokenizer (built with tokenizer=None): send the "
                    "prompt as a list of token ids", param="prompt")
            ids = list(self.tokenizer.encode(prompt))
            bos = self.tokenizer.bos_id
            if self.add_bos and bos is not None and (not ids or ids[0] != bos):
                ids = [int(bos)] + ids
            return [int(t) for t in ids]
        if isinstance(prompt, np.ndarray):
            prompt = prompt.reshape(-1).tolist()
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise RequestError("a prompt is a string or a list of token ids", param="prompt")
        return [int(t) for t in prompt]

    # ---- public API -----------------------------------------------------------------------

    def logits(self, input_ids: Any) -> np.ndarray:
        """Cache-free forward pass: input_ids [batch, seq] (or [seq]) -> logits
        [batch, seq, vocab] float32. The sequence is padded to a power of two (the model
        is causal, so padding never changes earlier positions)."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise RequestError(f"input_ids must be [batch, seq] with seq >= 1, got {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise RequestError(f"input_ids outside [0, {self.vocab_size})")
        b, s = ids.shape
        padded = np.zeros((b, max(8, next_pow2(s))), np.int32)
        padded[:, :s] = ids
        return self.runner.logits(padded)[:, :s]

    def sampling_params(
        self,
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: Optional[int] = None,
        stop: Stop = None,
        ignore_eos: bool = False,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Optional[dict[int, float]] = None,
        logprobs: Optional[int] = None,
        prompt_logprobs: Optional[int] = None,
        response_format: Optional[dict[str, Any]] = None,
        adapter: Optional[str] = None,
    ) -> SamplingParams:
        """A SamplingParams (see there); logit_bias as {token id: bias}; response_format
        as the OpenAI object ({"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}, `decoding.grammar`); adapter: a loaded
        LoRA adapter's name (None: the base model)."""
        strings, ids = split_stop(stop)
        bias = tuple(sorted((logit_bias or {}).items()))
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            stop=strings,
            stop_token_ids=ids,
            ignore_eos=ignore_eos,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=response_format_grammar(response_format),
            adapter=adapter,
        )

    def request(self, prompt: Prompt, params: SamplingParams, **kw: Any) -> Request:
        """A validated (not yet submitted) scheduler request for `prompt`."""
        return self.scheduler.make_request(self.encode(prompt), params, **kw)

    def generate(
        self, prompt: Union[Prompt, Sequence[Prompt]], **sampling: Any
    ) -> Union[GenerationResult, list[GenerationResult]]:
        """Generates for one prompt (-> GenerationResult) or a list of prompts (-> list,
        batched continuously). `sampling`: the arguments of `sampling_params`
        (max_new_tokens (0: only score the prompt), temperature, top_k, top_p,
        repetition_penalty, seed, stop (strings and/or token ids), ignore_eos, presence /
        frequency_penalty, logit_bias, logprobs, prompt_logprobs, response_format); or
        `params=SamplingParams(...)`. With a list and an int seed, prompt i uses seed + i."""
        many = _is_prompt_list(prompt)
        prompts: list[Any] = list(prompt) if many else [prompt]
        params = sampling.pop("params", None) or self.sampling_params(**sampling)
        reqs = []
        for i, p in enumerate(prompts):
            pi = params
            if many and params.seed is not None:
                pi = dataclasses.replace(params, seed=params.seed + i)
            reqs.append(self.request(p, pi))
        pending = list(reqs)
        while pending or not all(r.done for r in reqs):
            while pending:
                try:
                    self.scheduler.submit(pending[0])
                    pending.pop(0)
                except QueueFullError:
                    if self.running:
                        pending[0].done_event.wait(0.01)
                    break
            self._advance(reqs)
        results = [self._result(r) for r in reqs]
        return results if many else results[0]

    def stream(self, prompt: Prompt, **sampling: Any) -> Iterator[Delta]:
        """Yields `Delta`s (new token ids, new visible text, finish_reason on the last) as
        tokens are generated. Closing the iterator early cancels the request."""
        params = sampling.pop("params", None) or self.sampling_params(**sampling)
        box: "queue.Queue[Delta]" = queue.Queue()
        req = self.request(prompt, params, sink=lambda _r, d: box.put(d))
        self.scheduler.submit(req)
        try:
            while True:
                if not self.running and box.empty():
                    self._advance([req])
                try:
                    delta = box.get(timeout=0.05) if self.running else box.get_nowait()
                except queue.Empty:
                    continue
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not req.done:
                self.scheduler.cancel(req)
                if not self.running:
                    self.scheduler.step()

    def _advance(self, reqs: Sequence[Request]) -> None:
        """One step of progress on `reqs`: a scheduler step here, or a short wait while
        the background thread runs."""
        if self.running:
            for r in reqs:
                if not r.done:
                    r.done_event.wait(0.05)
                    return
        else:
            self.scheduler.step()

    @staticmethod
    def _result(req: Request) -> GenerationResult:
        out = req.output
        return GenerationResult(
            request_id=req.request_id,
            prompt_ids=list(req.prompt_ids),
            tokens=list(out.tokens),
            text=out.text,
            finish_reason=out.finish_reason or "error",
            stop_reason=out.stop_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=(list(req.prompt_logprobs)
                             if req.params.prompt_logprobs is not None else None),
        )

    # ---- background loop ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Starts the scheduler thread (idempotent)."""
        if self.running:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="jaxlearn-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the scheduler thread; queued and running requests are cancelled."""
        self._stopping.set()
        self.scheduler.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None
        self.scheduler.fail_all("cancelled")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.scheduler.has_work():
                self.scheduler.wait_for_work(0.1)
                continue
            try:
                self.scheduler.step()
            except Exception:  # A device failure must not kill the server.
                log.exception("engine step failed; failing the running requests")
                self.scheduler.fail_all("error")
                try:
                    self.runner.reset()
                except Exception:  # pragma: no cover - nothing more to do
                    log.exception("could not reset the KV cache")
                    raise InferenceError("engine is unusable after a device failure") from None
