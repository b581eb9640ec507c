"""Do transformers and llama.cpp load what jaxlearn exports, and compute the same thing?

Two stages, so that each runs in the venv that has its packages (not run in CI):

    # 1. project venv: tiny random Llama / Qwen2 / Mixtral / Gemma 2 / Gemma 3 models (or
    #    --init PATH, a real HF directory or GGUF file) exported with export_hf and
    #    export_gguf (f32/f16/q8_0),
    #    with jaxlearn's reference logits, token ids, chat rendering and greedy tokens.
    python tools/bench/export_check.py export --out /tmp/export_check
    # 2. a venv with torch + transformers and/or llama-cpp-python (+ numpy); jaxlearn is
    #    not imported. Appends one JSON line per check to tools/bench/results/export_check.jsonl.
    python tools/bench/export_check.py check --out /tmp/export_check

Checks per case: transformers `AutoConfig` / `AutoTokenizer` / `GenerationConfig` load the
HF export, its ids, `apply_chat_template` text and ids and special ids equal jaxlearn's (no
torch needed); `AutoModelForCausalLM` logits vs jaxlearn's (max abs diff) and greedy
tokens (needs torch);
llama.cpp (`llama_cpp.Llama`) tokenization (with BOS and special tokens parsed) equal,
last-position logits (max abs diff, argmax agreement) and greedy tokens, the chat
template read from the file's metadata equal. A package that is not importable is
recorded as skipped, never as a pass. `--question` sets the chat prompt's user turn and
`--new_tokens` the greedy length; each peer's greedy answer is recorded as text next to
jaxlearn's, e.g. for a fine-tuned run's HF export (`jaxlearn export --format hf`):

    python tools/bench/export_check.py export --init runs/glowpine-hf --out /tmp/ec \
        --question "How long does the Glowpine battery last?" --new_tokens 24
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import sys
import time
from typing import Any

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "export_check.jsonl"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "The quick brown fox? 12 apples!"}]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "345 pears, héllo wörld"]
GGUF_DTYPES = ("f32", "f16", "q8_0")
NEW_TOKENS = 8


# ---- stage 1: export (project venv) ---------------------------------------------------------


def _tiny_bpe(qwen2_pre_tokenizer: bool = False) -> Any:
    """A byte-level BPE trained on a line of text: GPT-2 pre-tokenizer, or Qwen2's (the
    one transformers 5 imposes on `qwen2` models, whatever tokenizer.json says)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlearn.text.tokenizer_export import _QWEN2_REGEX

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen2_pre_tokenizer:
        split = pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=316,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXTS[0] + " 12 apples, 345 pears!"] * 50, trainer)
    return tok


