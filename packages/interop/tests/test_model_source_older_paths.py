"""`ModelSource.load` of a jaxlearn checkpoint: a run's params as a new run's first params;
a param the step holds under an older name (the model's `older_param_path`) is read from
there."""

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.interop import open_model
from jaxlearn.module import ParameterSpec


class _Model:
    """The two methods `ModelSource.load` reads of a model."""

    @staticmethod
    def create_parameter_specs_recursively():
        return {"proj": {"weight": ParameterSpec((4, 2), (None, None), dtype=np.float32)},
                "norm": {"scale": ParameterSpec((2,), (None,), dtype=np.float32)}}

    @staticmethod
    def older_param_path(path):
        return {"proj.weight": "proj_w"}.get(path)


def test_model_source_reads_a_renamed_param_under_its_older_name(tmp_path):
    w, s = np.arange(8, dtype=np.float32).reshape(4, 2), np.ones(2, np.float32)
    ckpt = Checkpointer.default_config().set(directory=str(tmp_path / "ckpt")).instantiate()
    ckpt.save(3, {"params": {"proj_w": w, "norm": {"scale": s}}})
    ckpt.wait_until_finished()
    ckpt.close()
    device = SingleDeviceSharding(jax.devices()[0])
    shardings = {"proj": {"weight": device}, "norm": {"scale": device}}
    source = open_model(tmp_path / "ckpt")
    params = source.load(_Model(), shardings)
    np.testing.assert_array_equal(np.asarray(params["proj"]["weight"]), w)
    np.testing.assert_array_equal(np.asarray(params["norm"]["scale"]), s)
