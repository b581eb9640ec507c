"""Chat templates: HF-style Jinja templates rendered with jinja2 when it is installed, else
with a built-in renderer for the common template families.

    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

With jinja2 the template is rendered like HF `apply_chat_template` does (sandboxed
environment, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`, `tojson`).
Without jinja2, `family` is detected from the template's markers and rendered natively:

- chatml (`<|im_start|>`): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message,
  plus the template's literal default system prompt when the first message is not a
  system message (SmolLM2, Qwen2);
- llama3 (`<|start_header_id|>`): `{bos}` then
  `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content|trim}<|eot_id|>`;
- gemma (`<start_of_turn>`): `{bos}` then `<start_of_turn>{user|model}\\n{content|trim}
  <end_of_turn>\\n`;
- zephyr (`<|user|>`): `<|{role}|>\\n{content}{eos}\\n`;
- mistral (`[INST]`): `{bos}[INST] {content} [/INST]{answer}{eos}...` (a system message is
  joined to the first user turn).

The built-in renderer covers plain text messages (no tools, no multimodal parts); anything
else raises ChatTemplateError asking for jinja2.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any, Optional, Sequence

from jaxlearn.text.errors import ChatTemplateError

Message = dict[str, Any]

try:  # Optional: jinja2 is not in the project lockfile (see the package README).
    import jinja2  # type: ignore[import-not-found, unused-ignore]
    from jinja2.sandbox import (  # type: ignore[import-not-found, unused-ignore]
        ImmutableSandboxedEnvironment,
    )

    HAVE_JINJA2 = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_JINJA2 = False

_MARKERS = (
    ("chatml", "<|im_start|>"),
    ("llama3", "<|start_header_id|>"),
    ("gemma", "<start_of_turn>"),
    ("zephyr", "<|user|>"),
    ("mistral", "[INST]"),
)


def detect_family(source: str) -> Optional[str]:
    """The built-in family whose marker appears in the template source, or None."""
    for family, marker in _MARKERS:
        if marker in source:
            return family
    return None


def _default_system(source: str) -> Optional[str]:
    """The literal default system prompt of a ChatML template (inserted when the first
    message is not a system message), e.g. SmolLM2's or Qwen2's; None if it has none."""
    if "messages[0]['role'] != 'system'" not in source.replace('"', "'"):
        return None
    m = re.search(r"<\|im_start\|>system(?:\\n|\n)(.*?)<\|im_end\|>", source, re.S)
    if m is None or any(t in m.group(1) for t in ("{{", "{%", "' +", "+ '")):
        return None
    return m.group(1).replace("\\n", "\n")


class ChatTemplate:
    """A chat template (HF Jinja source) plus the special tokens it refers to."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        use_jinja: Optional[bool] = None,
        extra_context: Optional[dict[str, Any]] = None,
    ):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.family = detect_family(source)
        self.extra_context = dict(extra_context or {})
        self.use_jinja = HAVE_JINJA2 if use_jinja is None else use_jinja
        if self.use_jinja and not HAVE_JINJA2:
            raise ChatTemplateError("use_jinja=True but jinja2 is not installed")
        self._compiled: Any = None

    @property
    def engine(self) -> str:
        """ "jinja2", or "builtin:<family>" (or "builtin:unknown" when nothing fits)."""
        return "jinja2" if self.use_jinja else f"builtin:{self.family or 'unknown'}"

    def __repr__(self) -> str:
        return f"ChatTemplate(engine={self.engine!r}, {len(self.source)} chars)"

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]); its special tokens
        are plain text, so encode it without adding special tokens again."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ChatTemplateError(f"messages[{i}]: expected a dict with role and content")
        if self.use_jinja:
            return self._render_jinja(messages, add_generation_prompt, kwargs)
        return self._render_builtin(messages, add_generation_prompt, kwargs)

    # ---- jinja2 --------------------------------------------------------------------------

    def _render_jinja(
        self, messages: Sequence[Message], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        if self._compiled is None:

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(f"chat template raised: {message}")

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

            def strftime_now(fmt: str) -> str:
                return datetime.datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"chat template does not compile: {e}") from e
        context = dict(bos_token=self.bos_token, eos_token=self.eos_token, **self.extra_context)
        context.update(kwargs)
        try:
            return str(
                self._compiled.render(
                    messages=list(messages), add_generation_prompt=add_generation_prompt, **context
                )
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    # ---- built-in fallback ----------------------------------------------------------------

    def _render_builtin(
        self, messages: Sequence[Message], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        if kwargs.get("tools") or kwargs.get("documents"):
            raise ChatTemplateError("tools/documents need jinja2 (not installed)")
        for i, m in enumerate(messages):
            if not isinstance(m["content"], str):
                raise ChatTemplateError(
                    f"messages[{i}].content is not a string; the built-in renderer handles "
                    f"text only (install jinja2)"
                )
        render = {
            "chatml": self._chatml,
            "llama3": self._llama3,
            "gemma": self._gemma,
            "zephyr": self._zephyr,
            "mistral": self._mistral,
        }.get(self.family or "")
        if render is None:
            raise ChatTemplateError(
                "jinja2 is not installed and the chat template matches no built-in family "
                f"({', '.join(f for f, _ in _MARKERS)}); install jinja2 to render it"
            )
        return render(list(messages), add_generation_prompt)

    def _chatml(self, messages: list[Message], gen: bool) -> str:
        out = []
        system = _default_system(self.source)
        if system is not None and messages and messages[0]["role"] != "system":
            out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        for m in messages:
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if gen:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def _llama3(self, messages: list[Message], gen: bool) -> str:
        out = [self.bos_token]
        for m in messages:
            out.append(
                f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n"
                f"{m['content'].strip()}<|eot_id|>"
            )
        if gen:
            out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(out)

    def _gemma(self, messages: list[Message], gen: bool) -> str:
        out = [self.bos_token]
        system = ""
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"].strip() + "\n\n", messages[1:]
        for i, m in enumerate(messages):
            role = "model" if m["role"] == "assistant" else m["role"]
            prefix = system if i == 0 else ""
            out.append(f"<start_of_turn>{role}\n{prefix}{m['content'].strip()}<end_of_turn>\n")
        if gen:
            out.append("<start_of_turn>model\n")
        return "".join(out)

    def _zephyr(self, messages: list[Message], gen: bool) -> str:
        out = [f"<|{m['role']}|>\n{m['content']}{self.eos_token}\n" for m in messages]
        if gen:
            out.append("<|assistant|>\n")
        return "".join(out)

    def _mistral(self, messages: list[Message], gen: bool) -> str:
        out = [self.bos_token]
        system = ""
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"] + "\n\n", messages[1:]
        for i, m in enumerate(messages):
            if (m["role"] == "user") != (i % 2 == 0):
                raise ChatTemplateError("mistral template: roles must alternate user/assistant")
            if m["role"] == "user":
                text = (system + m["content"]) if i == 0 else m["content"]
                out.append(f"[INST] {text} [/INST]")
            else:
                out.append(f"{m['content']}{self.eos_token}")
        return "".join(out)