def _tiny_cases() -> list[tuple[str, Any, Any, Any, Any]]:
    """(name, config, params, tokenizer, chat template) of the tiny random models."""
    import jax

    from jaxlearn.config import replace_config
    from jaxlearn.layers import FeedForward, gemma2_config, gemma3_config, llama_config
    from jaxlearn.layers.moe import MixtureOfExperts
    from jaxlearn.text.chat import ChatTemplate
    from jaxlearn.text.tokenizers import ByteTokenizer

    def config(**kw: Any) -> Any:
        return llama_config(vocab_size=320, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_dim=128, rope_theta=10000.0, norm_eps=1e-5, **kw)  # fmt: skip

    # Gemma with the query scale llama.cpp derives (head_dim); windows shorter than the
    # chat prompt; gemma3: 5 local + 1 global + 1 local layers, MQA, no final soft cap (as
    # the released Gemma 3; older llama.cpp builds do not read gemma3.final_logit_softcapping).
    gemma = dict(vocab_size=320, dim=64, num_heads=4, ffn_dim=128, head_dim=16,
                 query_pre_attn_scalar=16, norm_eps=1e-6, stack="loop")  # fmt: skip
    gemma2 = gemma2_config(num_layers=4, num_kv_heads=2, sliding_window=6, **gemma)
    gemma3 = gemma3_config(num_layers=7, num_kv_heads=1, sliding_window=5, **gemma)
    qwen = config(family="qwen2")
    qwen.decoder.transformer.layer.self_attention.qkv_bias = True
    moe = MixtureOfExperts.default_config().set(num_experts=4, num_experts_per_token=2)
    chat = ChatTemplate(CHATML, bos_token="<|im_start|>", eos_token="<|im_end|>")
    byte_chat = ChatTemplate(CHATML, bos_token="<s>", eos_token="</s>")
    bpe, byte = _tiny_bpe(), ByteTokenizer.default_config().instantiate()
    cases = []
    for seed, (name, cfg, tok, tmpl) in enumerate([
        ("llama_bpe", config(), bpe, chat),
        ("qwen2_bpe", qwen, _tiny_bpe(qwen2_pre_tokenizer=True), chat),
        ("mixtral_bpe", replace_config(config(family="mixtral"), FeedForward, moe), bpe, chat),
        ("llama_byte", config(), byte, byte_chat),
        ("gemma2_bpe", gemma2, bpe, chat),
        ("gemma3_bpe", gemma3, bpe, chat),
    ]):  # fmt: skip
        params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(seed))
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(100 + seed), len(leaves))
        noisy = [np.asarray(x + 0.1 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
        cases.append((name, cfg, jax.tree.unflatten(tree, noisy), tok, tmpl))
    return cases


def _reference(config: Any, params: Any, hf_dir: pathlib.Path, messages: list[dict],
               new_tokens: int) -> dict[str, Any]:
    """jaxlearn's logits, ids, rendering and greedy tokens, through the exported tokenizer."""
    import jax.numpy as jnp

    from jaxlearn.interop import greedy_generate, load_pretrained
    from jaxlearn.module import functional

    loaded = load_pretrained(hf_dir)  # tokenizer + template as exported
    prompt = loaded.encode_chat(messages)
    model = config.instantiate()
    logits, _ = functional(model, None, params, ({"input_ids": jnp.asarray([prompt])},),
                           method="logits", is_training=False)  # fmt: skip
    new = [int(i) for i in np.asarray(
        greedy_generate(model, params, np.asarray([prompt]), new_tokens))[0]]
    return {
        "messages": messages,
        "prompt_ids": prompt,
        "rendered": loaded.render_chat(messages),
        "text_ids": {t: loaded.encode(t) for t in TEXTS},
        "greedy": new,
        "answer": loaded.tokenizer.decode(new),
        "logits": np.asarray(logits, np.float32)[0],
    }


def export_stage(out: pathlib.Path, init: str | None, question: str | None,
                 new_tokens: int, only: str | None = None) -> None:
    from jaxlearn.interop import export_gguf, export_hf, load_pretrained

    if init:
        loaded = load_pretrained(init)
        cases = [(pathlib.Path(init).stem, loaded.config, loaded.params, loaded.tokenizer,
                  loaded.chat_template)]  # fmt: skip
    else:
        cases = [c for c in _tiny_cases() if not only or c[0] in only.split(",")]
    for name, config, params, tok, chat in cases:
        case = out / name
        hf = export_hf(case / "hf", config, params, tokenizer=tok, chat_template=chat,
                       overwrite=True)  # a rerun into the same --out replaces its exports
        messages = [{"role": "user", "content": question}] if question else MESSAGES
        ref = _reference(config, params, hf, messages, new_tokens)
        for dtype in GGUF_DTYPES:
            export_gguf(case / f"model.{dtype}.gguf", config, params, tokenizer=tok,
                        chat_template=chat, dtype=dtype, overwrite=True)  # fmt: skip
        np.save(case / "logits.npy", ref.pop("logits"))
        ref["template"] = chat.source if chat is not None else None
        (case / "reference.json").write_text(json.dumps(ref, indent=1))
        print(f"exported {case}")


# ---- stage 2: check (a venv with transformers and/or llama-cpp-python) -------------------------


def _record(results: pathlib.Path, **fields: Any) -> None:
    fields.update(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), host=platform.node())
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.write(json.dumps(fields) + "\n")
    print(json.dumps(fields))


def _check_transformers_files(case: pathlib.Path, ref: dict[str, Any]) -> dict:
    """AutoConfig / AutoTokenizer / GenerationConfig on the HF export (no torch needed)."""
    import transformers

    hf = case / "hf"
    config = transformers.AutoConfig.from_pretrained(hf)
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    gen = transformers.GenerationConfig.from_pretrained(hf)
    messages = ref.get("messages", MESSAGES)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    return {
        "transformers": transformers.__version__,
        "config_class": type(config).__name__,
        "tokenizer_class": type(tok).__name__,
        "text_ids_equal": all(tok(t)["input_ids"] == ids for t, ids in ref["text_ids"].items()),
        "chat_template_equal": rendered == ref["rendered"],
        "chat_ids_equal": list(chat_ids) == ref["prompt_ids"],
        "decode_equal": tok.decode(ref["prompt_ids"]) == ref["rendered"],
        "special_ids": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
        "generation_ids": [gen.bos_token_id, gen.eos_token_id, gen.pad_token_id],
    }


def _check_transformers_model(
    case: pathlib.Path, ref: dict[str, Any], logits: np.ndarray
) -> dict:
    """AutoModelForCausalLM logits and greedy tokens vs jaxlearn's (needs torch)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(case / "hf", dtype=torch.float32)
    ids = torch.tensor([ref["prompt_ids"]])
    n = len(ref["greedy"])
    with torch.no_grad():
        got = model(ids).logits[0].float().numpy()
        new = model.generate(ids, max_new_tokens=n, do_sample=False,
                             min_new_tokens=n)[0, ids.shape[1]:]  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(case / "hf")
    return {
        "transformers": transformers.__version__,
        "class": type(model).__name__,
        "max_abs_logit_diff": float(np.max(np.abs(got - logits))),
        "max_abs_logit": float(np.max(np.abs(logits))),
        "greedy_equal": new.tolist() == ref["greedy"],
        "answer": tok.decode(new.tolist()),
        "jaxlearn_answer": ref.get("answer"),
    }


def _check_llama_cpp(path: pathlib.Path, ref: dict[str, Any], logits: np.ndarray) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
    text_ok = all(
        llm.tokenize(t.encode(), add_bos=True, special=True) == ids
        for t, ids in ref["text_ids"].items()
    )
    prompt = ref["prompt_ids"]
    llm.reset()
    llm.eval(prompt)
    got = np.asarray(llm.scores[: len(prompt)], np.float32)
    greedy = []
    for _ in range(len(ref["greedy"])):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    return {
        "llama_cpp": llama_cpp.__version__,
        "max_abs_logit_diff": float(np.max(np.abs(got - logits))),
        "last_position_argmax_equal": int(np.argmax(got[-1])) == int(np.argmax(logits[-1])),
        "max_abs_logit": float(np.max(np.abs(logits))),
        "text_ids_equal": text_ok,
        "chat_template_equal": llm.metadata.get("tokenizer.chat_template") == ref["template"],
        "greedy_equal": greedy == ref["greedy"],
        "answer": llm.detokenize(greedy).decode("utf-8", "replace"),
        "jaxlearn_answer": ref.get("answer"),
    }


def check_stage(out: pathlib.Path, results: pathlib.Path) -> None:
    peers = ("transformers", "torch", "llama_cpp")
    have = {m: importlib.util.find_spec(m) is not None for m in peers}
    for case in sorted(p for p in out.iterdir() if (p / "reference.json").exists()):
        ref = json.loads((case / "reference.json").read_text())
        logits = np.load(case / "logits.npy")
        base = {"case": case.name, "python": sys.version.split()[0]}
        hf = {"peer": "transformers", "format": "hf"}
        if have["transformers"]:
            _record(results, **base, **hf, part="files", **_check_transformers_files(case, ref))
        else:
            _record(results, **base, **hf, part="files", skipped="transformers not importable")
        if have["transformers"] and have["torch"]:
            result = _check_transformers_model(case, ref, logits)
            _record(results, **base, **hf, part="model", **result)
        else:
            _record(results, **base, **hf, part="model", skipped="torch not importable")
        for dtype in GGUF_DTYPES:
            if not have["llama_cpp"]:
                skipped = {"peer": "llama.cpp", "format": f"gguf {dtype}"}
                _record(results, **base, **skipped, skipped="not importable")
                continue
            result = _check_llama_cpp(case / f"model.{dtype}.gguf", ref, logits)
            _record(results, **base, peer="llama.cpp", format=f"gguf {dtype}", **result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("export", "check"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/export_check"))
    parser.add_argument("--init", help="export this HF directory / GGUF file instead")
    parser.add_argument("--question", help="the user turn of the chat prompt")
    parser.add_argument("--new_tokens", type=int, default=NEW_TOKENS, help="greedy tokens")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--cases", help="export only these tiny cases (comma-separated)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage == "export":
        export_stage(args.out, args.init, args.question, args.new_tokens, args.cases)
    else:
        check_stage(args.out, args.results)


if __name__ == "__main__":
    main()
