"""Instantiable configs: `Configurable` classes, and configs derived from signatures.

    class Linear(Configurable):
        class Config(Configurable.Config):
            input_dim: int = REQUIRED
            output_dim: int = REQUIRED

    layer = Linear.default_config().set(input_dim=4, output_dim=8).instantiate()

`config_for_function(fn)` and `config_for_class(cls)` build configs whose fields are the
function's (or constructor's) parameters; `instantiate(**kwargs)` calls it.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Generic, TypeVar

from jaxlearn.config.base import REQUIRED, ConfigBase, ConfigError, RequiredFieldError, _copy_value

C = TypeVar("C")


class InstantiableConfig(ConfigBase, Generic[C]):
    """A config that can build the object it describes."""

    def instantiate(self, **kwargs: Any) -> C:
        raise NotImplementedError(type(self))


class Configurable:
    """A class built from its nested `Config`.

    Subclasses nest `class Config(Parent.Config)` and are built with
    `cls.default_config().set(...).instantiate()`. The instance keeps a private clone of
    its config (`self.config`), so later edits to the config object do not leak in.
    """

    class Config(InstantiableConfig):
        klass: type = REQUIRED

        def instantiate(self, **kwargs: Any) -> Any:
            if self.klass is REQUIRED:
                raise RequiredFieldError(f"{type(self).__qualname__}.klass is not set")
            return self.klass(self, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config = vars(cls).get("Config", cls.Config)
        if not (isinstance(config, type) and issubclass(config, Configurable.Config)):
            raise ConfigError(
                f"{cls.__name__}.Config must be a class derived from Configurable.Config"
            )
        for base in cls.__bases__:
            if not issubclass(base, Configurable):
                continue
            if not issubclass(config, base.Config):
                raise ConfigError(
                    f"{cls.__name__}.Config must subclass {base.__name__}.Config "
                    f"(declare it as `class Config({base.__name__}.Config):`)"
                )

    @classmethod
    def default_config(cls) -> Any:
        """A fresh config for this class with every default set and `klass=cls`."""
        return cls.Config(klass=cls)

    def __init__(self, cfg: "Configurable.Config", *, _path: str = ""):
        if not isinstance(cfg, self.Config):
            raise ConfigError(
                f"{type(self).__qualname__} needs a {self.Config.__qualname__}, "
                f"got {type(cfg).__qualname__}"
            )
        missing = cfg.missing_fields(_path)
        if missing:
            raise RequiredFieldError(
                f"Cannot instantiate {type(self).__qualname__}: required field(s) not set: "
                f"{', '.join(missing)}"
            )
        self._config = cfg.clone()

    @property
    def config(self) -> Any:
        """The config this object was built from (a clone; do not mutate)."""
        return self._config


def _call_kwargs(cfg: ConfigBase, reserved: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    # Copies, so the callee cannot alias (or mutate) the config's own values.
    values = {k: _copy_value(v) for k, v in cfg.items() if k != reserved}
    values.update(kwargs)
    return values


def _call(target: Callable[..., Any], positional: tuple[str, ...], values: dict[str, Any]) -> Any:
    args = [values.pop(name) for name in positional if name in values]
    return target(*args, **values)


class FunctionConfigBase(InstantiableConfig):
    """Config whose fields are the parameters of `fn`; `instantiate()` calls it."""

    fn: Callable[..., Any] = REQUIRED
    _positional_only: tuple[str, ...] = ()

    def instantiate(self, **kwargs: Any) -> Any:
        self.check_required()
        return _call(self.fn, self._positional_only, _call_kwargs(self, "fn", kwargs))


class ClassConfigBase(InstantiableConfig):
    """Config whose fields are the constructor parameters of `klass`."""

    klass: type = REQUIRED
    _positional_only: tuple[str, ...] = ()

    def instantiate(self, **kwargs: Any) -> Any:
        self.check_required()
        return _call(self.klass, self._positional_only, _call_kwargs(self, "klass", kwargs))


def _config_from_signature(
    base: type[InstantiableConfig], target: Callable[..., Any], hints_of: Any, name: str
) -> type[InstantiableConfig]:
    sig = inspect.signature(target)
    try:
        hints = typing.get_type_hints(hints_of)
    except Exception:  # Unresolvable names: keep the raw annotations, resolved per field.
        hints = {}
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {}
    positional: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name.startswith("_"):
            if p.default is p.empty:
                raise ConfigError(f"{name}: private parameter '{p.name}' has no default")
            continue
        if p.name in base._fields:
            raise ConfigError(f"{name}: parameter '{p.name}' clashes with a reserved field")
        hint = hints.get(p.name, Any if p.annotation is p.empty else p.annotation)
        if p.default is None and hint is not Any:
            hint = typing.Optional[hint]  # `x: int = None` means Optional[int].
        annotations[p.name] = hint
        namespace[p.name] = REQUIRED if p.default is p.empty else p.default
        if p.kind is p.POSITIONAL_ONLY:
            positional.append(p.name)
    namespace["__annotations__"] = annotations
    namespace["__module__"] = getattr(target, "__module__", None) or __name__
    namespace["_positional_only"] = tuple(positional)
    return type(name, (base,), namespace)


def _qualname(obj: Any) -> str:
    return str(getattr(obj, "__qualname__", None) or type(obj).__qualname__)


def config_for_function(fn: Callable[..., Any], **kwargs: Any) -> FunctionConfigBase:
    """A config with one field per parameter of `fn` (REQUIRED where it has no default)."""
    cls = _config_from_signature(FunctionConfigBase, fn, fn, f"FunctionConfig[{_qualname(fn)}]")
    cfg = cls(fn=fn).set(**kwargs)
    assert isinstance(cfg, FunctionConfigBase)
    return cfg


def config_for_class(klass: type, **kwargs: Any) -> ClassConfigBase:
    """A config with one field per parameter of `klass`'s constructor."""
    init = klass.__dict__.get("__init__") or getattr(klass, "__init__")
    cls = _config_from_signature(ClassConfigBase, klass, init, f"ClassConfig[{_qualname(klass)}]")
    cfg = cls(klass=klass).set(**kwargs)
    assert isinstance(cfg, ClassConfigBase)
    return cfg
