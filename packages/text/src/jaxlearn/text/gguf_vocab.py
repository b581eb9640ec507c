"""The tokenizer embedded in a GGUF (llama.cpp) file, rebuilt as a `tokenizers.Tokenizer`
from the file's plain metadata mapping (`tokenizer.ggml.*` keys; no GGUF reader needed).

    tok = tokenizer_from_gguf_metadata(metadata, source="model.gguf")

`tokenizer.ggml.model`:
- `gpt2`: byte-level BPE from tokens + merges, with the pre-tokenizer regex chosen by
  `tokenizer.ggml.pre` (default/gpt2, smollm, llama-bpe/llama3, qwen2);
- `llama`: SentencePiece-style BPE rebuilt from tokens + scores, with byte fallback and
  the `\u2581` space marker (`tokenizer.ggml.add_space_prefix`).

Control (type 3) and user-defined (type 4) tokens become added tokens; BOS is prepended by
the post-processor when `tokenizer.ggml.add_bos_token` is true. A special-token id
(`bos/eos/eot/eom/padding/unknown_token_id`) outside the token list raises TokenizerError
naming the source and the key.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.tokenizers import check_special_ids

# Pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` values (as in the models' HF
# tokenizer.json files).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's token types (`tokenizer.ggml.token_type`).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER, _TOKEN_UNUSED, _TOKEN_BYTE = range(1, 7)
SPECIAL_ID_KEYS = tuple(
    f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "eom", "padding", "unknown")
)


def bpe_pre_tokenizer(pre: Optional[str], source: str = "GGUF metadata") -> Any:
    """The pre-tokenizer of a `gpt2` vocabulary for a `tokenizer.ggml.pre` value."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is None:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.pre={pre!r} is not supported (default, gpt2, smollm, "
            f"llama-bpe, qwen2)"
        )
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, byte_level])


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece-BPE vocab (as HF's SentencePieceExtractor): every split
    of a piece into two vocab pieces, ordered by the piece's score (highest first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(m[3], m[4]) for m in merges]


def _gpt2_model(meta: Mapping[str, Any], vocab: dict[str, int], source: str) -> Any:
    """A byte-level BPE tokenizer (model, pre-tokenizer, decoder) and its base post-processor."""
    from tokenizers import Tokenizer, decoders, models, processors

    merges_raw = meta.get("tokenizer.ggml.merges")
    if merges_raw is None:
        raise TokenizerError(f"{source}: gpt2 tokenizer without tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    if any(len(m) != 2 for m in merges):
        raise TokenizerError(f"{source}: tokenizer.ggml.merges has an entry without a space")
    pre = meta.get("tokenizer.ggml.pre")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in ("llama-bpe", "llama3"),
        )
    )
    tok.pre_tokenizer = bpe_pre_tokenizer(pre, source)
    tok.decoder = decoders.ByteLevel()
    return tok, processors.ByteLevel(trim_offsets=False)


def _llama_model(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int]) -> Any:
    """A SentencePiece-style BPE tokenizer (byte fallback, `\u2581` spaces)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=spm_merges(tokens, scores),
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm: list[Any] = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, None


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any], *, source: str) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the one described by the `tokenizer.ggml.*`
    keys of `meta`; `source` (the file) is named in every error."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise TokenizerError(f"{source}: no embedded tokenizer (tokenizer.ggml.model/tokens)")
    tokens = [str(t) for t in tokens]
    check_special_ids({k: meta.get(k) for k in SPECIAL_ID_KEYS}, len(tokens), source)
    types = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise TokenizerError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{source}: duplicate tokens in tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok, base_post = _gpt2_model(meta, vocab, source)
    elif kind == "llama":
        tok, base_post = _llama_model(meta, tokens, vocab)
    else:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (gpt2, llama)"
        )
    special = [
        AddedToken(t, special=(ty == _TOKEN_CONTROL), normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER) or (kind == "llama" and ty == _TOKEN_UNKNOWN)
    ]
    tok.add_special_tokens([a for a in special if a.special])
    tok.add_tokens([a for a in special if not a.special])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos_id is not None:
        bos = tokens[int(bos_id)]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, int(bos_id))],
        )
        tok.post_processor = (
            processors.Sequence([base_post, template]) if base_post is not None else template
        )
    elif base_post is not None:
        tok.post_processor = base_post
    return tok


__all__ = ["SPECIAL_ID_KEYS", "bpe_pre_tokenizer", "spm_merges", "tokenizer_from_gguf_metadata"]
