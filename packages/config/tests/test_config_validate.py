"""Field limits (`validate`, `below_minimum`) and overrides that name a Configurable class
for a field holding a config."""

import pytest

from jaxlearn.config import (
    REQUIRED,
    ConfigError,
    Configurable,
    InstantiableConfig,
    apply_overrides,
    below_minimum,
)


class Source(Configurable):
    class Config(Configurable.Config):
        paths: list[str] = REQUIRED


class Other(Configurable):
    class Config(Configurable.Config):
        size: int = 3


class Run(Configurable):
    class Config(Configurable.Config):
        steps: int = 10
        every: int = 1
        marks: tuple[int, ...] = ()
        rate: float = 0.1
        source: InstantiableConfig = Other.default_config()
        child: "Run.Config | None" = None

        def _field_problems(self) -> dict[str, str]:
            problems = below_minimum(self, steps=1, every=1, marks=0)
            if not self.rate > 0:
                problems["rate"] = f"must be > 0, got {self.rate!r}"
            return problems


def test_valid_config_passes():
    Run.default_config().validate()


def test_every_problem_is_named_with_its_full_path():
    cfg = Run.default_config().set(steps=-1, marks=(2, -3))
    cfg.child = Run.default_config().set(every=0, rate=0.0)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    message = str(e.value)
    assert "steps: must be >= 1, got -1" in message
    assert "marks: must be >= 0, got (2, -3)" in message
    assert "child.every: must be >= 1, got 0" in message
    assert "child.rate: must be > 0, got 0.0" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"^run\.steps: must be >= 1"):
        Run.default_config().set(steps=0).validate(prefix="run")


def test_unset_and_none_fields_are_not_problems():
    class Opt(Configurable):
        class Config(Configurable.Config):
            n: int = REQUIRED
            m: "int | None" = None

    assert below_minimum(Opt.default_config(), n=1, m=1) == {}


def test_a_class_path_for_a_config_field_gives_its_default_config():
    cfg = Run.default_config()
    here = __name__
    apply_overrides(cfg, [f"source={here}.Source", "source.paths=['a.txt', 'b']"])
    assert isinstance(cfg.source, Source.Config) and cfg.source.paths == ["a.txt", "b"]
    with pytest.raises(ConfigError, match="steps"):
        apply_overrides(cfg, [f"steps={here}.Source"])  # Not a config field.
