"""The continuous-batching workload shared by both decode benches (stdlib + numpy)."""

from __future__ import annotations


def continuous_workload(
    vocab: int, *, quick: bool = False
) -> tuple[list[list[int]], list[int], int]:
    """(prompts, output lengths, slots): 32 requests (16 quick) with prompt lengths 16..256
    and output lengths 16..128, all arriving at once, served with 8 concurrent slots."""
    import numpy as np

    rng = np.random.default_rng(1234)
    n = 16 if quick else 32
    lens = rng.integers(16, 257, size=n)
    outs = rng.integers(16, 129, size=n)
    prompts = [rng.integers(0, vocab, int(k)).tolist() for k in lens]
    return prompts, [int(o) for o in outs], 8
