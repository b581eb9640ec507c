"""Shared steps of the HF parity tests (test_hf, test_gemma*, test_qwen3, test_phi3): the
fixture references made offline by fixtures/make_*.py, jitted logits, greedy tokens
through the paged Engine, the export -> import identity and the recorded transformers
checks of our exports."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jaxlearn.inference import Engine
from jaxlearn.interop import export_hf, load_hf
from jaxlearn.module import functional

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def reference(name):
    """fixtures/hf_<name>/reference.npz: transformers' ids, logits and greedy tokens."""
    return np.load(FIXTURES / f"hf_{name}" / "reference.npz", allow_pickle=False)


def run_logits(config, params, ids):
    """Jitted `CausalLM.logits` of `config` with `params` on ids [batch, seq]."""
    model = config.instantiate()
    fn = jax.jit(
        lambda p, x: functional(
            model, None, p, ({"input_ids": x},), method="logits", is_training=False
        )[0]
    )
    return np.asarray(fn(params, jnp.asarray(ids)))


def paged_greedy(loaded, prompt_ids, new, *, prefill_chunk=4):
    """Greedy tokens of both prompt rows batched through the Engine with 4-token pages,
    `prefill_chunk`-token prefill chunks and 4-token decode bursts."""
    engine = (
        Engine.default_config()
        .set(max_seq_len=32, max_batch=2, page_size=4, prefill_chunk=prefill_chunk,
             decode_burst=4)
        .instantiate(model_cfg=loaded.config, params=loaded.params, tokenizer=None)
    )
    prompts = [[int(t) for t in row] for row in prompt_ids]
    results = engine.generate(prompts, max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return [r.tokens for r in results]


def assert_paged_greedy_matches(name):
    """fixtures/hf_<name> through `paged_greedy` gives transformers' greedy tokens."""
    loaded = load_hf(FIXTURES / f"hf_{name}")
    ref = reference(name)
    assert float(ref["greedy_margin"]) > 1e-3  # no near-ties in the reference
    tokens = paged_greedy(loaded, ref["prompt_ids"], ref["greedy_ids"].shape[1])
    np.testing.assert_array_equal(tokens, ref["greedy_ids"])


def assert_export_roundtrip(name, tmp_path):
    """export_hf of fixtures/hf_<name> loads back with the same architecture and params
    and writes exactly the fixture's tensors; returns the exported config.json."""
    loaded = load_hf(FIXTURES / f"hf_{name}")
    out = export_hf(
        tmp_path / "export",
        loaded.config,
        loaded.params,
        bos_token_id=loaded.bos_token_id,
        eos_token_ids=loaded.eos_token_ids,
        max_position_embeddings=loaded.architecture.max_position_embeddings,
    )
    again = load_hf(out)
    assert again.architecture == loaded.architecture
    jax.tree.map(np.testing.assert_array_equal, again.params, loaded.params)
    original = load_file(str(FIXTURES / f"hf_{name}" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for tensor, value in original.items():
        np.testing.assert_array_equal(exported[tensor], value, err_msg=tensor)
    return json.loads((out / "config.json").read_text())


def export_check_classes(file_name):
    """{case: HF class} of a recorded transformers check of our exports (fixtures/
    <file_name>, written by a make_*_fixtures.py --stage export), after asserting every
    case's logits matched (<= 1e-4) on a non-trivial scale (> 1)."""
    cases = json.loads((FIXTURES / file_name).read_text())["cases"]
    for case, result in cases.items():
        assert result["max_abs_logit_error"] <= 1e-4, (case, result)
        assert result["logit_scale"] > 1.0, case  # not a trivial comparison
    return {case: result["hf_class"] for case, result in cases.items()}
