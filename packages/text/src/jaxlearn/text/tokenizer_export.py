"""Tokenizers for export: one `ExportTokenizer` (an HF `tokenizers.Tokenizer` plus its
special ids) from whatever a model was trained with, and the files / metadata it becomes.

    tok = export_tokenizer(ByteTokenizer.default_config().instantiate(), vocab_size=512)
    write_hf_tokenizer_files(out_dir, tok, chat_template, model_max_length=2048)
    meta = gguf_tokenizer_metadata(tok, vocab_size=512)     # tokenizer.ggml.* values

Sources: a `tokenizers.Tokenizer` (byte-level BPE, or SentencePiece-style BPE with byte
fallback), `jaxlearn.text.tokenizers.HFTokenizer` (its file and special ids), and
jaxlearn's `ByteTokenizer` (pad 0, bos 1, eos 2, byte b -> b + 3), which becomes a
byte-level BPE without merges with exactly those ids: `encode(text,
add_special_tokens=False)` gives `ByteTokenizer.encode(text)` for every text that does not
contain the literal special tokens `<pad>`, `<s>`, `</s>`, and its post-processor adds BOS
as jaxlearn's input pipeline does (`add_bos`).

Token types follow llama.cpp (`gguf.TokenType`): normal 1, unknown 2, control 3 (special
added tokens), user-defined 4 (other added tokens), unused 5 (ids past the tokenizer that
pad it to the model's vocab_size), byte 6 (`<0xNN>` byte-fallback pieces).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Iterable, Optional, Sequence

from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.tokenizers import ByteTokenizer, HFTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)
BYTE_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 of ByteTokenizer
# Pre-tokenizer regexes that llama.cpp knows by its `tokenizer.ggml.pre` name.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEXES = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


@dataclasses.dataclass
class ExportTokenizer:
    """An HF tokenizer with the ids a model generates with.

    tokenizer: `tokenizers.Tokenizer`; bos/pad: ids or None; eos: ids (the first is the
    tokenizer's EOS token); add_bos: whether encoding a text starts with BOS.
    """

    tokenizer: Any
    bos: Optional[int]
    eos: tuple[int, ...]
    pad: Optional[int]
    add_bos: bool

    @property
    def size(self) -> int:
        """Number of ids the tokenizer uses (max id + 1)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self.tokenizer.id_to_token(int(i))

    def state(self) -> dict[str, Any]:
        """The tokenizer.json contents (a dict)."""
        return dict(json.loads(self.tokenizer.to_str()))


def byte_level_tokenizer(*, add_bos: bool = True) -> Any:
    """A `tokenizers.Tokenizer` (259 ids) with the ids of jaxlearn's `ByteTokenizer`:
    `<pad>` 0, `<s>` 1, `</s>` 2 (special), byte b -> b + 3 (the GPT-2 byte-to-unicode
    character of b), no merges. A larger model vocab is padded by the GGUF writer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(BYTE_SPECIALS)}
    vocab.update({alphabet[b]: b + ByteTokenizer.OFFSET for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    byte_post = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        )
        tok.post_processor = processors.Sequence([byte_post, bos])
    else:
        tok.post_processor = byte_post
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (`ByteLevel.alphabet` order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bos_added(tok: Any) -> Optional[int]:
    """The id the post-processor puts in front of an encoded text, if any."""
    with_specials = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    extra = len(with_specials) - len(plain)
    if extra > 0 and with_specials[extra:] == plain:
        return int(with_specials[0])
    return None


def _id_of(tok: Any, text: Optional[str]) -> Optional[int]:
    if not text:
        return None
    i = tok.token_to_id(text)
    return None if i is None else int(i)


def export_tokenizer(
    tokenizer: Any,
    *,
    vocab_size: int,
    chat_template: Optional[ChatTemplate] = None,
    bos_token_id: Optional[int] = None,
    eos_token_ids: Iterable[int] = (),
    pad_token_id: Optional[int] = None,
) -> ExportTokenizer:
    """The `ExportTokenizer` of `tokenizer` for a model with `vocab_size` logits.

    Special ids: the arguments, else the chat template's bos/eos token texts, else the
    tokenizer's own (a `ByteTokenizer` / `HFTokenizer`'s ids; the BOS a
    `tokenizers.Tokenizer`'s post-processor adds). Raises TokenizerError for an unknown
    tokenizer type, a tokenizer with more ids than `vocab_size`, or special ids out of range.
    """
    eos = tuple(int(i) for i in eos_token_ids)
    own: tuple[Optional[int], Optional[int], Optional[int]]  # the tokenizer's bos, eos, pad
    if isinstance(tokenizer, ByteTokenizer):
        tok = byte_level_tokenizer()
        own = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        add_bos = True
    elif isinstance(tokenizer, HFTokenizer):
        from tokenizers import Tokenizer

        # A copy of the loaded tokenizer: its config's path may be a GGUF file
        # (`GGUFTokenizer`) or empty (`HFTokenizer.from_tokenizer`).
        tok = Tokenizer.from_str(tokenizer.tokenizer.to_str())
        own = (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        add_bos = _bos_added(tok) is not None
    elif type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "to_str"):
        tok, added = tokenizer, _bos_added(tokenizer)
        own = (added, None, None)
        add_bos = added is not None
    else:
        raise TokenizerError(
            f"cannot export a tokenizer of type {type(tokenizer).__name__}: expected a "
            f"tokenizers.Tokenizer, jaxlearn ByteTokenizer or HFTokenizer"
        )
    template = chat_template
    bos = bos_token_id
    if bos is None and template is not None:
        bos = _id_of(tok, template.bos_token)
    bos = own[0] if bos is None else bos
    if not eos and template is not None and _id_of(tok, template.eos_token) is not None:
        eos = (int(tok.token_to_id(template.eos_token)),)
    eos = eos or ((own[1],) if own[1] is not None else ())
    pad = own[2] if pad_token_id is None else pad_token_id
    out = ExportTokenizer(tok, bos, eos, pad, add_bos)
    if out.size > vocab_size:
        raise TokenizerError(
            f"the tokenizer has {out.size} ids but the model's vocab_size "
            f"(model.decoder.vocab_size) is {vocab_size}; it cannot be exported with this model"
        )
    for what, ids in (("bos_token_id", [bos]), ("eos_token_ids", eos), ("pad_token_id", [pad])):
        for i in ids:
            if i is not None and not 0 <= int(i) < out.size:
                raise TokenizerError(
                    f"{what} {i} is not an id of the tokenizer (0..{out.size - 1})"
                )
    return out


# ---- HF files ---------------------------------------------------------------------------------


def _added_tokens(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` (id -> AddedToken fields)."""
    out = {}
    for a in state.get("added_tokens", []):
        fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        out[str(a["id"])] = {k: a[k] for k in fields if k in a}
    return out


def write_hf_tokenizer_files(
    out: pathlib.Path,
    tok: ExportTokenizer,
    chat_template: Optional[ChatTemplate],
    *,
    model_max_length: int,
) -> list[str]:
    """Writes tokenizer.json, tokenizer_config.json, special_tokens_map.json and (with a
    template) chat_template.jinja into `out`, as transformers' `PreTrainedTokenizerFast`
    saves them. Returns the file names written."""
    tok.tokenizer.save(str(out / "tokenizer.json"))
    specials = {
        "bos_token": tok.token(tok.bos),
        "eos_token": tok.token(tok.eos[0] if tok.eos else None),
        "pad_token": tok.token(tok.pad),
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "added_tokens_decoder": _added_tokens(tok.state()),
    }
    written = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    if chat_template is not None:
        config["chat_template"] = chat_template.source
        (out / "chat_template.jinja").write_text(chat_template.source)
        written.append("chat_template.jinja")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    present = {k: v for k, v in specials.items() if v is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(present, indent=2) + "\n")
    return written


def generation_config(tok: Optional[ExportTokenizer], bos: Optional[int], eos: Sequence[int],
                      pad: Optional[int]) -> dict[str, Any]:
    """generation_config.json: bos/eos/pad ids (a tokenizer's fill what is not given)."""
    if tok is not None:
        bos = tok.bos if bos is None else bos
        eos = tuple(eos) or tok.eos
        pad = tok.pad if pad is None else pad
    gen: dict[str, Any] = {}
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    if eos:
        ids = [int(i) for i in eos]
        gen["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    return gen


# ---- GGUF metadata ----------------------------------------------------------------------------


def _gguf_pre(pre: Optional[dict[str, Any]], where: str) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE pre-tokenizer (tokenizer.json)."""
    kind = (pre or {}).get("type")
    if kind == "ByteLevel" and pre is not None and pre.get("use_regex", True):
        return "gpt-2"
    if kind == "Sequence" and pre is not None:
        steps = pre.get("pretokenizers", [])
        types = [s.get("type") for s in steps]
        if types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
            return "smollm"
        if types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
            regex = steps[0].get("pattern", {}).get("Regex")
            if regex in _SPLIT_REGEXES:
                return _SPLIT_REGEXES[regex]
    raise TokenizerError(
        f"{where}: pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp "
        f"tokenizer.ggml.pre equivalent (gpt-2 ByteLevel, smollm, llama-bpe, qwen2)"
    )


def _merge_strings(merges: Sequence[Any]) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _adds_space_prefix(state: dict[str, Any]) -> bool:
    text = json.dumps(state.get("normalizer")) + json.dumps(state.get("pre_tokenizer"))
    return '"Prepend"' in text or ('"Metaspace"' in text and '"never"' not in text)


def gguf_tokenizer_metadata(tok: ExportTokenizer, *, vocab_size: int) -> dict[str, Any]:
    """The `tokenizer.ggml.*` values of `tok` for a model with `vocab_size` rows:
    model ("gpt2" byte-level BPE, or "llama" for SentencePiece-style BPE with byte
    fallback), pre, tokens (padded with unused `[PAD{i}]`), token_type, merges (gpt2) or
    scores (llama: -rank of the merge that makes the piece), bos/eos/eot/pad ids, add_bos."""
    state = tok.state()
    model = state.get("model", {})
    if model.get("type") != "BPE":
        raise TokenizerError(
            f"tokenizer model {model.get('type')!r} cannot be written to GGUF (BPE only)"
        )
    tokens = [tok.tokenizer.id_to_token(i) for i in range(tok.size)]
    if any(t is None for t in tokens):
        missing = [i for i, t in enumerate(tokens) if t is None][:5]
        raise TokenizerError(f"the tokenizer's ids are not contiguous (no token for ids {missing})")
    added = {int(a["id"]): bool(a.get("special")) for a in state.get("added_tokens", [])}
    kinds = {True: CONTROL, False: USER_DEFINED}
    types = [kinds[added[i]] if i in added else NORMAL for i in range(len(tokens))]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [UNUSED] * (vocab_size - len(types))
    merges = _merge_strings(model.get("merges", []))
    meta: dict[str, Any] = {"tokens": tokens, "token_type": types}
    if model.get("byte_fallback"):
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        unk = model.get("unk_token")
        for i, t in enumerate(tokens):
            if types[i] == NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = BYTE
            elif t == unk and types[i] != UNUSED:
                types[i] = UNKNOWN
        meta.update(
            model="llama",
            scores=[-float(rank[t] + 1) if t in rank else 0.0 for t in tokens],
            add_space_prefix=_adds_space_prefix(state),
            unk=_id_of(tok.tokenizer, unk),
        )
    else:
        meta.update(model="gpt2", pre=_gguf_pre(state.get("pre_tokenizer"), "tokenizer"))
        meta["merges"] = merges or _unreachable_merge(tokens, tok.size)
    return meta


def _unreachable_merge(tokens: list[str], size: int) -> list[str]:
    """One merge for a byte-level BPE without merges (the byte tokenizer): llama.cpp
    refuses a gpt2 tokenizer without `tokenizer.ggml.merges` and the gguf writer drops an
    empty array. The merge joins a letter and a following space ("a" + "Ġ") into the first
    unused id; the GPT-2 pre-tokenizer never puts those two in one word, so it never fires
    and the ids stay those of the tokenizer."""
    space = _bytes_to_unicode()[ord(" ")]
    if "a" not in tokens[:size] or space not in tokens[:size]:
        raise TokenizerError("a BPE tokenizer without merges and without byte-level 'a'/'Ġ'")
    if size >= len(tokens):
        raise TokenizerError(
            f"a byte-level BPE without merges ({size} ids) needs one unused id in the model's "
            f"vocab (vocab_size > {size}) for the merge llama.cpp requires"
        )
    tokens[size] = "a" + space
    return [f"a {space}"]
