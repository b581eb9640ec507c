"""setuptools entry point: metadata from ./pyproject.toml, `install_requires` from
../setup_support.py (jaxlearn dependencies from this checkout when built inside one)."""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from setup_support import setup  # noqa: E402

setup(HERE)
