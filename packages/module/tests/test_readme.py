"""The README's "Writing a new layer" example runs and stays under 30 lines."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def layer_example() -> str:
    text = README.read_text()
    section = text.split("## Writing a new layer", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in the 'Writing a new layer' section"
    return match.group(1)


def test_new_layer_example_runs_in_under_30_lines() -> None:
    code = layer_example()
    assert len(code.strip().splitlines()) < 30
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    y, collection = namespace["y"], namespace["collection"]
    assert y.shape == (2, 8)
    assert set(collection.summaries) == {"output_norm"}
    specs = namespace["layer"].create_parameter_specs_recursively()
    assert specs["w"].mesh_axes == ("embed", "mlp") and specs["scale"].dtype == jnp.float32
