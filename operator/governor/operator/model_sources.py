"""Where an engine pod's model comes from, and what the pod needs for it (volumes, mounts, init containers).

Model sources (`spec.model.uri`, and `speculative.draftModel` the same way):
- `/path`: used as is (the user mounts it, e.g. through the node or an image);
- `pvc://claim/path`: the claim is mounted read-only at /models/<claim>, the model is /models/<claim>/<path>;
- `hf://org/name@rev`: an init container, from the engine image, downloads the weights, configs and tokenizer
  files of the repository (`huggingface_hub.snapshot_download`, `DOWNLOAD_PATTERNS`) into the volume
  `model-cache` at /models/hf/org/name: an emptyDir whose sizeLimit is `spec.model.cache.size`, else derived
  from the repository names (`cache_size`; none when a name states no size), or the PersistentVolumeClaim
  `spec.model.cache.claimName`, where
  files already present are not fetched again. This needs network access from the pod to the Hub (or
  HF_ENDPOINT) and, for gated repositories, an HF_TOKEN from `spec.engine.env`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from governor.operator.api import InferenceServiceSpec, parse_model_uri
from governor.operator.pod_hardening import CONTAINER_SECURITY, container_env, env_from, tmp_mount

MODELS_DIR = "/models"
HF_DIR = f"{MODELS_DIR}/hf"
MODEL_CACHE_VOLUME = "model-cache"
# What the engine reads of a Hugging Face repository: configs, safetensors weights, tokenizer and chat template
# files. Other formats of the same weights (e.g. `original/*.pth`) are not downloaded.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# The same weights again in another layout (Mistral's consolidated file, Meta's original/ folder).
SKIPPED_PATTERNS = ["consolidated*", "original/*"]
INIT_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}}
# The emptyDir's sizeLimit from a repository name: parameters ("8B", "0.5B", "135M", "8x7B", "17B-16E") × bytes
# per parameter. A limit too small gets the pod evicted mid-download, one too large costs nothing (it reserves
# no space), so it errs large: 4 bytes a parameter (fp32 checkpoints too) plus an eighth for the download's
# temporary files, experts counted as full models. A name that states no size gets no limit.
CACHE_BYTES_PER_PARAMETER = 4.5
_PARAMETERS = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?:-(\d+)[Ee])?(?![A-Za-z0-9])")


def parameters_in_name(repo: str) -> float | None:
    """Parameters a Hugging Face repository name states ("meta-llama/Llama-3.1-8B" → 8e9, "Mixtral-8x7B" → 5.6e10,
    "SmolLM2-135M" → 1.35e8); None when it states none."""
    match = _PARAMETERS.search(repo.rsplit("/", 1)[-1])
    if match is None:
        return None
    experts = int(match[1] or match[4] or 1)
    return experts * float(match[2]) * (1e9 if match[3] in "Bb" else 1e6)


def cache_size(repos: list[str]) -> str | None:
    """sizeLimit of the download volume for these repositories: `CACHE_BYTES_PER_PARAMETER` per parameter their
    names state, in whole Gi; None (no limit) when a name states none."""
    sizes = [parameters_in_name(repo) for repo in repos]
    if any(params is None for params in sizes):
        return None
    return f"{sum(max(1, math.ceil(p * CACHE_BYTES_PER_PARAMETER / 2**30)) for p in sizes if p is not None)}Gi"


@dataclass
class ModelMounts:
    """Volumes, mounts and init containers the model sources need, collected in a stable order."""

    spec: InferenceServiceSpec
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    claims: dict[str, str] = field(default_factory=dict)  # claim → volume name
    repos: list[str] = field(default_factory=list)  # hf:// repositories downloaded

    def path_of(self, uri: str, revision: str | None, role: str) -> str:
        """The model directory inside the pod for `uri`, adding what it needs."""
        source = parse_model_uri(uri)
        if source.scheme == "path":
            return source.path
        if source.scheme == "pvc":
            if source.claim not in self.claims:
                volume = f"model-pvc-{len(self.claims)}"  # claims may hold dots, volume names may not
                self.claims[source.claim] = volume
                self.volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": source.claim,
                                                                               "readOnly": True}})
                self.mounts.append({"name": volume, "mountPath": f"{MODELS_DIR}/{source.claim}", "readOnly": True})
            return f"{MODELS_DIR}/{source.claim}{source.path}"
        if not self.repos:
            self.mounts.append({"name": MODEL_CACHE_VOLUME, "mountPath": HF_DIR, "readOnly": True})
        self.repos.append(source.repo)
        local_dir = f"{HF_DIR}/{source.repo}"
        rev = source.revision or revision or ""
        self.init_containers.append({
            "name": f"fetch-{role}",
            "image": self.spec.engine.image,
            # snapshot_download is stable across huggingface_hub releases; its CLI module names are not.
            "command": ["python", "-c", "import json, sys; from huggingface_hub import snapshot_download; "
                        "snapshot_download(sys.argv[1], revision=sys.argv[2] or None, local_dir=sys.argv[3], "
                        "allow_patterns=json.loads(sys.argv[4]), ignore_patterns=json.loads(sys.argv[5]))",
                        source.repo, rev, local_dir, json.dumps(DOWNLOAD_PATTERNS), json.dumps(SKIPPED_PATTERNS)],
            "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": HF_DIR}, tmp_mount()],
            "env": container_env(self.spec, []),
            **({"envFrom": env_from(self.spec)} if self.spec.engine.env_from else {}),
            "resources": INIT_RESOURCES,
            "securityContext": CONTAINER_SECURITY,
        })
        return local_dir

    def cache_volume(self) -> dict[str, Any] | None:
        """The volume hf:// downloads go to: the spec's claim, else an emptyDir sized for the repositories."""
        if not self.repos:
            return None
        cache = self.spec.model.cache
        if cache is not None and cache.claim_name:
            return {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
        size = cache.size if cache is not None and cache.size else cache_size(self.repos)
        return {"name": MODEL_CACHE_VOLUME, "emptyDir": {"sizeLimit": size} if size else {}}
