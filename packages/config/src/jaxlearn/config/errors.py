"""Error types of jaxlearn.config and the `REQUIRED` sentinel (no third-party imports)."""

from __future__ import annotations

import difflib
from typing import Any, NoReturn, Sequence


class ConfigError(ValueError):
    """Base class of every error raised by jaxlearn.config."""


class RequiredFieldError(ConfigError):
    """A REQUIRED field was used or instantiated before it was set."""


class UnknownFieldError(ConfigError, AttributeError):
    """A field name (or path) that the config does not declare."""


class ConfigTypeError(ConfigError, TypeError):
    """A value that does not match the field's annotated type."""


class _RequiredAttributeError(RequiredFieldError, AttributeError):
    """`REQUIRED.attr`: a RequiredFieldError that `hasattr` still reads as 'absent'."""


_MESSAGE = (
    "A REQUIRED config field was used before it was set; set it on the config "
    "(cfg.set(...), or --set path=value) before instantiating."
)


class _Required:
    """Sentinel for fields that must be set before use. Any use as a value raises.

    Identity (`is REQUIRED`), `==`, `repr`/`str` and copying still work, so configs holding
    it can be compared, printed and cloned.
    """

    _instance: "_Required | None" = None

    def __new__(cls) -> "_Required":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __copy__(self) -> "_Required":
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Required":
        return self

    def __reduce__(self) -> str:
        return "REQUIRED"

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _RequiredAttributeError(f"{_MESSAGE} (accessed attribute '{name}')")

    def _fail(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RequiredFieldError(_MESSAGE)

    __bool__ = __int__ = __float__ = __complex__ = __index__ = __len__ = __iter__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = _fail
    __rmatmul__ = __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _fail
    __mod__ = __rmod__ = __pow__ = __rpow__ = __divmod__ = __rdivmod__ = _fail
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _fail
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = __pos__ = __abs__ = __invert__ = _fail
    __round__ = __trunc__ = __floor__ = __ceil__ = _fail
    __getitem__ = __setitem__ = __delitem__ = __contains__ = __call__ = _fail


REQUIRED: Any = _Required()


def suggest(name: str, candidates: Sequence[str]) -> str:
    """Returns ' (did you mean: x?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean: {close[0]}?)" if close else ""
