"""`LoadedModel`: what every loader returns (config, params, tokenizer, chat template)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from jaxlearn.families.arch import Architecture
from jaxlearn.interop.errors import TokenizerError
from jaxlearn.text import errors as text_errors
from jaxlearn.text.chat import ChatTemplate, Message
from jaxlearn.text.tokenizers import HFTokenizer


@dataclasses.dataclass
class LoadedModel:
    """A pretrained causal LM ready for `functional(config.instantiate(), ...)`.

    config: `CausalLM.Config` (instantiate with `.instantiate()` or `model()`).
    params: nested dict of numpy arrays matching `create_parameter_specs_recursively()`
        exactly (paths, shapes, dtypes); `jax.device_put(params, shardings)` places them.
    tokenizer: a `tokenizers.Tokenizer` (None if the checkpoint ships none). Its
        post-processor adds BOS where the model expects it (`encode(text)`).
    chat_template: `ChatTemplate` or None; `render_chat` / `encode_chat` use it.
    eos_token_ids: every id that ends a generation (config, generation config, tokenizer).
    bos_token_id, pad_token_id: ids or None.
    architecture: the format-neutral hyperparameters the config was built from.
    format: "hf" or "gguf"; source: the path loaded; metadata: the raw HF config.json
        dict or GGUF key/values (arrays left out).
    """

    config: Any
    params: dict[str, Any]
    tokenizer: Any = None
    chat_template: Optional[ChatTemplate] = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    architecture: Optional[Architecture] = None
    format: str = ""
    source: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def model(self) -> Any:
        """The instantiated `CausalLM`."""
        return self.config.instantiate()

    def text_tokenizer(self) -> HFTokenizer:
        """The checkpoint's tokenizer as a `jaxlearn.text` tokenizer (what the inference
        engine serves with): its EOS ids, BOS, pad and chat template."""
        try:
            return HFTokenizer.from_tokenizer(
                self._tok(),
                bos_id=self.bos_token_id,
                eos_token_ids=self.eos_token_ids,
                pad_id=self.pad_token_id,
                chat_template=self.chat_template,
                source=self.source or self.format,
            )
        except text_errors.TokenizerError as e:
            raise TokenizerError(str(e)) from None

    def _tok(self) -> Any:
        if self.tokenizer is None:
            raise TokenizerError(f"{self.source}: the checkpoint has no tokenizer")
        return self.tokenizer

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok().encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok().decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: the checkpoint has no chat template")
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, **kw
        )

    def encode_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes its own special tokens, so
        none are added), as HF `apply_chat_template(tokenize=True)` does."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False)
