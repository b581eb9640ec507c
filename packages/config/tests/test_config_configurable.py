"""Configurable, default_config, instantiate, config_for_function, config_for_class."""

import dataclasses
from typing import Any, Optional

import pytest

from jaxlearn.config import (
    REQUIRED,
    ClassConfigBase,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    Configurable,
    FunctionConfigBase,
    InstantiableConfig,
    RequiredFieldError,
    UnknownFieldError,
    config_for_class,
    config_for_function,
)


class Init(ConfigBase):
    scale: float = REQUIRED
    distribution: str = "normal"


class Linear(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        output_dim: int = REQUIRED
        bias: bool = True
        init: Init = Init()

    def __init__(self, cfg: "Linear.Config", *, scale: float = 1.0, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.scale = scale


class Stack(Configurable):
    """A parent that builds its children, filling the dims they share."""

    class Config(Configurable.Config):
        dim: int = REQUIRED
        hidden: int = REQUIRED
        layer: InstantiableConfig = Linear.default_config()

    def __init__(self, cfg: "Stack.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        c = self.config
        self.inner = c.layer.clone(input_dim=c.dim).instantiate(_path="stack.layer")


def linear_config() -> Linear.Config:
    return Linear.default_config().set(input_dim=4, output_dim=8, init=Init(scale=0.1))


def test_default_config_and_instantiate():
    cfg = Linear.default_config()
    assert isinstance(cfg, Linear.Config) and cfg.klass is Linear
    assert (cfg.input_dim, cfg.bias) == (REQUIRED, True)
    layer = linear_config().instantiate(scale=2.0)
    assert isinstance(layer, Linear)
    assert (layer.config.input_dim, layer.config.output_dim, layer.scale) == (4, 8, 2.0)


def test_instance_keeps_a_private_clone_of_its_config():
    cfg = linear_config()
    layer = cfg.instantiate()
    cfg.input_dim = 100
    cfg.init.scale = 5.0
    assert layer.config.input_dim == 4 and layer.config.init.scale == 0.1
    assert layer.config == linear_config()


def test_instantiate_reports_every_missing_field_with_its_full_path():
    with pytest.raises(RequiredFieldError) as info:
        Linear.default_config().instantiate(_path="model.proj")
    message = str(info.value)
    for path in ("model.proj.input_dim", "model.proj.output_dim", "model.proj.init.scale"):
        assert path in message
    assert "Linear" in message
    with pytest.raises(RequiredFieldError, match=r"input_dim, output_dim, init\.scale"):
        Linear.default_config().instantiate()


def test_missing_fields_of_children_are_reported_when_the_child_is_built():
    cfg = Stack.default_config().set(dim=4)
    # The parent reports its own missing field, not the child's (the parent fills those).
    with pytest.raises(RequiredFieldError) as info:
        cfg.instantiate()
    assert "hidden" in str(info.value) and "layer" not in str(info.value)
    assert cfg.missing_fields(into_instantiable=True) == [
        "hidden",
        "layer.input_dim",
        "layer.output_dim",
        "layer.init.scale",
    ]
    cfg.hidden = 8
    with pytest.raises(RequiredFieldError) as info:
        cfg.instantiate()  # The child misses output_dim and init.scale (input_dim was filled).
    assert "stack.layer.output_dim" in str(info.value)
    assert "stack.layer.init.scale" in str(info.value)
    assert "input_dim" not in str(info.value)
    cfg.layer.set(output_dim=2, init=Init(scale=1.0))
    assert cfg.instantiate().inner.config.input_dim == 4


def test_klass_must_be_set_and_the_config_must_fit_the_class():
    with pytest.raises(RequiredFieldError, match="klass"):
        Configurable.Config().instantiate()
    with pytest.raises(ConfigError, match="needs a Stack.Config"):
        Stack(linear_config())  # type: ignore[arg-type]


def test_nested_config_must_subclass_the_parent_config():
    with pytest.raises(ConfigError, match=r"must subclass Linear.Config"):

        class Bad(Linear):
            class Config(Configurable.Config):
                extra: int = 1

    with pytest.raises(ConfigError, match="derived from Configurable.Config"):

        class NotAConfig(Linear):
            class Config:
                pass


def test_subclass_without_its_own_config_uses_the_parents():
    class Biased(Linear):
        pass

    cfg = Biased.default_config()
    assert type(cfg) is Linear.Config and cfg.klass is Biased
    cfg.set(input_dim=1, output_dim=1, init=Init(scale=1.0))
    assert isinstance(cfg.instantiate(), Biased)


def test_multiple_inheritance_needs_a_config_deriving_from_every_parent_config():
    class Gated(Configurable):
        class Config(Configurable.Config):
            gate: str = "sigmoid"

    with pytest.raises(ConfigError, match="must subclass Gated.Config"):

        class Both(Linear, Gated):  # type: ignore[misc]
            pass

    class Fine(Linear, Gated):
        class Config(Linear.Config, Gated.Config):
            pass

    assert Fine.default_config().keys() == [
        "klass",
        "gate",
        "input_dim",
        "output_dim",
        "bias",
        "init",
    ]


# ---- config_for_function / config_for_class ---------------------------------------------


def make_schedule(peak: float, warmup: int = 10, *, decay: Optional[str] = None) -> tuple:
    return ("schedule", peak, warmup, decay)


def positional(a: int, /, b: int = 2) -> int:
    return a * 10 + b


def sloppy(x: int = None) -> Any:  # type: ignore[assignment]
    return x


def appends(bucket: list, *args: Any, **kwargs: Any) -> list:
    bucket.append(1)
    return bucket


def test_config_for_function_derives_fields_from_the_signature():
    cfg = config_for_function(make_schedule)
    assert isinstance(cfg, FunctionConfigBase) and cfg.fn is make_schedule
    assert cfg.keys() == ["fn", "peak", "warmup", "decay"]
    assert (cfg.peak, cfg.warmup, cfg.decay) == (REQUIRED, 10, None)
    with pytest.raises(ConfigTypeError):
        cfg.warmup = "ten"
    with pytest.raises(UnknownFieldError, match="did you mean: warmup"):
        cfg.warmpu = 1
    with pytest.raises(RequiredFieldError, match="peak"):
        cfg.instantiate()
    assert cfg.set(peak=1.0).instantiate() == ("schedule", 1.0, 10, None)
    assert cfg.instantiate(warmup=3) == ("schedule", 1.0, 3, None)
    assert config_for_function(make_schedule, peak=2.0).peak == 2.0


def test_config_for_function_handles_special_parameters():
    assert config_for_function(positional, a=3).instantiate() == 32
    cfg = config_for_function(sloppy)
    assert cfg.instantiate() is None and cfg.set(x=3).instantiate() == 3  # Optional[int].
    cfg = config_for_function(appends, bucket=[])
    assert cfg.keys() == ["fn", "bucket"]
    assert cfg.instantiate() == [1]
    assert cfg.bucket == []  # The function got a copy, not the config's own list.


def test_config_for_function_rejects_clashing_parameter_names():
    def uses_fn(fn: int) -> int:
        return fn

    def uses_set(set: int) -> int:  # noqa: A002
        return set

    with pytest.raises(ConfigError, match="reserved"):
        config_for_function(uses_fn)
    with pytest.raises(ConfigError, match="shadow"):
        config_for_function(uses_set)


class Optimizer:
    def __init__(self, learning_rate: float, momentum: float = 0.9, nesterov: bool = False):
        self.args = (learning_rate, momentum, nesterov)


@dataclasses.dataclass
class Shape:
    rows: int
    cols: int = 1


def test_config_for_class_derives_fields_from_the_constructor():
    cfg = config_for_class(Optimizer)
    assert isinstance(cfg, ClassConfigBase) and cfg.klass is Optimizer
    assert cfg.keys() == ["klass", "learning_rate", "momentum", "nesterov"]
    with pytest.raises(ConfigTypeError):
        cfg.nesterov = "yes"
    with pytest.raises(RequiredFieldError, match="learning_rate"):
        cfg.instantiate()
    opt = cfg.set(learning_rate=3e-4).instantiate(nesterov=True)
    assert isinstance(opt, Optimizer) and opt.args == (3e-4, 0.9, True)
    shape = config_for_class(Shape, rows=2).instantiate()
    assert shape == Shape(2, 1)
