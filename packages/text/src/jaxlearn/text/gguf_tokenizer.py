"""`GGUFTokenizer`: the tokenizer embedded in a GGUF file, as a `Configurable` whose config
is just the file's path, so a run's config text rebuilds it.

    tok = GGUFTokenizer.default_config().set(path="model.gguf").instantiate()
    tok.encode("hi"), tok.bos_id, tok.eos_token_ids, tok.apply_chat_template(messages)

The `tokenizer.ggml.*` metadata is read by the validating header reader
(`jaxlearn.text.gguf_file`: counts, lengths and offsets checked against the file size; no
tensor data is touched) and rebuilt by `jaxlearn.text.gguf_vocab`. BOS, EOS (with the
end-of-turn/message ids), pad and the chat template (`tokenizer.chat_template`, with the
BOS/EOS token texts) come from the same metadata. It is an `HFTokenizer` in every other
respect (encode without specials, decode, `decode_stream`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from jaxlearn.config import Configurable
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.errors import MalformedGGUFError, TokenizerError
from jaxlearn.text.gguf_vocab import tokenizer_from_gguf_metadata
from jaxlearn.text.tokenizers import HFTokenizer


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The key/values of a GGUF file (token arrays included), read by the validating
    header reader (`jaxlearn.text.gguf_file`): a hostile header costs bounded time and
    memory. TokenizerError naming the file when it is missing or not a valid GGUF."""
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: no such file (GGUFTokenizer.path)")
    try:
        from jaxlearn.text.gguf_file import read_header
    except ImportError:
        raise TokenizerError("GGUFTokenizer needs the 'gguf' package (pip install gguf)") from None
    try:
        return dict(read_header(path).metadata)
    except MalformedGGUFError as e:
        raise TokenizerError(str(e)) from None


def special_token_text(meta: dict[str, Any], key: str) -> str:
    """The text of the token whose id is `meta[key]` ("" when absent)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    i = meta.get(key)
    return str(tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else ""


def chat_template_of(meta: dict[str, Any], path: str) -> Optional[ChatTemplate]:
    """The file's `tokenizer.chat_template` (None when it has none)."""
    source = meta.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(
        source,
        bos_token=special_token_text(meta, "tokenizer.ggml.bos_token_id"),
        eos_token=special_token_text(meta, "tokenizer.ggml.eos_token_id"),
        origin=f"{path}: tokenizer.chat_template",
    )


class GGUFTokenizer(HFTokenizer):
    """The tokenizer of the GGUF file `path` (see the module doc). `bos_token`,
    `eos_token`, `pad_token`: None takes the file's special ids; a token text overrides
    that id (EOS: the only end-of-generation id then)."""

    class Config(HFTokenizer.Config):
        pass

    def __init__(self, cfg: Optional[Configurable.Config] = None, **kwargs: Any):
        config: Any = type(self).default_config() if cfg is None else cfg
        path = str(config.path or "")
        if not path:
            raise TokenizerError("GGUFTokenizer.path is empty; set it to a .gguf file")
        meta = read_gguf_metadata(path)
        tok = tokenizer_from_gguf_metadata(meta, source=path)
        vocab = tok.get_vocab(with_added_tokens=True)

        def pick(field: str, key: str) -> Optional[int]:
            name = getattr(config, field)
            if name is None:
                value = meta.get(key)
                return None if value is None else int(value)
            return self._special(vocab, name, (), field, path)

        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        if config.eos_token is not None:
            eos = [pick("eos_token", "")]
        memory = dict(
            tokenizer=tok,
            bos_id=pick("bos_token", "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
            pad_id=pick("pad_token", "tokenizer.ggml.padding_token_id"),
            chat_template=chat_template_of(meta, path),
            source=path,
        )
        super().__init__(config, _memory=memory, **kwargs)


__all__ = ["GGUFTokenizer", "chat_template_of", "read_gguf_metadata", "special_token_text"]
