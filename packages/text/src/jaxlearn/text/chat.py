"""Chat templates: HF-style Jinja templates rendered in jinja2's sandbox, with limits.

    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", origin="chat.jinja")
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Templates are rendered like HF `apply_chat_template` does: `ImmutableSandboxedEnvironment`
(no attribute of Python internals, no mutation of the messages), `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension, `raise_exception`, `strftime_now`, `tojson`.

A template comes from a downloaded checkpoint, so rendering is bounded (`ChatLimits`):
- output: the rendered text is streamed chunk by chunk (`Template.generate`) and refused
  once it passes `max_output_bytes` (1 MiB by default);
- intermediate values: `*`, `**`, `+`, `%` and `~` are computed only when their result
  fits in `max_output_bytes` (so `'x' * 4000000000` allocates nothing), as are padding
  widths (`center`, `ljust`, `indent`, format field widths), `str.replace` and
  `str.expandtabs`; every filter's and call's result is measured;
- time: every loop iteration, function call, attribute or item lookup checks a deadline
  of `max_seconds` (2 s by default); `range()` is capped at 100000 items (jinja2's
  sandbox).

Rendering runs in the caller's thread; a refused template raises `ChatTemplateError`
naming the template's origin and the limit, and leaves nothing running.
"""

from __future__ import annotations

import collections.abc
import contextvars
import dataclasses
import datetime
import functools
import json
import re
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from jaxlearn.text.errors import ChatTemplateError

Message = dict[str, Any]
_LOOP = "__jaxlearn_loop__"  # Names of the guards the templates are rewritten to call.
_CONCAT = "__jaxlearn_concat__"


@dataclasses.dataclass(frozen=True)
class ChatLimits:
    """Bounds on one render: output (and any intermediate string or list) size, wall time."""

    max_output_bytes: int = 1 << 20
    max_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.max_output_bytes < 1 or not self.max_seconds > 0:
            raise ChatTemplateError(
                f"ChatLimits: max_output_bytes={self.max_output_bytes} and "
                f"max_seconds={self.max_seconds} must be positive"
            )


class _Budget:
    """The limits of the render in progress (one per render, through a context variable)."""

    def __init__(self, limits: ChatLimits, origin: str):
        self.limits, self.origin = limits, origin
        self.deadline = time.monotonic() + limits.max_seconds
        self.output = 0

    def refuse(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"{self.origin}: chat template refused: {what}")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.refuse(
                f"rendering took over ChatLimits.max_seconds={self.limits.max_seconds:g} s"
            )

    def size(self, n: int, what: str) -> None:
        if n > self.limits.max_output_bytes:
            raise self.refuse(
                f"{what} would be {n} long, over ChatLimits.max_output_bytes="
                f"{self.limits.max_output_bytes}"
            )

    def emit(self, chunk: str) -> None:
        self.output += len(chunk.encode("utf-8"))
        self.size(self.output, "output")
        self.tick()


_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar(
    "jaxlearn_chat_budget", default=None
)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # A compiled template used outside ChatTemplate.render.
        raise ChatTemplateError("chat template rendered outside ChatTemplate.render")
    return budget


def _length(x: Any) -> int:
    return len(x) if isinstance(x, collections.abc.Sized) else 0


def _format_width(fmt: Any) -> int:
    """The largest number written in a format string (a field width such as `%40s` or
    `{:>40}` bounds the size of the formatted text); 0 for anything else."""
    if not isinstance(fmt, str):
        return 0
    runs = re.findall(r"\d+", fmt)
    return max((10**10 if len(r) > 9 else int(r) for r in runs), default=0)


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The size of `left <operator> right` before computing it (0 when small by nature)."""
    if operator == "%":
        return _format_width(left)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _length(seq) and isinstance(n, int):
                return _length(seq) * max(n, 0)
    if operator == "+":
        return _length(left) + _length(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return (abs(left).bit_length() * right) // 3  # ~ decimal digits of the result
    return 0


class _Guarded(NodeTransformer):
    """Rewrites a parsed template so every `for` iterates through the loop guard and every
    `~` concatenation goes through the size guard."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Call(
            nodes.Name(_LOOP, "load", lineno=node.lineno), [node.iter], [], None, None,
            lineno=node.lineno,
        )
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(
            nodes.Name(_CONCAT, "load", lineno=node.lineno), list(node.nodes), [], None, None,
            lineno=node.lineno,
        )


