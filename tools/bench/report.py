"""Summarises tools/bench/results/*.jsonl into results/summary.md and results/*.png.

For each group the newest run (`run_id`) is used unless `--all-runs`; every figure is the
median over that run's processes. `python report.py [--all-runs]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from common import LLAMA, MIXTRAL, matmul_params_per_token

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CATALOGUE_CPU_PEAK = 1e11  # jaxlearn.mesh catalogue "cpu": nominal, not a measurement.

TARGETS = {
    "train_bf16": 1.3, "train_f32": 0.95, "peak_share": 0.60, "decode": 1.2,
    "continuous": 1.5, "b1_bandwidth": 0.70, "ckpt_blocking": 0.05, "ckpt_write": 0.50,
}


def load(group: str, all_runs: bool) -> list[dict]:
    path = RESULTS / f"{group}.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("ok")]
    if not recs or all_runs:
        return recs
    newest = max(r["run_id"] for r in recs)
    return [r for r in recs if r["run_id"] == newest]


CLEAN_UTIL = 0.8  # Runs whose process got less of the 2 cores were contended by others.


def clean(rs: list[dict]) -> list[dict]:
    """The runs with cpu_util >= CLEAN_UTIL if there are any, else all of them."""
    good = [r for r in rs if (r.get("cpu_util") or 0) >= CLEAN_UTIL]
    return good or rs


def med(xs: Iterable[Optional[float]]) -> Optional[float]:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def f(x: Optional[float], spec: str = ".3g", none: str = "–") -> str:
    if x is None:
        return none
    return format(x, spec)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def mark(ok: Optional[bool]) -> str:
    return "–" if ok is None else ("met" if ok else "**missed**")


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def conditions(recs: list[dict]) -> str:
    idle = med(r.get("idle_before") for r in recs)
    util = med(r.get("cpu_util") for r in recs if "cpu_util" in r)
    s = f"{len(recs)} processes, median idle before start {f(idle, '.0%')}"
    if util is not None:
        s += f", median cpu_util {f(util, '.2f')}"
    return s


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--all-runs", action="store_true")
    args = p.parse_args(argv)
    md: list[str] = []
    targets: list[list[str]] = []
    plots: list[str] = []
    A = args.all_runs

    # ---- peak ---------------------------------------------------------------------------
    peak = load("peak", A)
    pk: dict[str, dict[str, Optional[float]]] = defaultdict(dict)
    for fw in ("jaxlearn", "torch"):
        rs = [r for r in peak if r["framework"] == fw]
        for k in ("matmul_f32_gflops", "matmul_bf16_gflops", "matmul_bf16_f32acc_gflops",
                  "read_bw_gbs"):
            pk[fw][k] = med(r.get(k) for r in rs)
    jpeak = {"f32": pk["jaxlearn"].get("matmul_f32_gflops"),
             "bf16": pk["jaxlearn"].get("matmul_bf16_f32acc_gflops")}
    tpeak = {"f32": pk["torch"].get("matmul_f32_gflops"),
             "bf16": pk["torch"].get("matmul_bf16_gflops")}
    # The decode limit: the best read bandwidth either framework reached in this run.
    bw = max((r.get("read_bw_best_gbs") or r.get("read_bw_gbs") or 0.0) for r in peak) or None
    all_peaks = load("peak", True)

    def peaks_for(recs: list[dict]) -> tuple[dict, dict, Optional[float]]:
        """The peaks measured in the same suite run as `recs` (else the newest run's)."""
        run = recs[0]["run_id"] if recs else None
        same = [r for r in all_peaks if r["run_id"] == run] or peak
        j = [r for r in same if r["framework"] == "jaxlearn"]
        t = [r for r in same if r["framework"] == "torch"]
        return ({"f32": med(r.get("matmul_f32_gflops") for r in j),
                 "bf16": med(r.get("matmul_bf16_f32acc_gflops") for r in j)},
                {"f32": med(r.get("matmul_f32_gflops") for r in t),
                 "bf16": med(r.get("matmul_bf16_gflops") for r in t)},
                max((r.get("read_bw_best_gbs") or r.get("read_bw_gbs") or 0.0)
                    for r in same) or None)
    cpu = peak[0]["cpu"] if peak else "?"
    md.append("## Performance (CPU, measured by `tools/bench/run.sh`)\n")
    md.append(f"Machine: {cpu}, {peak[0]['cores'] if peak else '?'} cores. Every figure is the "
              "median over separate processes; jaxlearn and PyTorch processes alternate. "
              "Commit " + (peak[0]["commit"] if peak else "?") + ".\n")
    if peak:
        md.append("### Peaks (the MFU denominators and the decode limit)\n")
        md.append(table(["", "jaxlearn (JAX " + peak[0].get("version", "") + ")", "torch"], [
            ["matmul 2048² f32, GFLOP/s", f(pk["jaxlearn"]["matmul_f32_gflops"]),
             f(pk["torch"]["matmul_f32_gflops"])],
            ["matmul 2048² bf16×bf16→f32, GFLOP/s", f(jpeak["bf16"]), "–"],
            ["matmul 2048² bf16→bf16, GFLOP/s", f(pk["jaxlearn"]["matmul_bf16_gflops"]),
             f(pk["torch"]["matmul_bf16_gflops"])],
            ["read bandwidth (sum over 1 GiB), median GB/s", f(pk["jaxlearn"]["read_bw_gbs"]),
             f(pk["torch"]["read_bw_gbs"])],
            ["read bandwidth, best repeat of any process (the decode limit), GB/s", f(bw), ""],
        ]))
        md.append(f"\n{conditions(peak)}.\n")

    # ---- training -----------------------------------------------------------------------
    train_rows, plot_train = [], []
    for group, cfg in (("train", LLAMA), ("mixtral", MIXTRAL)):
        recs = [r for r in load(group, A) if r.get("bench") == "train"]
        if not recs:
            continue
        model = "llama" if group == "train" else "mixtral"
        jpeak, tpeak, _ = peaks_for(recs)
        for dtype in ("f32", "bf16"):
            j_all = [r for r in recs if r["framework"] == "jaxlearn" and r["dtype"] == dtype]
            t_all = [r for r in recs if r["framework"] == "torch" and r["dtype"] == dtype]
            j, t = clean(j_all), clean(t_all)
            if not j and not t:
                continue
            js, ts = med(r["step_s"] for r in j), med(r["step_s"] for r in t)
            jt, tt = med(r["tokens_per_s"] for r in j), med(r["tokens_per_s"] for r in t)
            jg, tg = med(r["model_gflops"] for r in j), med(r["model_gflops"] for r in t)
            rt = ratio(jt, tt)
            mfu_j = ratio(jg, jpeak[dtype])
            mfu_t = ratio(tg, tpeak[dtype])
            train_rows.append([
                model, dtype, f(js), f(jt, ".0f"), f(ts), f(tt, ".0f"), f(rt, ".2f") + "×",
                f(jg, ".0f"), f(mfu_j, ".0%"), f(ratio(jg * 1e9 if jg else None,
                                                      CATALOGUE_CPU_PEAK), ".0%"),
                f(mfu_t, ".0%"), f(ratio(jg, tpeak[dtype]), ".0%"),
                f"{len(j)}/{len(t)} of {len(j_all)}/{len(t_all)}",
                f(med(r.get("cpu_util") for r in j), ".2f") + "/"
                + f(med(r.get("cpu_util") for r in t), ".2f"),
            ])
            plot_train.append((f"{model}\n{dtype}", jt, tt))
            goal = TARGETS["train_bf16" if dtype == "bf16" else "train_f32"]
            targets.append([f"train {model} {dtype} tokens/s vs torch"
                            + (" autocast" if dtype == "bf16" else " f32"),
                            f"≥ {goal}×", f(rt, ".2f") + "×",
                            mark(None if rt is None else rt >= goal)])
            if model == "llama":
                targets.append([f"train {dtype} FLOP/s share of JAX's own matmul peak",
                                f"≥ {TARGETS['peak_share']:.0%}", f(mfu_j, ".0%"),
                                mark(None if mfu_j is None else mfu_j >= TARGETS["peak_share"])])
    if train_rows:
        md.append("### Training throughput (fwd + bwd + AdamW, batch 4 × 256)\n")
        md.append("The ~60M Llama (8 layers, hidden 512, 8 heads, FFN 1376, vocab 32000) and "
                  "the Mixtral-style one (8 experts, top-2). jaxlearn: the `Trainer` step "
                  "(f32 params; bf16 = compute dtype bfloat16). torch: HF "
                  "`LlamaForCausalLM`/`MixtralForCausalLM` + AdamW + grad clipping; bf16 = "
                  "`torch.autocast('cpu', bfloat16)`. Model FLOPs = 6·(matmul params per "
                  "token) + 12·layers·hidden·seq per token. MFU columns: achieved model FLOP/s "
                  "over JAX's matmul peak for the dtype measured in the same suite run (f32; "
                  "bf16×bf16→f32), the "
                  "jaxlearn hardware catalogue's nominal CPU figure (1e11, not a measurement), "
                  "torch over its own peak, and jaxlearn over torch's peak.\n")
        md.append(table(["model", "dtype", "jaxlearn s/step", "jaxlearn tok/s", "torch s/step",
                         "torch tok/s", "jaxlearn/torch", "jaxlearn GFLOP/s",
                         "MFU vs JAX peak", "vs catalogue", "torch MFU (own peak)",
                         "jaxlearn vs torch peak", "runs used j/t", "cpu_util j/t"], train_rows))
        md.append(f"\nRuns used: those whose process got >= {CLEAN_UTIL:.0%} of the cores "
                  "(cpu_util; others were contended by other work on the shared machine), "
                  "all runs where none did.\n")
        md.append("")
    # ---- compile vs depth ---------------------------------------------------------------
    comp = [r for r in load("compile", A) if r.get("bench") == "train"]
    plot_comp: dict[str, list[tuple[int, float]]] = defaultdict(list)
    if comp:
        rows = []
        for layers in sorted({r["layers"] for r in comp}):
            cells = [str(layers)]
            for stack in ("loop", "scan"):
                rs = clean([r for r in comp if r["layers"] == layers and r["stack"] == stack])
                c = med(r["lower_s"] + r["compile_s"] for r in rs)
                cells += [f(c, ".3g"), f(med(r.get("step_s") for r in rs), ".3g")]
                if c is not None:
                    plot_comp[stack].append((layers, c))
            rows.append(cells)
        md.append("### Train-step compile time vs depth (bf16, trace + lower + compile)\n")
        md.append(table(["layers", "loop compile s", "loop s/step", "scan compile s",
                         "scan s/step"], rows))
        md.append(f"\n{conditions(comp)}.\n")

    # ---- decode -------------------------------------------------------------------------
    dec = [r for r in load("decode", A) if r.get("bench") == "decode"]
    bw = peaks_for(dec)[2] if dec else bw
    plot_dec: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    if dec:
        rows = []
        for dtype in ("f32", "bf16"):
            jl = [r for r in dec if r["framework"] == "jaxlearn" and r["case"] == "latency"
                  and r["dtype"] == dtype]
            tl = [r for r in dec if r["framework"] == "torch" and r["case"] == "latency"
                  and r["dtype"] == dtype]
            batches = sorted({row["batch"] for r in jl + tl for row in r["rows"]})
            for b in batches:
                def pick(rs: list[dict], k: str) -> Optional[float]:
                    return med(row[k] for r in rs for row in r["rows"] if row["batch"] == b)
                jm, tm = pick(jl, "ms_per_token"), pick(tl, "ms_per_token")
                jp, tp = pick(jl, "prefill_ms"), pick(tl, "prefill_ms")
                rt = ratio(tm, jm)
                bw_frac = None
                if b == 1 and jm and bw:
                    item = 4 if dtype == "f32" else 2
                    c = LLAMA
                    kv = c["layers"] * 2 * c["kv_heads"] * (c["dim"] // c["heads"]) * item
                    nbytes = matmul_params_per_token(c) * item + kv * 256
                    bw_frac = nbytes / (bw * 1e9) / (jm / 1e3)
                    ok = bw_frac >= TARGETS["b1_bandwidth"] if dtype == "f32" else None
                    if dtype == "f32":
                        targets.append(["B1 f32 decode share of the bandwidth limit",
                                        f"≥ {TARGETS['b1_bandwidth']:.0%}", f(bw_frac, ".0%"),
                                        mark(ok)])
                rows.append([dtype, str(b), f(jp, ".3g"), f(tp, ".3g"), f(jm, ".3g"),
                             f(tm, ".3g"), f(rt, ".2f") + "×",
                             f(ratio(tp, jp), ".2f") + "×", f(bw_frac, ".0%")])
                targets.append([f"decode {dtype} B{b} tokens/s vs HF generate",
                                f"≥ {TARGETS['decode']}×", f(rt, ".2f") + "×",
                                mark(None if rt is None else rt >= TARGETS["decode"])])
                if jm and tm:
                    plot_dec[dtype].append((b, jm, tm))
        md.append("### Decode (greedy, prompt 128, 64 new tokens; per token = "
                  "(t(1+64) − t(1)) / 64)\n")
        md.append("jaxlearn: the inference `Engine` (continuous-batching scheduler, paged KV "
                  "cache, batched prefill, fused 8-step decode bursts). torch: HF `generate` "
                  "(dynamic KV cache). bf16 = bf16 weights and compute on both sides. The "
                  "bandwidth share is (matmul weight bytes + KV window bytes) / measured read "
                  "bandwidth / step time.\n")
        md.append(table(["dtype", "batch", "jaxlearn prefill ms", "HF prefill ms",
                         "jaxlearn ms/token", "HF ms/token", "jaxlearn/HF tok/s",
                         "prefill speed-up", "B1 share of bandwidth limit"], rows))
        crow = []
        for dtype in ("f32", "bf16"):
            j = med(r["generated_tokens_per_s"] for r in dec if r["framework"] == "jaxlearn"
                    and r["case"] == "continuous" and r["dtype"] == dtype)
            t = med(r["generated_tokens_per_s"] for r in dec if r["framework"] == "torch"
                    and r["case"] == "continuous" and r["dtype"] == dtype)
            if j is None and t is None:
                continue
            rt = ratio(j, t)
            crow.append([dtype, f(j, ".0f"), f(t, ".0f"), f(rt, ".2f") + "×"])
            targets.append([f"continuous batching {dtype} tokens/s vs HF",
                            f"≥ {TARGETS['continuous']}×", f(rt, ".2f") + "×",
                            mark(None if rt is None else rt >= TARGETS["continuous"])])
        if crow:
            ex = next(r for r in dec if r["case"] == "continuous")
            md.append(f"\nContinuous batching: {ex['requests']} requests, prompts 16–256 and "
                      f"outputs 16–128 tokens, all queued at once, {ex['slots']} slots. "
                      "jaxlearn: the Engine's scheduler; HF: static batches of "
                      f"{ex['slots']} in arrival order (left-padded, each batch runs to its "
                      "longest output). Only requested tokens count.\n")
            md.append(table(["dtype", "jaxlearn tok/s", "HF tok/s", "ratio"], crow))
        md.append(f"\n{conditions(dec)}.\n")

    # ---- checkpoint ---------------------------------------------------------------------
    ck = [r for r in load("ckpt", A) if r.get("bench") == "ckpt"]
    if ck:
        blk = med(r["save_blocking_s"] for r in ck)
        frac = med(r["blocking_frac_of_step"] for r in ck)
        wr = med(r["write_vs_raw"] for r in ck)
        reuse = [r["reuse_bench"] for r in ck if r.get("reuse_bench")]
        md.append("### Checkpoint (60M Llama train state: params + AdamW, f32)\n")
        md.append("save blocks: median over warm saves inside the training loop (the first, "
                  "set-up save is shown apart); steps during write: step time while the "
                  "background write runs; commit/write GB/s: save until committed with nothing "
                  "else running; raw disk: the faster of one numpy file and 8 threads of "
                  "16 MiB files, fsynced, measured right before each such save; write/raw: "
                  "the median of the per-save ratios.\n")
        md.append(table(["state", "step s", "first save blocks s", "save blocks s",
                         "share of a step",
                         "steps during write s", "commit s", "write GB/s", "raw disk GB/s",
                         "write/raw", "restore s"], [[
            f(med(r["state_bytes"] for r in ck) / 1e6, ".0f") + " MB",
            f(med(r["step_s"] for r in ck)), f(med(r.get("first_save_blocking_s") for r in ck)),
            f(blk), f(frac, ".1%"),
            f(med(r["step_s_during_write"] for r in ck)), f(med(r["commit_s"] for r in ck)),
            f(med(r["write_gbs"] for r in ck)), f(med(r["raw_disk_gbs"] for r in ck)),
            f(wr, ".0%"), f(med(r["restore_s"] for r in ck))]]))
        if reuse:
            u = reuse[-1]
            md.append(f"\npackages/checkpoint/bench on a {u['state_gib']} GiB state (8 fake "
                      f"devices): blocking {u['save_blocking_s_median']} s, save "
                      f"{u['save_gb_per_s_median']} GB/s = {u['save_vs_raw_disk']:.0%} of raw "
                      f"disk ({u['raw_disk_write_gb_per_s']} GB/s), restore "
                      f"{u['restore_s'].get('same_sharding')} s.\n")
        targets.append(["async checkpoint blocking share of a 60M step",
                        f"≤ {TARGETS['ckpt_blocking']:.0%}", f(frac, ".1%"),
                        mark(None if frac is None else frac <= TARGETS["ckpt_blocking"])])
        targets.append(["checkpoint write throughput vs raw disk",
                        f"≥ {TARGETS['ckpt_write']:.0%}", f(wr, ".0%"),
                        mark(None if wr is None else wr >= TARGETS["ckpt_write"])])

    # ---- memory -------------------------------------------------------------------------
    mem = [r for r in load("memory", A) if r.get("bench") == "memory"]
    plot_mem: list[tuple[int, float, float]] = []
    fs = [r for r in mem if r["part"] == "fsdp"]
    if fs:
        r = fs[-1]
        rows = []
        base = {x["n"]: x for x in r["llama"]}.get(1)
        tbase = {x["n"]: x for x in r["toy"]}.get(1)
        for x in r["llama"]:
            t = next((y for y in r["toy"] if y["n"] == x["n"]), None)
            rows.append([str(x["n"]), f(x["state_bytes"] / 1e6, ".1f"),
                         f(ratio(x["state_bytes"], base["state_bytes"]) if base else None, ".3f"),
                         f(1 / x["n"], ".3f"), f(x["temp_bytes"] / 1e6, ".1f"),
                         f(ratio(t["state_bytes"], tbase["state_bytes"]) if t and tbase
                           else None, ".3f")])
            if base:
                plot_mem.append((x["n"], x["state_bytes"] / base["state_bytes"], 1 / x["n"]))
        md.append("### Memory: AOT per-device train-step memory under FSDP over N devices\n")
        md.append("60M Llama (scan stack, bf16 compute, batch max(4, N) × 256) on N fake CPU "
                  "devices, and the reused packages/runtime/bench/bench_fsdp_memory.py toy.\n")
        md.append(table(["N", "Llama state MB/device", "Llama state vs N=1", "ideal 1/N",
                         "Llama temp MB/device", "toy state vs N=1"], rows))
        md.append("")
    rm = [r for r in mem if r["part"] == "remat"]
    if rm and any("stack" in r for r in rm):
        md.append("### Memory: activations (AOT temp bytes of the 60M train step, bf16)\n")
        pols = list(dict.fromkeys(r["remat"] for r in rm))
        rows = []
        for pol in pols:
            cells = [pol]
            for stack in ("loop", "scan"):
                v = [r["temp_bytes"] for r in rm if r["remat"] == pol
                     and r.get("stack", "loop") == stack]
                cells.append(f(v[-1] / 1e6, ".0f") if v else "–")
            rows.append(cells)
        md.append(table(["remat policy", "loop stack temp MB", "scan stack temp MB"], rows))
        md.append("")
    elif rm:
        md.append("### Memory: activations (AOT temp bytes of the 60M train step, bf16, "
                  "loop stack)\n")
        md.append(table(["remat policy", "temp MB"], [
            [r["remat"], f(r["temp_bytes"] / 1e6, ".0f")] for r in rm]))
        md.append("")

    # ---- targets + plots ----------------------------------------------------------------
    if targets:
        md.insert(2, "### Targets\n\n" + table(
            ["target", "goal", "measured", "status"], targets) + "\n")
    notes = HERE / "analysis.md"
    if notes.exists():  # Hand-written: why targets are missed, profiles, fixes.
        md.append(notes.read_text().rstrip() + "\n")
    plots = make_plots(plot_train, plot_comp, plot_dec, plot_mem)
    if plots:
        md.append("### Plots\n")
        md += [f"![{p}]({p})" for p in plots]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {RESULTS / 'summary.md'}" + (f" and {len(plots)} plots" if plots else ""))


def make_plots(train: list, comp: dict, dec: dict, mem: list) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    out = []
    if train:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        xs = range(len(train))
        ax.bar([x - 0.2 for x in xs], [t[1] or 0 for t in train], 0.4, label="jaxlearn")
        ax.bar([x + 0.2 for x in xs], [t[2] or 0 for t in train], 0.4, label="PyTorch + HF")
        ax.set_xticks(list(xs), [t[0] for t in train])
        ax.set_ylabel("tokens/s")
        ax.set_title("Training throughput (batch 4 x 256)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "train.png", dpi=110)
        out.append("train.png")
    if comp:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for stack, pts in comp.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{stack} stack")
        ax.set_xlabel("layers")
        ax.set_ylabel("compile s")
        ax.set_title("Train-step compile time vs depth")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "compile.png", dpi=110)
        out.append("compile.png")
    if dec:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for dtype, pts in dec.items():
            pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"jaxlearn {dtype}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label=f"HF {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per decode step")
        ax.set_title("Decode latency per token")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "decode.png", dpi=110)
        out.append("decode.png")
    if mem:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        mem = sorted(mem)
        ax.plot([m[0] for m in mem], [m[1] for m in mem], "o-", label="measured (state)")
        ax.plot([m[0] for m in mem], [m[2] for m in mem], "k:", label="1/N")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (FSDP)")
        ax.set_ylabel("per-device state vs N=1")
        ax.set_title("FSDP per-device memory")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / "fsdp_memory.png", dpi=110)
        out.append("fsdp_memory.png")
    return out


if __name__ == "__main__":
    main()
