"""The security context and environment of engine pods.

They pass the Pod Security "restricted" profile: non-root (uid `RUN_AS_USER`, the engine image's user), no
privilege escalation, every capability dropped, the runtime's default seccomp profile, and a read-only root
filesystem with emptyDirs where the engine and the model download write (/tmp: HOME and the Triton, Torch
Inductor and Hugging Face caches, `pod_ownership.WRITABLE_ENV`). `render` adds no service account token and the
admin token as a mounted Secret file.
"""

from __future__ import annotations

from typing import Any

from governor.operator.api import InferenceServiceSpec
from governor.operator.pod_ownership import TMP_DIR, WRITABLE_ENV

RUN_AS_USER = 10001  # the engine image's user (docker/engine.Dockerfile)
TMP_VOLUME = "tmp"
TMP_SIZE_LIMIT = "4Gi"  # compile caches (Triton, Torch Inductor, CUDA) and the download's metadata
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
                # a claim used as the model cache is chowned once, not on every mount
                "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def tmp_mount() -> dict[str, Any]:
    """The mount of the /tmp emptyDir, in every container."""
    return {"name": TMP_VOLUME, "mountPath": TMP_DIR}


def container_env(spec: InferenceServiceSpec, operator_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The container's env: the operator's own, the writable locations, then the user's (`spec.engine.env`,
    which validation keeps off the names the operator sets)."""
    writable = [{"name": k, "value": v} for k, v in WRITABLE_ENV.items()]
    user = [v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in spec.engine.env]
    return operator_env + writable + user


def env_from(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """spec.engine.envFrom as rendered."""
    return [s.model_dump(mode="json", by_alias=True, exclude_none=True) for s in spec.engine.env_from]
