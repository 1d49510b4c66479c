"""The operator's writes to the children of an InferenceService: create what is missing, patch what drifted,
delete what is no longer wanted, always by name and only what the service controls (a controller
ownerReference with its uid). Objects of the same name that the service does not control are never adopted or
changed (`NameConflict`). The admin-token Secret is created once and never rewritten; Secrets are reached by
name only (the operator may not list them).

A reconcile pass plans its writes as data (`Apply`, `Patch`, `Delete`, `CreateAdminSecret`) and `execute` carries
them out in order through a `cluster.ClusterApi`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from governor.operator.cluster import ClusterApi
from governor.operator.render import LABEL_REVISION, LABEL_SERVICE, admin_secret, admin_secret_name


def contains(existing: Any, desired: Any) -> bool:
    """True when `existing` already holds everything in `desired`: dicts by key (extra keys in `existing`
    are server defaults and ignored), lists element by element with equal length, scalars by equality."""
    if isinstance(desired, Mapping):
        return isinstance(existing, Mapping) and all(k in existing and contains(existing[k], v)
                                                     for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(existing, list) and len(existing) == len(desired)
                and all(contains(e, d) for e, d in zip(existing, desired, strict=True)))
    return bool(existing == desired)


class NameConflict(Exception):
    """A child's name is taken by an object the InferenceService does not control; the message says which."""


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The controller ownerReference of an object, None when it has none."""
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def check_controller(kind: str, existing: Mapping[str, Any], desired_meta: Mapping[str, Any], *,
                     uncontrolled_ok: bool = False) -> None:
    """Raise NameConflict unless `existing` is controlled by the owner `desired_meta` names (by uid), or has no
    controller at all and `uncontrolled_ok`. Objects are never adopted: not another service's, not (unless
    `uncontrolled_ok`) one a user created by hand."""
    want = controller_of({"metadata": desired_meta})
    have = controller_of(existing)
    if want is None or (have is None and uncontrolled_ok) or (have is not None and have.get("uid") == want.get("uid")):
        return
    by = f"{have.get('kind')}/{have.get('name')}" if have is not None else "no controller (made outside Governor)"
    raise NameConflict(f"{kind}/{desired_meta['name']} already exists and is controlled by {by}; it is left as it "
                       f"is. Rename this InferenceService or remove that {kind}.")


def owned_children(api: ClusterApi, kind: str, namespace: str, name: str) -> list[dict[str, Any]]:
    """Service `name`'s objects of `kind` by label, checked again here before anyone acts on them (a selector an
    API stand-in ignores must not make the operator delete another service's children)."""
    items = api.list_labelled(kind, namespace, f"{LABEL_SERVICE}={name}")
    return [d for d in items if ((d.get("metadata") or {}).get("labels") or {}).get(LABEL_SERVICE) == name]


def by_revision(children: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Children by their revision label (those without one left out)."""
    out = {}
    for child in children:
        revision = ((child.get("metadata") or {}).get("labels") or {}).get(LABEL_REVISION)
        if revision:
            out[revision] = child
    return out


# --- writes, as data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Apply:
    """Create `obj` if missing, patch it where it drifted from `obj`; NameConflict when an object of its name
    exists that its controller does not control."""

    obj: dict[str, Any]


@dataclass(frozen=True)
class CreateAdminSecret:
    """Create service `name`'s admin-token Secret with a random token, made when it is written: no plan holds it."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class Patch:
    """Merge-patch `kind`/`name` with `body`; `done` says what it did, for the Reconciled Event."""

    kind: str
    namespace: str
    name: str
    body: dict[str, Any]
    done: str


@dataclass(frozen=True)
class Delete:
    """Delete `kind`/`name` (nothing to do when it is gone already); `done` says what it did."""

    kind: str
    namespace: str
    name: str
    done: str


Write = Apply | CreateAdminSecret | Patch | Delete


def apply_child(api: ClusterApi, desired: dict[str, Any]) -> str | None:
    """Create `desired` if missing, patch it if it drifted from what was rendered; None when untouched.
    NameConflict when an object of that name exists that `desired`'s controller does not control."""
    kind, meta = desired["kind"], desired["metadata"]
    existing = api.get(kind, meta["namespace"], meta["name"])
    if existing is None:
        api.create(kind, meta["namespace"], desired)
        return f"created {kind}/{meta['name']}"
    check_controller(kind, existing, meta)
    wanted = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")}
    if contains(existing, wanted):
        return None
    api.patch(kind, meta["namespace"], meta["name"], wanted)
    return f"updated {kind}/{meta['name']}"


def execute(api: ClusterApi, writes: Iterable[Write]) -> list[str]:
    """Carry out `writes` in order; what each changed (an Apply of an unchanged child or a Delete of a missing
    one changes nothing). The first NameConflict or API error stops it: writes made before it stay."""
    done = []
    for write in writes:
        if isinstance(write, Apply):
            changed = apply_child(api, write.obj)
        elif isinstance(write, CreateAdminSecret):
            body = admin_secret(write.name, write.namespace, write.uid, secrets.token_urlsafe(32))
            api.create("Secret", write.namespace, body)
            changed = f"created Secret/{body['metadata']['name']}"
        elif isinstance(write, Patch):
            api.patch(write.kind, write.namespace, write.name, write.body)
            changed = write.done
        else:
            changed = write.done if api.delete(write.kind, write.namespace, write.name) else None
        if changed:
            done.append(changed)
    return done


# --- deletion of the service ----------------------------------------------------------------------------


def delete_controlled(api: ClusterApi, kind: str, child: str, namespace: str, owner_uid: str) -> bool:
    """Delete `kind`/`child` if it exists and the InferenceService of uid `owner_uid` controls it; True when
    deleted. One made outside Governor (e.g. an admin-token Secret the user created) or another's is left alone."""
    existing = api.get(kind, namespace, child)
    controller = controller_of(existing) if existing is not None else None
    if controller is None or controller.get("uid") != owner_uid:
        return False
    return api.delete(kind, namespace, child)


def delete_children(api: ClusterApi, name: str, namespace: str, uid: str) -> list[str]:
    """Delete every child labelled for service `name`, and its admin-token Secret and PodDisruptionBudget by name
    (the operator may not list Secrets). The API server's garbage collector would do it through the
    ownerReferences; doing it explicitly makes deletion independent of the collector's pace."""
    removed: list[str] = []
    for kind in ("Deployment", "Service", "ConfigMap"):
        for child in owned_children(api, kind, namespace, name):
            if api.delete(kind, namespace, child["metadata"]["name"]):
                removed.append(f"deleted {kind}/{child['metadata']['name']}")
    for kind, by_name in (("Secret", admin_secret_name(name)), ("PodDisruptionBudget", name)):
        if delete_controlled(api, kind, by_name, namespace, uid):
            removed.append(f"deleted {kind}/{by_name}")
    return removed


Event = tuple[str, str, str]
"""An Event to post: (reason, message, type), type Normal or Warning."""


def ready_replicas(deployment: Mapping[str, Any] | None) -> int:
    """A Deployment's ready pods as its status says (0 when it has no status yet, or is None)."""
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
