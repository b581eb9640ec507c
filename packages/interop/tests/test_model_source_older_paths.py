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


def test_model_source_reads_a_step_with_the_stack_in_its_other_form(tmp_path):
    """A run saved with its layers scanned (params stacked [layers, ...]) as the first
    params of a model that loops over them (the CPU fine-tuning rule), and back: each
    layer's params are the saved ones, LoRA adapters the run lacks left out."""
    from jaxlearn.layers import llama_config, swapped_stack, use_lora

    scan_cfg = llama_config(64, 16, 3, 2, 1, 32, stack="scan").set(name="model")
    loop_cfg = scan_cfg.clone()
    loop_cfg.decoder.transformer = swapped_stack(scan_cfg.decoder.transformer)[0]
    for saved_cfg, model_cfg in ((scan_cfg, use_lora(loop_cfg, rank=2)), (loop_cfg, scan_cfg)):
        saved = jax.tree.map(np.asarray, saved_cfg.instantiate()
                             .initialize_parameters_recursively(jax.random.key(0)))
        root = tmp_path / saved_cfg.decoder.transformer.klass.__name__
        ckpt = Checkpointer.default_config().set(directory=str(root)).instantiate()
        ckpt.save(1, {"params": saved})
        ckpt.wait_until_finished()
        ckpt.close()
        model = model_cfg.instantiate()
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, model.create_parameter_specs_recursively(),
                                 is_leaf=lambda x: isinstance(x, ParameterSpec))
        params = open_model(root).load(model, shardings)
        got = jax.tree.map(np.asarray, params)
        _, want = swapped_stack(saved_cfg.decoder.transformer, saved["decoder"]["transformer"])
        np.testing.assert_array_equal(got["decoder"]["emb"]["weight"],
                                      saved["decoder"]["emb"]["weight"])
        jax.tree.map(np.testing.assert_array_equal, got["decoder"]["transformer"], want)
