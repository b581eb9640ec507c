"""The tokenizer files of an HF model directory: `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja` / `chat_template.json`, and the special-token ids of
`generation_config.json` and `config.json`.

    tokenizer, chat, info = load_hf_tokenizer("path/to/model_dir")

JSON is parsed with `json` (nothing is unpickled). A special-token id that is outside the
tokenizer's vocabulary (e.g. `generation_config.json` `eos_token_id`) raises
`TokenizerError` naming the file and field.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.tokenizers import check_special_ids

_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def token_text(value: Any) -> Optional[str]:
    """A special token of tokenizer_config.json as text: "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _template_source(directory: pathlib.Path, tc: dict[str, Any]) -> tuple[Any, str]:
    """(chat template source or None, the file it came from)."""
    origin = f"{directory / 'tokenizer_config.json'}: chat_template"
    template = tc.get("chat_template")
    if (directory / "chat_template.jinja").exists():
        path = directory / "chat_template.jinja"
        try:
            template, origin = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read ({e})") from None
    elif (directory / "chat_template.json").exists():
        path = directory / "chat_template.json"
        template, origin = _read_json(path).get("chat_template"), f"{path}: chat_template"
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template, origin


def _load_tokenizer(directory: pathlib.Path) -> Any:
    path = directory / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception subclass
        raise TokenizerError(f"{path}: not a readable tokenizers file: {e}") from None


def load_hf_tokenizer(
    directory: str | pathlib.Path,
) -> tuple[Any, Optional[ChatTemplate], dict[str, Any]]:
    """(tokenizers.Tokenizer or None, ChatTemplate or None, info) from the directory's
    tokenizer files (each optional).

    info: {"bos_token", "eos_token", "pad_token" (text or None), "eos_token_ids" (ids of
    generation_config.json's eos_token_id and of eos_token)}. With a tokenizer, the ids of
    generation_config.json and config.json must lie in its vocabulary.
    """
    directory = pathlib.Path(directory)
    tokenizer = _load_tokenizer(directory)
    tc: dict[str, Any] = {}
    if (directory / "tokenizer_config.json").exists():
        tc = _read_json(directory / "tokenizer_config.json")
    bos, eos, pad = (token_text(tc.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
    eos_ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if not (directory / name).exists():
            continue
        data = _read_json(directory / name)
        if tokenizer is not None:
            size = int(tokenizer.get_vocab_size(with_added_tokens=True))
            fields = {k: _ids(data.get(k)) for k in _ID_FIELDS}
            check_special_ids(fields, size, f"{directory / name} (tokenizer.json has {size})")
        if name == "generation_config.json":
            eos_ids += [int(i) for i in _ids(data.get("eos_token_id"))]
    eos_id = tokenizer.token_to_id(eos) if tokenizer is not None and eos is not None else None
    if eos_id is not None:
        eos_ids.append(int(eos_id))
    template, origin = _template_source(directory, tc)
    chat = (
        ChatTemplate(template, bos_token=bos or "", eos_token=eos or "", origin=origin)
        if isinstance(template, str) and template
        else None
    )
    info = {
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "eos_token_ids": tuple(dict.fromkeys(eos_ids)),
    }
    return tokenizer, chat, info


__all__ = ["load_hf_tokenizer", "token_text"]
