"""jaxlearn.aot: compile a training (or serving) step for a target without its hardware,
report memory, FLOPs and collectives, and plan layouts. Import submodules directly, e.g.
`from jaxlearn.aot.compile import aot_compile`; see packages/aot/README.md."""

# The public submodules (imported on use, so that importing the package stays cheap;
# `from jaxlearn.aot import *` imports them all).
__all__ = [
    "compile",
    "estimate",
    "hlo",
    "plan",
    "report",
    "shortlist",
    "space",
    "target",
]
