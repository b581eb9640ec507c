"""The fields of a JobSet (jobset.x-k8s.io/v1alpha2) and of the Kubernetes objects inside it
(batch/v1 JobSpec, core/v1 PodSpec, ...) that generated manifests may use, with their types
and enumerations, from the JobSet and Kubernetes API references; `check_jobset(manifest)`
fails on any unknown field, wrong type or value outside an enumeration, naming its path.

A subset: only the objects `jaxlearn.launch.k8s` can emit are described; a field it starts
emitting must be added here, from the API reference, before the tests accept it.
"""

STR, INT, BOOL, MAP = "str", "int", "bool", "map"  # MAP: string -> string.

ENUMS = {
    "RestartPolicy": {"Always", "OnFailure", "Never"},
    "CompletionMode": {"NonIndexed", "Indexed"},
    "FailurePolicyAction": {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"},
    "PodFailurePolicyAction": {"FailJob", "FailIndex", "Ignore", "Count"},
    "JobFailureReason": {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                         "MaxFailedIndexesExceeded", "PodFailurePolicy"},
    "ConditionStatus": {"True", "False", "Unknown"},
    "TolerationOperator": {"Exists", "Equal"},
    "TaintEffect": {"NoSchedule", "PreferNoSchedule", "NoExecute"},
    "StorageMedium": {"", "Memory", "HugePages"},
    "Protocol": {"TCP", "UDP", "SCTP"},
}

TYPES = {
    "JobSet": {"apiVersion": STR, "kind": STR, "metadata": "ObjectMeta", "spec": "JobSetSpec"},
    "ObjectMeta": {"name": STR, "namespace": STR, "labels": MAP, "annotations": MAP},
    "JobSetSpec": {"replicatedJobs": ["ReplicatedJob"], "network": "Network",
                   "failurePolicy": "FailurePolicy", "suspend": BOOL,
                   "ttlSecondsAfterFinished": INT},
    "Network": {"enableDNSHostnames": BOOL, "subdomain": STR, "publishNotReadyAddresses": BOOL},
    "FailurePolicy": {"maxRestarts": INT, "rules": ["FailurePolicyRule"]},
    "FailurePolicyRule": {"name": STR, "action": "FailurePolicyAction",
                          "onJobFailureReasons": ["JobFailureReason"],
                          "targetReplicatedJobs": [STR]},
    "ReplicatedJob": {"name": STR, "replicas": INT, "template": "JobTemplateSpec"},
    "JobTemplateSpec": {"metadata": "ObjectMeta", "spec": "JobSpec"},
    "JobSpec": {"parallelism": INT, "completions": INT, "completionMode": "CompletionMode",
                "backoffLimit": INT, "activeDeadlineSeconds": INT,
                "podFailurePolicy": "PodFailurePolicy", "template": "PodTemplateSpec"},
    "PodFailurePolicy": {"rules": ["PodFailurePolicyRule"]},
    "PodFailurePolicyRule": {"action": "PodFailurePolicyAction",
                             "onPodConditions": ["PodFailurePolicyOnPodConditionsPattern"]},
    "PodFailurePolicyOnPodConditionsPattern": {"type": STR, "status": "ConditionStatus"},
    "PodTemplateSpec": {"metadata": "ObjectMeta", "spec": "PodSpec"},
    "PodSpec": {"restartPolicy": "RestartPolicy", "serviceAccountName": STR,
                "nodeSelector": MAP, "tolerations": ["Toleration"],
                "containers": ["Container"], "volumes": ["Volume"],
                "terminationGracePeriodSeconds": INT},
    "Toleration": {"key": STR, "operator": "TolerationOperator", "value": STR,
                   "effect": "TaintEffect"},
    "Container": {"name": STR, "image": STR, "command": [STR], "args": [STR],
                  "ports": ["ContainerPort"], "env": ["EnvVar"],
                  "resources": "ResourceRequirements", "volumeMounts": ["VolumeMount"]},
    "ContainerPort": {"name": STR, "containerPort": INT, "protocol": "Protocol"},
    "EnvVar": {"name": STR, "value": STR, "valueFrom": "EnvVarSource"},
    "EnvVarSource": {"fieldRef": "ObjectFieldSelector"},
    "ObjectFieldSelector": {"fieldPath": STR, "apiVersion": STR},
    "ResourceRequirements": {"limits": "Quantities", "requests": "Quantities"},
    "VolumeMount": {"name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR},
    "Volume": {"name": STR, "persistentVolumeClaim": "PVCSource", "csi": "CSIVolumeSource",
               "emptyDir": "EmptyDirVolumeSource"},
    "PVCSource": {"claimName": STR, "readOnly": BOOL},
    "CSIVolumeSource": {"driver": STR, "readOnly": BOOL, "fsType": STR,
                        "volumeAttributes": MAP},
    "EmptyDirVolumeSource": {"medium": "StorageMedium", "sizeLimit": STR},
}

REQUIRED = {
    "ObjectMeta": set(), "ReplicatedJob": {"name", "template"}, "Container": {"name", "image"},
    "FailurePolicyRule": {"name", "action"}, "PodFailurePolicyRule": {"action"},
    "PodFailurePolicyOnPodConditionsPattern": {"type", "status"}, "EnvVar": {"name"},
    "ContainerPort": {"containerPort"}, "VolumeMount": {"name", "mountPath"},
    "Volume": {"name"}, "PVCSource": {"claimName"}, "CSIVolumeSource": {"driver"},
    "JobSet": {"apiVersion", "kind", "metadata", "spec"}, "PodSpec": {"containers"},
}


def _check(value, kind, path):
    if isinstance(kind, list):
        assert isinstance(value, list), f"{path}: expected a list, got {value!r}"
        for i, item in enumerate(value):
            _check(item, kind[0], f"{path}[{i}]")
        return
    if kind in (STR, INT, BOOL):
        want = {STR: str, INT: int, BOOL: bool}[kind]
        ok = isinstance(value, want) and (kind != INT or not isinstance(value, bool))
        assert ok, f"{path}: expected {kind}, got {value!r}"
        return
    if kind == MAP:
        assert isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()), \
            f"{path}: expected a string -> string map, got {value!r}"
        return
    if kind == "Quantities":  # resource name -> quantity (an int or a quantity string).
        assert isinstance(value, dict) and all(
            isinstance(v, (int, str)) and not isinstance(v, bool) for v in value.values()), \
            f"{path}: expected resource quantities, got {value!r}"
        return
    if kind in ENUMS:
        assert value in ENUMS[kind], f"{path}: {value!r} is not one of {sorted(ENUMS[kind])}"
        return
    fields = TYPES[kind]
    assert isinstance(value, dict), f"{path}: expected a {kind} object, got {value!r}"
    unknown = set(value) - set(fields)
    assert not unknown, f"{path}: fields {sorted(unknown)} are not in {kind}"
    missing = REQUIRED.get(kind, set()) - set(value)
    assert not missing, f"{path}: {kind} needs {sorted(missing)}"
    for key, item in value.items():
        _check(item, fields[key], f"{path}.{key}")


def check_jobset(manifest):
    """Asserts that `manifest` (a dict) is a JobSet built from the fields described above."""
    _check(manifest, "JobSet", "JobSet")
    assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    return manifest