def _loop_guard(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _concat_guard(*parts: Any) -> str:
    texts = [str(p) for p in parts]
    _budget().size(sum(len(t) for t in texts), "a '~' concatenation")
    return "".join(texts)


def _measured(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a filter) checking the deadline before and the size of its result after."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        if name == "center" and len(args) > 1 and isinstance(args[1], int):
            budget.size(args[1], "the width of the 'center' filter")
        if name == "indent" and len(args) > 1 and isinstance(args[1], int):
            lines = str(args[0]).count("\n") + 1
            budget.size(args[1] * lines, "the result of the 'indent' filter")
        if name == "format" and args:
            budget.size(_format_width(args[0]), "a field width of the 'format' filter")
        if name == "join" and len(args) > 2 and isinstance(args[2], str):  # (eval_ctx, value, d)
            budget.size(_length(args[1]) * len(args[2]), "the result of the 'join' filter")
        out = fn(*args, **kwargs)
        budget.size(_length(out), f"the result of the {name!r} filter")
        return out

    return run


_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the budget of the current render checked on every call, lookup and
    arithmetic operation (see the module docstring)."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.tick()
        name = getattr(__obj, "__name__", "")
        if isinstance(getattr(__obj, "__self__", None), str) and name in _WIDTH_METHODS:
            width = args[0] if args else 0
            budget.size(width if isinstance(width, int) else 0, f"str.{name} width")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and name == "replace" and len(args) > 1:
            grown = len(owner) + (len(owner) + 1) * len(str(args[1]))
            budget.size(grown, "str.replace result")
        if isinstance(owner, str) and name == "expandtabs":
            tab = args[0] if args and isinstance(args[0], int) else 8
            budget.size(len(owner) * max(tab, 1), "str.expandtabs result")
        out = super().call(__context, __obj, *args, **kwargs)
        budget.size(_length(out), f"the result of {name or 'a call'}")
        return out

    def wrap_str_format(self, value: Any) -> Optional[Callable[..., str]]:
        owner = getattr(value, "__self__", None)
        if isinstance(owner, str) and getattr(value, "__name__", "") in ("format", "format_map"):
            _budget().size(_format_width(owner), "a field width of str.format")
        return super().wrap_str_format(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget().size(_binop_size(operator, left, right), f"the result of {operator!r}")
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().tick()
        return super().getitem(obj, argument)


class _TemplateRaised(ChatTemplateError):
    """`raise_exception(message)` called by the template itself."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(f"chat template raised: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> _LimitedEnvironment:
    env = _LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _measured(name, fn) for name, fn in env.filters.items()}
    env.globals.update(
        {
            "raise_exception": _raise_exception,
            "strftime_now": _strftime_now,
            _LOOP: _loop_guard,
            _CONCAT: _concat_guard,
        }
    )
    return env


class ChatTemplate:
    """A chat template (HF Jinja source) plus the special tokens it refers to.

    origin: where the source came from (a file, a metadata key), named in every error.
    limits: `ChatLimits` of each render.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        extra_context: Optional[dict[str, Any]] = None,
        origin: str = "chat template",
        limits: Optional[ChatLimits] = None,
    ):
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(f"{origin}: the chat template is empty or not text")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        self.limits = limits or ChatLimits()
        self.extra_context = dict(extra_context or {})
        self._compiled: Optional[jinja2.Template] = None  # Compiled on first render.

    def __repr__(self) -> str:
        return f"ChatTemplate({self.origin!r}, {len(self.source)} chars)"

    def _compile(self) -> jinja2.Template:
        env = _environment()
        try:
            tree = _Guarded().visit(env.parse(self.source))
            tree.set_environment(env)
            return env.from_string(tree)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"{self.origin}: chat template does not compile: {e.message} (line {e.lineno})"
            ) from None

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
                raise ChatTemplateError(
                    f"{self.origin}: messages[{i}]: expected a dict with role and content"
                )
        context = dict(bos_token=self.bos_token, eos_token=self.eos_token, **self.extra_context)
        context.update(kwargs, messages=list(messages), add_generation_prompt=add_generation_prompt)
        if self._compiled is None:
            self._compiled = self._compile()
        budget = _Budget(self.limits, self.origin)
        token = _BUDGET.set(budget)
        out: list[str] = []
        try:
            for chunk in self._compiled.generate(**context):
                budget.emit(chunk)
                out.append(chunk)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"{self.origin}: {e}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # Whatever the template's own expressions raised.
            what = " ".join(str(e).split()) or type(e).__name__
            raise ChatTemplateError(f"{self.origin}: chat template failed: {what}") from None
        finally:
            _BUDGET.reset(token)
        return "".join(out)


__all__ = ["ChatLimits", "ChatTemplate", "ChatTemplateError", "Message"]
