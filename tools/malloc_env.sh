# Sourced by tools/jaxlearn and tools/bench/run.sh before they start Python.
#
# XLA:CPU allocates an executable's temp buffer afresh on every call (749 MB for the 60M
# Llama train step). glibc serves blocks that large with mmap and unmaps them on free, so
# every step page-faults its whole temp buffer again (~180k minor faults, 0.3-0.45 s of
# kernel time per step on the 2-core dev machine). One arena, no mmap for large blocks and
# no trimming keep the freed buffer mapped for the next step: measured 1.26x (bf16) and
# 1.28x (f32) train tokens/s on that model, for ~0.8 GB more resident memory. (PyTorch's
# CPU allocator has the same problem and gains the same; the bench gives both sides these
# settings.) The settings only take effect at process start, hence here and not in Python.
# Opt out with JAXLEARN_MALLOC_TUNING=0, or by setting any MALLOC_* / GLIBC_TUNABLES yourself.
if [ "${JAXLEARN_MALLOC_TUNING:-1}" != 0 ] \
  && [ -z "${MALLOC_ARENA_MAX:-}${MALLOC_MMAP_MAX_:-}${MALLOC_TRIM_THRESHOLD_:-}${MALLOC_TOP_PAD_:-}${GLIBC_TUNABLES:-}" ]; then
  export MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824
fi
