"""How far int8 serving moves SmolLM2-135M-Instruct's next-token distributions from the f32
model's, teacher-forced on a fixed text: top-1 agreement and mean KL(f32 || served) per
position, for bf16 weights and compute, and int8 weights (`--quantize int8`: weights per
output channel, activations per row) with bf16 or f32 compute, each as the engine serves
it on this host (packed for oneMKL where `weight_layout="auto"` packs).

    tools/jaxlearn python tools/bench/jl_int8_quality.py --model SmolLM2-135M-Instruct.Q4_1.gguf

Prints one JSON line per setting, with the host's CPU and SIMD flags.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import host_cpu

TEXT = (
    "The river ran past the old stone bridge and into the quiet city, where the market "
    "stalls were opening one by one. A baker set out loaves of bread while two children "
    "chased a dog across the square. In the library, the oldest book described how the "
    "bridge had been built three hundred years ago by a guild of masons who came from the "
    "mountains. def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) "
    "+ fibonacci(n - 2)\n\nQuestion: What is the capital of France? Answer: The capital of "
    "France is Paris. Question: How many legs does a spider have? Answer:")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    from jaxlearn.inference import Engine
    from jaxlearn.interop import load_pretrained

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    args = p.parse_args()
    settings = [("f32", "float32", None, "in_out"), ("bf16", "bfloat16", None, "auto"),
                ("int8/bf16", "bfloat16", "int8", "auto"), ("int8/f32", "float32", "int8", "auto"),
                ("int8/f32 xla", "float32", "int8", "in_out")]
    ref = None
    for name, dtype, quantize, layout in settings:
        loaded = load_pretrained(args.model, dtype=dtype, param_dtype=dtype, stack="scan")
        cfg = Engine.default_config().set(max_seq_len=512, max_batch=1, quantize=quantize,
                                          weight_layout=layout)
        engine = cfg.instantiate(model_cfg=loaded.config, params=loaded.params,
                                 tokenizer=loaded)
        ids = loaded.encode(TEXT)
        lp = _log_softmax(np.asarray(engine.logits([ids]))[0, : len(ids) - 1])
        if ref is None:
            ref = lp
        kl = float(np.mean(np.sum(np.exp(ref) * (ref - lp), -1)))
        top1 = float(np.mean(ref.argmax(-1) == lp.argmax(-1)))
        nll = float(-np.mean(lp[np.arange(len(ids) - 1), ids[1:]]))
        rec = dict(bench="int8_quality", host=host_cpu(), setting=name,
                   packed=engine.packed_weights is not None, positions=len(ids) - 1,
                   top1_agree=round(top1, 4), kl=round(kl, 5), nll=round(nll, 4))
        print(json.dumps(rec), flush=True)
        del engine, loaded


if __name__ == "__main__":
    main()
