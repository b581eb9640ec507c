"""jaxlearn.launch: start one job on many processes: `jax.distributed` start-up from flags or
a scheduler's environment, the local launcher, Slurm scripts and Kubernetes JobSet
manifests. Import submodules directly, e.g. `from jaxlearn.launch import distributed`;
see packages/launch/README.md."""

# The public submodules (imported on use, so that importing the package stays cheap;
# `from jaxlearn.launch import *` imports them all).
__all__ = [
    "cluster",
    "distributed",
    "job",
    "k8s",
    "local",
    "rollcall",
    "slurm",
]
