"""How a canary's share of traffic is set: by replica ratio (default), or by weights on an HTTPRoute.

- Replica ratio: every revision's pods sit behind the shared Service `<name>`; stable keeps `replicas`
  pods and the canary gets enough pods to be about `weight`% of them. Coarse with few replicas.
- HTTPRoute (`spec.rollout.httpRoute`): two more Services select one revision each, `<name>-stable` and
  `<name>-canary` (outside a rollout both select the stable revision), and in every rule of the named
  route that references the service, the references become those two with weights `100 − w` and `w`.
  The canary then needs only pods for its share of the load: `ceil(replicas · w / 100)`.

Pure functions of data; reconcile reads and patches the route.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

REPLICAS = "replicas"
HTTP_ROUTE = "httpRoute"
ROUTE_API = ("gateway.networking.k8s.io", "v1", "httproutes")


def canary_replicas(replicas: int, weight: int, mode: str = REPLICAS) -> int:
    """Canary pods for a step of `weight`% while stable keeps `replicas` pods; at least one."""
    if weight >= 100:
        return replicas
    if mode == HTTP_ROUTE:
        return max(1, math.ceil(replicas * weight / 100))
    return max(1, round(replicas * weight / (100 - weight)))  # c / (replicas + c) ≈ weight


def canary_share(replicas: int, weight: int, mode: str = REPLICAS) -> int:
    """The canary's actual share of traffic in percent: the route's weight, or its share of the pods."""
    if mode == HTTP_ROUTE:
        return weight
    canary = canary_replicas(replicas, weight, mode)
    return round(100 * canary / (replicas + canary))


def role_service_name(name: str, role: str) -> str:
    """`<name>-stable` or `<name>-canary`: the Services an HTTPRoute splits traffic between."""
    return f"{name}-{role}"


def _references(ref: Mapping[str, Any], names: set[str]) -> bool:
    return (ref.get("group") or "") == "" and (ref.get("kind") or "Service") == "Service" and ref.get("name") in names


def routed_rules(route: Mapping[str, Any], name: str, port: int, canary_weight: int) -> list[dict[str, Any]] | None:
    """The route's rules with every reference to service `name` (or its role Services) replaced by the two role
    Services weighted `100 − canary_weight` / `canary_weight`; None when no rule references the service."""
    names = {name, role_service_name(name, "stable"), role_service_name(name, "canary")}
    rules = [dict(r) for r in (route.get("spec") or {}).get("rules") or []]
    found = False
    for rule in rules:
        refs = list(rule.get("backendRefs") or [])
        if not any(_references(ref, names) for ref in refs):
            continue
        found = True
        kept = [ref for ref in refs if not _references(ref, names)]
        rule["backendRefs"] = [
            *kept,
            {"name": role_service_name(name, "stable"), "port": port, "weight": 100 - canary_weight},
            {"name": role_service_name(name, "canary"), "port": port, "weight": canary_weight},
        ]
    return rules if found else None


def unrouted_rules(route: Mapping[str, Any], name: str, port: int) -> list[dict[str, Any]] | None:
    """The inverse of `routed_rules`: the role Services' references replaced by one to Service `name`; None when
    the route has none of them."""
    roles = {role_service_name(name, "stable"), role_service_name(name, "canary")}
    rules = [dict(r) for r in (route.get("spec") or {}).get("rules") or []]
    found = False
    for rule in rules:
        refs = list(rule.get("backendRefs") or [])
        if any(_references(ref, roles) for ref in refs):
            found = True
            rule["backendRefs"] = [*(ref for ref in refs if not _references(ref, roles)), {"name": name, "port": port}]
    return rules if found else None
