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

from jaxlearn.config.base import REQUIRED, ConfigBase, ConfigError, RequiredFieldError

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
        parent_cfg = next(
            b.Config for b in cls.__mro__[1:] if issubclass(b, Configurable) and "Config" in vars(b)
        )
        if not issubclass(cls.Config, parent_cfg):
            raise ConfigError(
                f"{cls.__qualname__}.Config must subclass {parent_cfg.__qualname__} "
                f"(declare it as `class Config({parent_cfg.__qualname__}):`)"
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


class FunctionConfigBase(InstantiableConfig):
    """Config whose fields are the parameters of `fn`; `instantiate()` calls it."""

    fn: Callable = REQUIRED  # type: ignore[type-arg]

    def instantiate(self, **kwargs: Any) -> Any:
        self.check_required()
        values = {k: v for k, v in self.items() if k != "fn"}
        values.update(kwargs)
        return self.fn(**values)


class ClassConfigBase(InstantiableConfig):
    """Config whose fields are the constructor parameters of `klass`."""

    klass: type = REQUIRED

    def instantiate(self, **kwargs: Any) -> Any:
        self.check_required()
        values = {k: v for k, v in self.items() if k != "klass"}
        values.update(kwargs)
        return self.klass(**values)


def _config_from_signature(
    base: type[InstantiableConfig], target: Callable, name: str, skip_first: bool
) -> type[InstantiableConfig]:
    sig = inspect.signature(target)
    try:
        hints = typing.get_type_hints(target)
    except Exception:
        hints = {}
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {}
    params = list(sig.parameters.values())[1 if skip_first else 0 :]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in base._fields:
            raise ConfigError(f"{name}: parameter '{p.name}' clashes with a reserved field")
        annotations[p.name] = hints.get(p.name, Any)
        namespace[p.name] = REQUIRED if p.default is p.empty else p.default
    namespace["__annotations__"] = annotations
    namespace["__module__"] = getattr(target, "__module__", __name__)
    return type(name, (base,), namespace)


def config_for_function(fn: Callable, **kwargs: Any) -> FunctionConfigBase:
    """A config with one field per parameter of `fn` (REQUIRED where it has no default)."""
    cls = _config_from_signature(
        FunctionConfigBase, fn, f"FunctionConfig[{fn.__qualname__}]", skip_first=False
    )
    return cls(fn=fn).set(**kwargs)  # type: ignore[return-value]


def config_for_class(klass: type, **kwargs: Any) -> ClassConfigBase:
    """A config with one field per parameter of `klass.__init__`."""
    cls = _config_from_signature(
        ClassConfigBase, klass.__init__, f"ClassConfig[{klass.__qualname__}]", skip_first=True
    )
    return cls(klass=klass).set(**kwargs)  # type: ignore[return-value]
