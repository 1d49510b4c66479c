"""What on an engine pod the operator sets itself, so that a user's spec may not set it too: `governor serve`
flags, environment variables, labels and annotations. The spec's CEL rules (`api`), `validation` and the
rendering (`render`) all read these tables.
"""

from __future__ import annotations

from typing import Any

from pydantic.alias_generators import to_camel

from governor import contract
from governor.operator.kube_types import LABEL_KEY_PATTERN, cel


def cel_list(items: tuple[str, ...] | list[str]) -> str:
    """A CEL list literal of these strings."""
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


# `governor serve` flags the operator sets itself (from the spec field named, or for its own reasons), and
# --model (the model is the positional argument the operator sets; vLLM users reach for the flag): in extraArgs
# they would override it, since a later flag wins. The engine's parser takes no abbreviations, so the exact
# flag (or `flag=value`) is all there is to refuse.
OPERATOR_FLAGS: dict[str, str] = {
    "--model": "spec.model.uri",
    "--served-model-name": "spec.model.servedName",
    "--host": "the operator (the pod serves on 0.0.0.0:8000, which the Service and probes use)",
    "--port": "the operator (the pod serves on 0.0.0.0:8000, which the Service and probes use)",
    "--admin-token-file": "the operator (the service's admin-token Secret, mounted as a file)",
    "--revision": "the operator (the revision hash on every metric)",
    "--namespace": "the operator (the pod's namespace on every metric, through GOVERNOR_NAMESPACE)",
    "--drain-grace-s": "the operator (it matches the pod's termination grace period)",
    "--dtype": "spec.engine.dtype",
    "--kv-cache-dtype": "spec.engine.kvCacheDtype",
    "--enable-prefix-caching": "spec.engine.prefixCaching",
    "--no-enable-prefix-caching": "spec.engine.prefixCaching",
    "--tensor-parallel-size": "spec.engine.tensorParallelSize",
    "--device": "spec.engine.resources.gpus",
    "--max-model-len": "spec.engine.maxModelLen",
    "--quantization": "spec.engine.quantization",
    "--speculative-config": "spec.engine.speculative",
    # Each knob's starting value, and the hard cap of those with one (K's is speculative.numSpeculativeTokens).
    **{"--" + knob.replace("_", "-"): f"spec.engine.knobs.{to_camel(knob)}" for knob in contract.KNOB_NAMES},
    **{"--" + knob.replace("_", "-") + "-cap": f"spec.autotune.bounds.{to_camel(knob)}.max"
       for knob in contract.KNOB_NAMES if knob != "num_speculative_tokens"},
}
FLAGS_CEL = cel_list(list(OPERATOR_FLAGS))

# Env vars the operator sets on every container of an engine pod: `GOVERNOR_*`, and the locations that write,
# all inside the /tmp emptyDir (the root filesystem is read-only).
OPERATOR_ENV_PREFIX = "GOVERNOR_"
TMP_DIR = "/tmp"
WRITABLE_ENV = {"HOME": TMP_DIR, "HF_HOME": f"{TMP_DIR}/hf", "XDG_CACHE_HOME": f"{TMP_DIR}/cache",
                "TRITON_CACHE_DIR": f"{TMP_DIR}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{TMP_DIR}/inductor"}
OPERATOR_ENV = tuple(WRITABLE_ENV)
# Pod labels the selectors rely on, and the prefix of the operator's own labels and annotations.
OPERATOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                   "app.kubernetes.io/component")
OPERATOR_KEY_PREFIX = "governor.dev/"
OPERATOR_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")


def keys_rules(field: str, owned: tuple[str, ...], why: str) -> dict[str, Any]:
    """CEL rules for a map of pod labels or annotations: no key the operator sets, every key well formed."""
    return cel((f"self.all(k, !k.startsWith('{OPERATOR_KEY_PREFIX}') && !(k in {cel_list(owned)}))",
                f"{field} must not set {OPERATOR_KEY_PREFIX}* or " + ", ".join(owned) + f": {why}"),
               (f"self.all(k, k.matches('{LABEL_KEY_PATTERN}'))", f"{field} keys must be valid keys"))
