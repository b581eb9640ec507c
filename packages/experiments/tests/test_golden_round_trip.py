"""Every recipe's flat text rebuilds into a config (`from_flat_text`) whose flat text is the
same, including after random edits to its numeric fields; the rebuilt config builds the
same model parameter shapes as the recipe."""

import re

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.config import apply_overrides, from_flat_text, to_flat_text
from jaxlearn.experiments import get_experiment, golden_texts

TEXTS = golden_texts()
_INT_LINE = re.compile(r"^(?P<path>[\w.\[\]]+): (?P<value>-?\d+)$", re.M)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_golden_text_round_trips(name):
    text = TEXTS[name]
    assert to_flat_text(from_flat_text(text, where=name)) == text


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data())
def test_edited_golden_text_round_trips(name, data):
    cfg = from_flat_text(TEXTS[name])
    paths = [m["path"] for m in _INT_LINE.finditer(TEXTS[name])]
    picked = data.draw(st.lists(st.sampled_from(paths), max_size=4, unique=True))
    values = data.draw(st.lists(st.integers(1, 10**6), min_size=len(picked),
                                max_size=len(picked)))
    apply_overrides(cfg, [f"{p}={v}" for p, v in zip(picked, values)])
    text = to_flat_text(cfg)
    assert to_flat_text(from_flat_text(text)) == text


def test_rebuilt_recipe_builds_the_same_model():
    recipe = get_experiment("tiny-llama")
    rebuilt = from_flat_text(to_flat_text(recipe))
    a = recipe.model.clone(name="model").instantiate().create_parameter_specs_recursively()
    b = rebuilt.model.clone(name="model").instantiate().create_parameter_specs_recursively()
    shapes = [jax.tree.map(lambda s: tuple(s.shape), t, is_leaf=lambda x: hasattr(x, "shape"))
              for t in (a, b)]
    assert shapes[0] == shapes[1]
