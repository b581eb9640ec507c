"""Which packed segments a query may attend to, shared by every attention mask.

Plain packing: segment ids below 2**16 (0 is padding by convention); a token sees only
its own segment. Shared prefixes (a prompt followed by several continuations of it, e.g.
a preference pair's chosen and rejected responses): ids `(g << 16) | m` with g >= 1; m = 0
is the prefix of group g and m >= 1 its branches. A branch sees itself and its group's
prefix, never a sibling branch, so one row computes the prompt once for every response:

    slots      [p0 p1 p2 | c0 c1 | r0 r1 r2]          positions [0 1 2 | 3 4 | 3 4 5]
    segments   [G  G  G  | G+1 ..| G+2 ....]          G = 1 << 16

With branch positions continuing from the prefix, each branch computes exactly what it
would as its own row `[p0 p1 p2 c0 c1]` (tested against separate rows).
"""

from __future__ import annotations

import jax

SHARED_PREFIX_SHIFT = 16


def shared_segment(group: int, member: int) -> int:
    """The segment id of member `member` (0: the prefix, >= 1: a branch) of group `group`
    (>= 1)."""
    if group < 1 or not 0 <= member < (1 << SHARED_PREFIX_SHIFT):
        raise ValueError(f"shared_segment: group must be >= 1 and member in [0, 2**16), "
                         f"got {group}, {member}")
    return (group << SHARED_PREFIX_SHIFT) | member


def segments_visible(q_segment: jax.Array, k_segment: jax.Array) -> jax.Array:
    """True where a query of segment `q_segment` may see a key of segment `k_segment`
    (broadcasting int arrays): the same segment, or the shared prefix of the query's
    group (module doc)."""
    prefix = (q_segment >> SHARED_PREFIX_SHIFT) << SHARED_PREFIX_SHIFT
    return (q_segment == k_segment) | ((q_segment >> SHARED_PREFIX_SHIFT > 0)
                                       & (k_segment == prefix))
