"""jaxlearn.resilience: what keeps a training run alive and honest: watchdog, supervisor,
silent-data-corruption checks, non-finite policy, goodput, health checks, fault injection,
exit codes and elastic re-meshing. Import submodules directly, e.g.
`from jaxlearn.resilience.supervisor import Supervisor`; see packages/resilience/README.md."""

# The public submodules (imported on use, so that importing the package stays cheap;
# `from jaxlearn.resilience import *` imports them all).
__all__ = [
    "elastic",
    "failures",
    "faults",
    "goodput",
    "health",
    "manager",
    "nonfinite",
    "preemption",
    "sdc",
    "supervisor",
    "watchdog",
]
