"""Kubernetes JobSet manifests for a `jaxlearn train` job (what `jaxlearn launch k8s`
writes).

    manifest = jobset_manifest(K8sOptions(image="us-docker.pkg.dev/p/jaxlearn:1"), target)
    text = jobset_file(options, target)      # commented YAML for `kubectl apply -f`

One replicated job of `processes` pods (an Indexed Job, one pod per host), pod 0 the
coordinator under its JobSet DNS name `<name>-workers-0-0.<name>`; every pod finds its
place from JOB_COMPLETION_INDEX and the JobSet annotations (`jaxlearn.launch.cluster`).
Any failed pod fails the JobSet, which stops the others and restarts all of them, up to
`max_restarts` times; `jaxlearn train` in the new pods resumes from the last checkpoint in
its output directory (shared storage: a PVC, a CSI volume such as GCS FUSE, or an object
store URI). A pod evicted for preemption or maintenance (condition DisruptionTarget) fails
its Job through the pod failure policy, and that restart does not count against
`max_restarts`. TPU slices get the GKE TPU node selectors and topology, GPU node pools the
GKE accelerator label and a memory-backed /dev/shm (NCCL's shared-memory transport), Trainium
the Neuron device resource; CPU targets split their devices over the pods
(`--num_cpu_devices`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from typing import Any, Optional

from jaxlearn.launch.cluster import DEFAULT_K8S_PORT
from jaxlearn.launch.job import JobOptions, JobSpecError, JobTarget

REPLICATED_JOB = "workers"

# GKE node labels per catalogue kind.
_TPU_ACCELERATOR = {"tpu-v4": "tpu-v4-podslice", "tpu-v5p": "tpu-v5p-slice",
                    "tpu-v5e": "tpu-v5-lite-podslice", "tpu-v6e": "tpu-v6e-slice"}
_TPU_3D = ("tpu-v4", "tpu-v5p")
_GPU_ACCELERATOR = {"gpu-h100": "nvidia-h100-80gb", "gpu-h200": "nvidia-h200-141gb",
                    "gpu-b200": "nvidia-b200"}
# GKE's Cloud Storage FUSE CSI driver, which needs a pod annotation to be injected.
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"


@dataclasses.dataclass(frozen=True)
class Volume:
    """Shared storage mounted into every pod.

    Attributes:
        mount: the absolute path in the container, e.g. "/shared".
        claim: a PersistentVolumeClaim's name (a `--pvc`), or None.
        driver: a CSI driver (a `--volume`, inline ephemeral CSI volume), or None.
        attributes: (KEY, VALUE) volumeAttributes of the CSI volume, e.g. bucketName.
    """

    mount: str
    claim: Optional[str] = None
    driver: Optional[str] = None
    attributes: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class K8sOptions(JobOptions):
    """JobSet settings.

    Attributes:
        image: container image with jaxlearn installed.
        namespace: the JobSet's namespace (None: kubectl's).
        num_processes: pods (None: from the target; must agree with it when given).
        tpu_topology: GKE TPU topology, e.g. "2x2x2" (None: from the chip count).
        node_selector: (KEY, VALUE) pod nodeSelector entries, added or overriding.
        cpu, memory: per-pod resource requests, e.g. "8", "64Gi".
        max_restarts: JobSet restarts of the whole set after a failure (preemptions do
            not count); each restart resumes from the last checkpoint.
        service_account: the pods' service account.
        volumes: shared storage mounted into every pod.
    """

    image: str
    namespace: Optional[str] = None
    num_processes: Optional[int] = None
    tpu_topology: Optional[str] = None
    node_selector: tuple[tuple[str, str], ...] = ()
    cpu: Optional[str] = None
    memory: Optional[str] = None
    max_restarts: int = 3
    service_account: Optional[str] = None
    volumes: tuple[Volume, ...] = ()


def tpu_topology(kind: str, chips: int) -> str:
    """GKE's name for a slice of `chips` (a power of two): 3-D for v4/v5p (2x2x1, 2x2x2,
    2x2x4, 2x4x4, 4x4x4, ...), 2-D for v5e/v6e (1x1, 2x2, 2x4, 4x4, 4x8, ...)."""
    k = chips.bit_length() - 1
    if chips < 1 or 2**k != chips:
        raise JobSpecError(f"{chips} TPU chips is not a power of two: give --tpu_topology")
    if kind in _TPU_3D:
        dims = sorted(2 ** ((k + i) // 3) for i in range(3))
        dims = [d for d in dims if d > 1] + [d for d in dims if d == 1]
    else:
        dims = [2 ** (k // 2), 2 ** (k - k // 2)]
    return "x".join(str(d) for d in dims)


@dataclasses.dataclass
class _Placement:
    """How many pods, what each asks for and where it may run."""

    processes: int
    limits: dict[str, Any] = dataclasses.field(default_factory=dict)
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    tolerations: list[dict[str, str]] = dataclasses.field(default_factory=list)
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    cpu_devices: Optional[int] = None  # CPU devices per pod (CPU targets).


def _tpu_placement(options: K8sOptions, target: JobTarget) -> _Placement:
    per_host = min(target.devices_per_host or target.devices, target.devices)
    topology = options.tpu_topology or tpu_topology(target.kind, target.devices)
    product = math.prod(int(d) for d in topology.split("x"))
    if product != target.devices:
        raise JobSpecError(f"--tpu_topology {topology} is {product} chips; {target.selector} "
                           f"is {target.devices}")
    return _Placement(
        target.devices // per_host,
        limits={"google.com/tpu": per_host},
        node_selector={"cloud.google.com/gke-tpu-accelerator": _TPU_ACCELERATOR[target.kind],
                       "cloud.google.com/gke-tpu-topology": topology},
        tolerations=[{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        # One slice per node pool: no other job's pods on this slice's hosts.
        annotations={"alpha.jobset.sigs.k8s.io/exclusive-topology":
                     "cloud.google.com/gke-nodepool"})


def _placement(options: K8sOptions, target: JobTarget) -> _Placement:
    """The pods of `target`, per platform; raises JobSpecError when the options disagree."""
    per_host = min(target.devices_per_host or target.devices, target.devices)
    if target.platform == "tpu":
        place = _tpu_placement(options, target)
    elif target.platform == "gpu":
        place = _Placement(math.ceil(target.devices / per_host),
                           limits={"nvidia.com/gpu": per_host},
                           tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists",
                                         "effect": "NoSchedule"}])
        if target.kind in _GPU_ACCELERATOR:
            place.node_selector["cloud.google.com/gke-accelerator"] = \
                _GPU_ACCELERATOR[target.kind]
    elif target.platform == "neuron":  # 4 logical cores per chip.
        place = _Placement(math.ceil(target.devices / per_host),
                           limits={"aws.amazon.com/neuron": max(1, per_host // 4)})
    else:
        processes = options.num_processes or 1
        if target.devices % processes:
            raise JobSpecError(f"{target.selector}: {target.devices} CPU devices do not "
                               f"split over {processes} pod(s)")
        place = _Placement(processes, cpu_devices=target.devices // processes)
    if options.num_processes is not None and options.num_processes != place.processes:
        raise JobSpecError(f"--num_processes {options.num_processes}: {target.selector} "
                           f"needs {place.processes} pod(s)")
    place.node_selector.update(options.node_selector)
    return place


def _env(options: K8sOptions, target: JobTarget, processes: int, port: int
         ) -> list[dict[str, Any]]:
    """The container env: the coordinator and group size, the JobSet annotations through
    the downward API, then the timeouts and the options' own variables."""
    name = target.name
    env: list[dict[str, Any]] = [
        {"name": "JAXLEARN_COORDINATOR_ADDRESS",
         "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"},
        {"name": "JAXLEARN_NUM_PROCESSES", "value": str(processes)},
        {"name": "JAXLEARN_PROCESSES_PER_JOB", "value": str(processes)},
    ]
    for var, key in (("JOBSET_NAME", "jobset-name"),
                     ("REPLICATED_JOB_NAME", "replicatedjob-name"),
                     ("JOB_INDEX", "job-index"), ("JOB_GLOBAL_INDEX", "job-global-index")):
        env.append({"name": var, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['jobset.sigs.k8s.io/{key}']"}}})
    env += [{"name": k, "value": v} for k, v in options.timeout_env() + list(options.env)]
    return env


def _volumes(options: K8sOptions, target: JobTarget
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the container's mounts: the shared storage, and on GPU pods a
    memory-backed /dev/shm (the container runtime's default is 64 MiB)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, v in enumerate(options.volumes):
        flag = f"--pvc {v.claim}:{v.mount}" if v.claim else f"--volume {v.driver}:{v.mount}"
        if not v.mount.startswith("/") or v.mount.rstrip("/") in ("", "/dev/shm"):
            raise JobSpecError(f"{flag}: the mount must be an absolute path other than / "
                               "and /dev/shm")
        if any(m["mountPath"] == v.mount for m in mounts):
            raise JobSpecError(f"{flag}: {v.mount} is mounted twice")
        name = f"shared-{i}"
        if v.claim:
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", v.claim):
                raise JobSpecError(f"{flag}: {v.claim!r} is not a PersistentVolumeClaim name "
                                   "(lower-case a-z, 0-9, '-', '.')")
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": v.claim}})
        else:
            csi: dict[str, Any] = {"driver": v.driver}
            if v.attributes:
                csi["volumeAttributes"] = dict(v.attributes)
            volumes.append({"name": name, "csi": csi})
        mounts.append({"name": name, "mountPath": v.mount})
    if target.platform == "gpu":
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _pod(options: K8sOptions, target: JobTarget, place: _Placement) -> dict[str, Any]:
    """The pod spec: one `jaxlearn` container, never restarted by the kubelet."""
    port = options.coordinator_port or DEFAULT_K8S_PORT
    requests = {k: v for k, v in (("cpu", options.cpu), ("memory", options.memory)) if v}
    resources: dict[str, Any] = {}
    if place.limits:
        resources["limits"] = dict(place.limits)
    if requests:
        resources["requests"] = requests
    container: dict[str, Any] = {
        "name": "jaxlearn",
        "image": options.image,
        "command": target.command(options.entrypoint, place.cpu_devices),
        "ports": [{"name": "coordinator", "containerPort": port}],
        "env": _env(options, target, place.processes, port),
    }
    if resources:
        container["resources"] = resources
    volumes, mounts = _volumes(options, target)
    if mounts:
        container["volumeMounts"] = mounts
    # Never restarted in place: a failed pod fails the JobSet, which restarts every pod.
    pod: dict[str, Any] = {"restartPolicy": "Never"}
    if options.service_account:
        pod["serviceAccountName"] = options.service_account
    if place.node_selector:
        pod["nodeSelector"] = place.node_selector
    if place.tolerations:
        pod["tolerations"] = place.tolerations
    pod["containers"] = [container]
    if volumes:
        pod["volumes"] = volumes
    return pod


def _label(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", value)[:63].strip("-_.")


def jobset_manifest(options: K8sOptions, target: JobTarget) -> dict[str, Any]:
    """The JobSet that runs `target` with `options`, as a dict (see the module doc)."""
    if options.max_restarts < 0:
        raise JobSpecError(f"--max_restarts {options.max_restarts}: must be >= 0")
    place = _placement(options, target)
    name = target.name
    metadata: dict[str, Any] = {"name": name, "labels": {
        "app.kubernetes.io/name": "jaxlearn", "jaxlearn/experiment": _label(target.experiment),
        "jaxlearn/mesh-selector": _label(target.selector)}}
    if options.namespace:
        metadata["namespace"] = options.namespace
    if place.annotations:
        metadata["annotations"] = place.annotations
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            # A headless Service named <subdomain> gives every pod the DNS name
            # <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>, published before the
            # pods are ready so that process 0's address resolves during start-up.
            "network": {"enableDNSHostnames": True, "subdomain": name,
                        "publishNotReadyAddresses": True},
            # Any failed pod fails its Job (backoffLimit 0) and so the JobSet, which stops
            # every other pod and restarts them all, up to maxRestarts times; a Job failed by
            # its pod failure policy (a pod evicted for preemption or maintenance) restarts
            # the set without counting.
            "failurePolicy": {"maxRestarts": options.max_restarts, "rules": [{
                "name": "preemption-restarts-do-not-count",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": place.processes,
                    "completions": place.processes,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "podFailurePolicy": {"rules": [{
                        "action": "FailJob",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
                    "template": _pod_template(options, target, place),
                }},
            }],
        },
    }


def _pod_template(options: K8sOptions, target: JobTarget, place: _Placement
                  ) -> dict[str, Any]:
    """The Job's pod template (GCS FUSE volumes need the annotation that injects the
    driver's sidecar)."""
    template: dict[str, Any] = {}
    if any(v.driver == GCSFUSE_DRIVER for v in options.volumes):
        template["metadata"] = {"annotations": {"gke-gcsfuse/volumes": "true"}}
    template["spec"] = _pod(options, target, place)
    return template


def jobset_file(options: K8sOptions, target: JobTarget) -> str:
    """The manifest as YAML under a comment naming the job and how to apply it."""
    header = (f"# Generated by `jaxlearn launch k8s` on {datetime.date.today().isoformat()}: "
              f"{target.experiment} on {target.selector}.\n# kubectl apply -f <this file>  "
              "(needs the JobSet controller: https://jobset.sigs.k8s.io)\n")
    return header + to_yaml(jobset_manifest(options, target))


# ---- a small YAML emitter (block style; strings quoted unless plainly safe) ----------------

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:@-]*")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED and not text.endswith(":"):
        return text
    return json.dumps(text)  # A JSON string is a valid YAML double-quoted scalar.


def to_yaml(obj: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists and scalars; parses back (PyYAML or any YAML 1.2
    reader) to `obj`."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "{}\n"
        out = []
        for key, value in obj.items():
            k = _scalar(str(key))
            if isinstance(value, (dict, list)) and value:
                out.append(f"{pad}{k}:\n")
                out.append(to_yaml(value, indent + (2 if isinstance(value, dict) else 0)))
            else:
                out.append(f"{pad}{k}: {_inline(value)}\n")
        return "".join(out)
    if isinstance(obj, list):
        if not obj:
            return pad + "[]\n"
        out = []
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 2)
                out.append(f"{pad}- {body[indent + 2:]}")
            else:
                out.append(f"{pad}- {_inline(item)}\n")
        return "".join(out)
    return pad + _scalar(obj) + "\n"


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


__all__ = ["GCSFUSE_DRIVER", "REPLICATED_JOB", "K8sOptions", "Volume", "jobset_file",
           "jobset_manifest", "to_yaml", "tpu_topology"]
