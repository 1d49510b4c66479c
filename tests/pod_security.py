"""The Pod Security Standards (policy version "latest"), baseline and restricted, as a checker of pod templates.

There is no API server here, so this re-implements the checks of Kubernetes' Pod Security admission for a pod
template in its JSON form (camelCase, as in a Deployment's `spec.template`). Each control follows one file of
k8s.io/pod-security-admission (github.com/kubernetes/pod-security-admission), at the newest version it defines:

    policy/check_windowsHostProcess.go         HostProcess
    policy/check_hostNamespaces.go             Host Namespaces
    policy/check_privileged.go                 Privileged Containers
    policy/check_capabilities_baseline.go      Capabilities (baseline)
    policy/check_hostPathVolumes.go            HostPath Volumes
    policy/check_hostPorts.go                  Host Ports
    policy/check_hostProbesAndhostLifecycle.go Host Probes / Lifecycle Hooks (1.34+)
    policy/check_appArmorProfile.go            AppArmor
    policy/check_seLinuxOptions.go             SELinux (1.31+)
    policy/check_procMount_baseline.go         /proc Mount Type (baseline, 1.35+)
    policy/check_seccompProfile_baseline.go    Seccomp (baseline, 1.19+)
    policy/check_sysctls.go                    Sysctls (1.37+)
    policy/check_restrictedVolumes.go          Volume Types (restricted)
    policy/check_allowPrivilegeEscalation.go   Privilege Escalation (1.25+)
    policy/check_runAsNonRoot.go               Running as Non-root (1.35+)
    policy/check_runAsUser.go                  Running as Non-root user (1.35+)
    policy/check_seccompProfile_restricted.go  Seccomp (restricted, 1.25+)
    policy/check_capabilities_restricted.go    Capabilities (restricted, 1.25+)
    policy/check_procMount_restricted.go       /proc Mount Type (restricted, 1.35+)

Profiles are assembled as policy/registry.go does: baseline runs the baseline checks; restricted runs the
restricted checks plus every baseline check that no restricted check overrides (hostPathVolumes,
capabilities_baseline, seccompProfile_baseline and procMount are overridden), baseline first, each group
sorted by check ID. Containers are visited as policy/visitor.go does: initContainers, containers, then
ephemeralContainers.

A check returns [] when the pod is allowed, else one message `"<reason> (<detail>)"` with upstream's
ForbiddenReason and ForbiddenDetail, the form Pod Security admission prints for a single pod; so
`", ".join(restricted_violations(t))` reads as the API server's rejection would. `CONTROLS` maps upstream
check IDs to the check functions.

Where the docs page and the code differ, or the page is silent, this follows the code, which is what the API
server enforces:
  * Volume Types also allows `image` volumes.
  * Sysctls allows the 1.37 additions net.ipv4.tcp_slow_start_after_idle and net.ipv4.tcp_notsent_lowat.
  * Pods in a user namespace (`hostUsers: false`) are exempt from Running as Non-root, Running as Non-root user
    and the baseline /proc check (1.35); the restricted /proc check does not relax.
  * Pods with `os.name: windows` are exempt from Privilege Escalation, Seccomp and Capabilities (restricted).
  * SELinux also allows the type container_engine_t.
  * Seccomp (baseline) reads only the securityContext fields; the alpha seccomp annotations count before 1.19
    only, so they are ignored.

Field handling mirrors Go's decoding of the same JSON: an absent key and `null` are both "unset", a `false`
boolean is set, a missing string is "". The check functions see the spec as given, as upstream's do; the two
profile entry points first apply the one API-server default the checks can observe in a template (a volume
with no source is an emptyDir; see `with_api_defaults`), since admission runs after defaulting. The hostPort
default for hostNetwork pods is left out: it applies to Pods only, not to templates, and such a pod already
fails Host Namespaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Json = dict[str, Any]
Check = Callable[[Json, Json], list[str]]


# --- helpers --------------------------------------------------------------------------------------------


def _containers(pod_spec: Json) -> Iterator[Json]:
    """Every container of the pod in upstream's visiting order: init, regular, ephemeral."""
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod_spec.get(key) or []


def _context(obj: Json) -> Json:
    """The securityContext of a pod spec or container, {} when unset."""
    return obj.get("securityContext") or {}


def _join_quote(items: list[str]) -> str:
    # Upstream wraps names in plain quotes without escaping them (unlike Go's %q).
    return '"' + '", "'.join(items) + '"' if items else ""


def _plural(singular: str, plural: str, count: int) -> str:
    return singular if count == 1 else plural


def _containers_phrase(names: list[str]) -> str:
    return f"{_plural('container', 'containers', len(names))} {_join_quote(names)}"


_GO_ESCAPES = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t", "\v": r"\v",
               "\\": r"\\", '"': r"\""}


def _go_quote(text: str) -> str:
    """Go's %q of a string: double-quoted with backslash escapes, printable characters kept."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _forbidden(reason: str, detail: str) -> list[str]:
    return [f"{reason} ({detail})"]


def _in_user_namespace(pod_spec: Json) -> bool:
    # Only an explicit hostUsers=false relaxes a check; unset means the host's user namespace.
    return pod_spec.get("hostUsers") is False


def _is_windows(pod_spec: Json) -> bool:
    return (pod_spec.get("os") or {}).get("name") == "windows"


def _is_zero(value: Any) -> bool:
    # A set integer 0, not an unset field (and not JSON false, which Go would not decode into an int64).
    return isinstance(value, int) and not isinstance(value, bool) and value == 0


# --- baseline -------------------------------------------------------------------------------------------


def host_process(metadata: Json, pod_spec: Json) -> list[str]:
    """HostProcess: neither the pod nor a container may set windowsOptions.hostProcess=true."""
    setters = []
    if (_context(pod_spec).get("windowsOptions") or {}).get("hostProcess") is True:
        setters.append("pod")
    bad = [c.get("name", "") for c in _containers(pod_spec)
           if (_context(c).get("windowsOptions") or {}).get("hostProcess") is True]
    if bad:
        setters.append(_containers_phrase(bad))
    if not setters:
        return []
    return _forbidden("hostProcess",
                      f"{' and '.join(setters)} must not set securityContext.windowsOptions.hostProcess=true")


def host_namespaces(metadata: Json, pod_spec: Json) -> list[str]:
    """Host Namespaces: hostNetwork, hostPID and hostIPC must be unset or false."""
    shared = [f"{field}=true" for field in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(field) is True]
    return _forbidden("host namespaces", ", ".join(shared)) if shared else []


def privileged_containers(metadata: Json, pod_spec: Json) -> list[str]:
    """Privileged Containers: no container may set securityContext.privileged=true."""
    bad = [c.get("name", "") for c in _containers(pod_spec) if _context(c).get("privileged") is True]
    if not bad:
        return []
    return _forbidden("privileged", f"{_containers_phrase(bad)} must not set securityContext.privileged=true")


# The container runtime's default set; names are compared verbatim, so "CAP_CHOWN" or "chown" are not in it.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})


def capabilities_baseline(metadata: Json, pod_spec: Json) -> list[str]:
    """Capabilities (baseline): capabilities.add may hold only the runtime's default set."""
    bad: list[str] = []
    extra: set[str] = set()
    for c in _containers(pod_spec):
        added = set((_context(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            bad.append(c.get("name", ""))
            extra |= added
    if not bad:
        return []
    return _forbidden("non-default capabilities", f"{_containers_phrase(bad)} must not include "
                      f"{_join_quote(sorted(extra))} in securityContext.capabilities.add")


def host_path_volumes(metadata: Json, pod_spec: Json) -> list[str]:
    """HostPath Volumes: no volume may be a hostPath."""
    bad = [v.get("name", "") for v in pod_spec.get("volumes") or [] if v.get("hostPath") is not None]
    if not bad:
        return []
    return _forbidden("hostPath volumes", f"{_plural('volume', 'volumes', len(bad))} {_join_quote(bad)}")


def host_ports(metadata: Json, pod_spec: Json) -> list[str]:
    """Host Ports: every containerPort's hostPort must be unset or 0."""
    bad: list[str] = []
    ports: set[str] = set()
    for c in _containers(pod_spec):
        used = {str(p["hostPort"]) for p in c.get("ports") or [] if p.get("hostPort")}
        if used:
            bad.append(c.get("name", ""))
            ports |= used
    if not bad:
        return []
    # Upstream sorts the ports as strings ("10" before "9").
    return _forbidden("hostPort", f"{_containers_phrase(bad)} {_plural('uses', 'use', len(bad))} "
                      f"{_plural('hostPort', 'hostPorts', len(ports))} {', '.join(sorted(ports))}")


def _handler_hosts(handler: Json | None) -> list[str]:
    """The explicit hosts of a probe or lifecycle handler's httpGet and tcpSocket actions."""
    if handler is None:
        return []
    actions = (handler.get("httpGet"), handler.get("tcpSocket"))
    return [action["host"] for action in actions if action is not None and action.get("host")]


def host_probes_and_lifecycle(metadata: Json, pod_spec: Json) -> list[str]:
    """Host Probes / Lifecycle Hooks: probes and postStart/preStop handlers may not name a host."""
    bad: set[str] = set()
    hosts: set[str] = set()
    for c in _containers(pod_spec):
        lifecycle = c.get("lifecycle") or {}
        handlers = [c.get("livenessProbe"), c.get("readinessProbe"), c.get("startupProbe"),
                    lifecycle.get("postStart"), lifecycle.get("preStop")]
        found = [host for handler in handlers for host in _handler_hosts(handler)]
        if found:
            bad.add(c.get("name", ""))
            hosts.update(found)
    if not bad:
        return []
    # Upstream collects both containers and hosts in sets, so both come out sorted and deduplicated.
    return _forbidden("probe or lifecycle host",
                      f"{_containers_phrase(sorted(bad))} {_plural('uses', 'use', len(bad))} "
                      f"{_plural('probe or lifecycle host', 'probe or lifecycle hosts', len(hosts))} "
                      f"{_join_quote(sorted(hosts))}")


APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
_ALLOWED_PROFILE_TYPES = ("RuntimeDefault", "Localhost")


def _allowed_apparmor_annotation(value: str) -> bool:
    return value in ("", "runtime/default") or value.startswith("localhost/")


def app_armor(metadata: Json, pod_spec: Json) -> list[str]:
    """AppArmor: profile types RuntimeDefault or Localhost only, in the fields and the deprecated annotations."""
    setters: list[str] = []
    values: set[str] = set()
    profile = _context(pod_spec).get("appArmorProfile")
    if profile is not None and (profile.get("type") or "") not in _ALLOWED_PROFILE_TYPES:
        setters.append("pod")
        values.add(profile.get("type") or "")
    bad: list[str] = []
    for c in _containers(pod_spec):
        profile = _context(c).get("appArmorProfile")
        if profile is not None and (profile.get("type") or "") not in _ALLOWED_PROFILE_TYPES:
            bad.append(c.get("name", ""))
            values.add(profile.get("type") or "")
    if bad:
        setters.append(_containers_phrase(bad))
    annotations = sorted(f"{key}={_go_quote(value)}" for key, value in (metadata.get("annotations") or {}).items()
                         if key.startswith(APPARMOR_ANNOTATION_PREFIX) and not _allowed_apparmor_annotation(value))
    if annotations:
        setters.append(_plural("annotation", "annotations", len(annotations)))
    if not setters:
        return []
    listed = [*sorted(values), *annotations]
    return _forbidden(_plural("forbidden AppArmor profile", "forbidden AppArmor profiles", len(listed)),
                      f"{' and '.join(setters)} must not set AppArmor profile type to {_join_quote(listed)}")


# container_engine_t joined the list in 1.31.
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})


def selinux(metadata: Json, pod_spec: Json) -> list[str]:
    """SELinux: seLinuxOptions.type only from the container types; user and role unset."""
    bad_types: set[str] = set()
    set_user = set_role = False

    def valid(options: Json) -> bool:
        nonlocal set_user, set_role
        ok = True
        selinux_type = options.get("type") or ""
        if selinux_type not in SELINUX_TYPES:
            bad_types.add(selinux_type)
            ok = False
        if options.get("user"):
            set_user, ok = True, False
        if options.get("role"):
            set_role, ok = True, False
        return ok

    setters: list[str] = []
    options = _context(pod_spec).get("seLinuxOptions")
    if options is not None and not valid(options):
        setters.append("pod")
    bad = []
    for c in _containers(pod_spec):
        options = _context(c).get("seLinuxOptions")
        if options is not None and not valid(options):
            bad.append(c.get("name", ""))
    if bad:
        setters.append(_containers_phrase(bad))
    if not setters:
        return []
    what = []
    if bad_types:
        what.append(f"{_plural('type', 'types', len(bad_types))} {_join_quote(sorted(bad_types))}")
    if set_user:
        what.append("user may not be set")
    if set_role:
        what.append("role may not be set")
    return _forbidden("seLinuxOptions",
                      f"{' and '.join(setters)} set forbidden securityContext.seLinuxOptions: {'; '.join(what)}")


def proc_mount_restricted(metadata: Json, pod_spec: Json) -> list[str]:
    """/proc Mount Type (restricted): procMount must be unset or Default, whatever the pod's user namespace."""
    bad: list[str] = []
    types: set[str] = set()
    for c in _containers(pod_spec):
        proc_mount = _context(c).get("procMount")
        if proc_mount is not None and proc_mount != "Default":
            bad.append(c.get("name", ""))
            types.add(proc_mount)
    if not bad:
        return []
    return _forbidden("procMount", f"{_containers_phrase(bad)} must not set securityContext.procMount to "
                      f"{_join_quote(sorted(types))}")


def proc_mount_baseline(metadata: Json, pod_spec: Json) -> list[str]:
    """/proc Mount Type (baseline): as restricted, except that a pod with hostUsers=false may set any value."""
    return [] if _in_user_namespace(pod_spec) else proc_mount_restricted(metadata, pod_spec)


_ALLOWED_SECCOMP_TYPES = ("RuntimeDefault", "Localhost")


def _seccomp_type(obj: Json) -> str | None:
    """seccompProfile.type of a pod spec or container: None when no profile is set, "" when it has no type."""
    profile = _context(obj).get("seccompProfile")
    return None if profile is None else profile.get("type") or ""


def _seccomp_check(pod_spec: Json, *, required: bool) -> list[str]:
    """Seccomp: a set profile must be RuntimeDefault or Localhost; `required` also demands one on every
    container, from the pod or its own field."""
    setters: list[str] = []
    values: set[str] = set()
    pod_type = _seccomp_type(pod_spec)
    if pod_type is not None and pod_type not in _ALLOWED_SECCOMP_TYPES:
        setters.append("pod")
        values.add(pod_type)
    pod_valid = pod_type in _ALLOWED_SECCOMP_TYPES
    explicit: list[str] = []
    implicit: list[str] = []
    for c in _containers(pod_spec):
        container_type = _seccomp_type(c)
        if container_type is None:
            if not pod_valid:
                implicit.append(c.get("name", ""))
        elif container_type not in _ALLOWED_SECCOMP_TYPES:
            explicit.append(c.get("name", ""))
            values.add(container_type)
    if explicit:
        setters.append(_containers_phrase(explicit))
    if setters:
        return _forbidden("seccompProfile", f"{' and '.join(setters)} must not set securityContext.seccompProfile"
                          f".type to {_join_quote(sorted(values))}")
    if required and implicit:
        return _forbidden("seccompProfile", f'pod or {_containers_phrase(implicit)} must set securityContext'
                          f'.seccompProfile.type to "RuntimeDefault" or "Localhost"')
    return []


def seccomp_baseline(metadata: Json, pod_spec: Json) -> list[str]:
    """Seccomp (baseline): a seccompProfile, where set on the pod or a container, must not be Unconfined."""
    return _seccomp_check(pod_spec, required=False)


SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.ip_local_reserved_ports",  # 1.27
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",  # 1.29
    "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",  # 1.32
    "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat",  # 1.37
})


def sysctls(metadata: Json, pod_spec: Json) -> list[str]:
    """Sysctls: only the namespaced, node-isolated "safe" set, matched by exact name."""
    bad = [s.get("name", "") for s in _context(pod_spec).get("sysctls") or [] if s.get("name", "") not in SAFE_SYSCTLS]
    # Listed in the order given, duplicates kept, as upstream does.
    return _forbidden("forbidden sysctls", ", ".join(bad)) if bad else []


# --- restricted -----------------------------------------------------------------------------------------

# The allowed inline volume sources. `image` is upstream's too, though the docs page does not list it.
RESTRICTED_VOLUME_SOURCES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image",
                             "persistentVolumeClaim", "projected", "secret")
# The known forbidden sources in upstream's order: the first one set names the volume's type.
_FORBIDDEN_VOLUME_SOURCES = (
    "hostPath", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "nfs", "iscsi", "glusterfs", "rbd",
    "flexVolume", "cinder", "cephfs", "flocker", "fc", "azureFile", "vsphereVolume", "quobyte", "azureDisk",
    "photonPersistentDisk", "portworxVolume", "scaleIO", "storageos",
)


def volume_types(metadata: Json, pod_spec: Json) -> list[str]:
    """Volume Types (restricted): only configMap, csi, downwardAPI, emptyDir, ephemeral, image,
    persistentVolumeClaim, projected and secret volumes. Replaces HostPath Volumes in the restricted profile."""
    bad: list[str] = []
    types: set[str] = set()
    for volume in pod_spec.get("volumes") or []:
        # As upstream: one allowed source admits the volume, whatever else it sets (the API rejects two sources).
        if any(volume.get(source) is not None for source in RESTRICTED_VOLUME_SOURCES):
            continue
        bad.append(volume.get("name", ""))
        types.add(next((s for s in _FORBIDDEN_VOLUME_SOURCES if volume.get(s) is not None), "unknown"))
    if not bad:
        return []
    return _forbidden("restricted volume types",
                      f"{_plural('volume', 'volumes', len(bad))} {_join_quote(bad)} {_plural('uses', 'use', len(bad))} "
                      f"{_plural('restricted volume type', 'restricted volume types', len(types))} "
                      f"{_join_quote(sorted(types))}")


def privilege_escalation(metadata: Json, pod_spec: Json) -> list[str]:
    """Privilege Escalation: every container must set allowPrivilegeEscalation=false (Windows pods exempt)."""
    if _is_windows(pod_spec):
        return []
    bad = [c.get("name", "") for c in _containers(pod_spec) if _context(c).get("allowPrivilegeEscalation") is not False]
    if not bad:
        return []
    return _forbidden("allowPrivilegeEscalation != false",
                      f"{_containers_phrase(bad)} must set securityContext.allowPrivilegeEscalation=false")


def running_as_non_root(metadata: Json, pod_spec: Json) -> list[str]:
    """Running as Non-root: runAsNonRoot=true on the pod (not overridden to false) or on every container;
    pods with hostUsers=false are exempt."""
    if _in_user_namespace(pod_spec):
        return []
    setters: list[str] = []
    pod_value = _context(pod_spec).get("runAsNonRoot")
    if pod_value is False:
        setters.append("pod")
    explicit: list[str] = []
    implicit: list[str] = []
    for c in _containers(pod_spec):
        value = _context(c).get("runAsNonRoot")
        if value is False:
            explicit.append(c.get("name", ""))
        elif value is None and pod_value is not True:
            implicit.append(c.get("name", ""))
    if explicit:
        setters.append(_containers_phrase(explicit))
    if setters:
        return _forbidden("runAsNonRoot != true",
                          f"{' and '.join(setters)} must not set securityContext.runAsNonRoot=false")
    if implicit:
        return _forbidden("runAsNonRoot != true",
                          f"pod or {_containers_phrase(implicit)} must set securityContext.runAsNonRoot=true")
    return []


def running_as_non_root_user(metadata: Json, pod_spec: Json) -> list[str]:
    """Running as Non-root user: runAsUser must not be 0 on the pod or any container; hostUsers=false exempts."""
    if _in_user_namespace(pod_spec):
        return []
    setters = ["pod"] if _is_zero(_context(pod_spec).get("runAsUser")) else []
    bad = [c.get("name", "") for c in _containers(pod_spec) if _is_zero(_context(c).get("runAsUser"))]
    if bad:
        setters.append(_containers_phrase(bad))
    return _forbidden("runAsUser=0", f"{' and '.join(setters)} must not set runAsUser=0") if setters else []


def seccomp_restricted(metadata: Json, pod_spec: Json) -> list[str]:
    """Seccomp (restricted): RuntimeDefault or Localhost on the pod or on every container, nothing else set
    anywhere (Windows pods exempt). Replaces Seccomp (baseline) in the restricted profile."""
    return [] if _is_windows(pod_spec) else _seccomp_check(pod_spec, required=True)


def capabilities_restricted(metadata: Json, pod_spec: Json) -> list[str]:
    """Capabilities (restricted): every container drops "ALL" and adds nothing but NET_BIND_SERVICE (Windows
    pods exempt). Replaces Capabilities (baseline) in the restricted profile."""
    if _is_windows(pod_spec):
        return []
    missing_drop: list[str] = []
    adding: list[str] = []
    extra: set[str] = set()
    for c in _containers(pod_spec):
        caps = _context(c).get("capabilities")
        if caps is None:
            missing_drop.append(c.get("name", ""))
            continue
        if "ALL" not in (caps.get("drop") or []):
            missing_drop.append(c.get("name", ""))
        added = {cap for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"}
        if added:
            adding.append(c.get("name", ""))
            extra |= added
    details = []
    if missing_drop:
        details.append(f'{_containers_phrase(missing_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if adding:
        details.append(f"{_containers_phrase(adding)} must not include {_join_quote(sorted(extra))} in "
                       f"securityContext.capabilities.add")
    return _forbidden("unrestricted capabilities", "; ".join(details)) if details else []


# --- profiles -------------------------------------------------------------------------------------------

# Upstream check ID → check.
CONTROLS: dict[str, Check] = {
    "appArmorProfile": app_armor,
    "capabilities_baseline": capabilities_baseline,
    "hostNamespaces": host_namespaces,
    "hostPathVolumes": host_path_volumes,
    "hostPorts": host_ports,
    "hostProbesAndHostLifecycle": host_probes_and_lifecycle,
    "privileged": privileged_containers,
    "procMount": proc_mount_baseline,
    "seLinuxOptions": selinux,
    "seccompProfile_baseline": seccomp_baseline,
    "sysctls": sysctls,
    "windowsHostProcess": host_process,
    "allowPrivilegeEscalation": privilege_escalation,
    "capabilities_restricted": capabilities_restricted,
    "procMount_restricted": proc_mount_restricted,
    "restrictedVolumes": volume_types,
    "runAsNonRoot": running_as_non_root,
    "runAsUser": running_as_non_root_user,
    "seccompProfile_restricted": seccomp_restricted,
}

# Run order of each profile: sorted IDs (byte order, as Go sorts), baseline before restricted.
BASELINE_CONTROLS: tuple[str, ...] = tuple(sorted((
    "appArmorProfile", "capabilities_baseline", "hostNamespaces", "hostPathVolumes", "hostPorts",
    "hostProbesAndHostLifecycle", "privileged", "procMount", "seLinuxOptions", "seccompProfile_baseline",
    "sysctls", "windowsHostProcess",
)))
# Restricted check → the baseline check it replaces in the restricted profile.
OVERRIDES: dict[str, str] = {
    "capabilities_restricted": "capabilities_baseline",
    "procMount_restricted": "procMount",
    "restrictedVolumes": "hostPathVolumes",
    "seccompProfile_restricted": "seccompProfile_baseline",
}
RESTRICTED_CONTROLS: tuple[str, ...] = (
    *(name for name in BASELINE_CONTROLS if name not in OVERRIDES.values()),
    *sorted(name for name in CONTROLS if name not in BASELINE_CONTROLS),
)


def with_api_defaults(pod_spec: Json) -> Json:
    """`pod_spec` as admission sees it after the API server's defaulting, as far as the checks can tell: a volume
    that names no source becomes an emptyDir (SetDefaults_Volume in k8s.io/kubernetes pkg/apis/core/v1)."""
    volumes = pod_spec.get("volumes")
    if not volumes:
        return pod_spec
    defaulted = [v if any(value is not None for key, value in v.items() if key != "name") else {**v, "emptyDir": {}}
                 for v in volumes]
    return {**pod_spec, "volumes": defaulted}


def _run(template: Json, names: tuple[str, ...]) -> list[str]:
    metadata = template.get("metadata") or {}
    pod_spec = with_api_defaults(template.get("spec") or {})
    return [message for name in names for message in CONTROLS[name](metadata, pod_spec)]


def baseline_violations(template: Json) -> list[str]:
    """What the baseline profile forbids in a pod template ({"metadata": ..., "spec": ...}); [] if allowed."""
    return _run(template, BASELINE_CONTROLS)


def restricted_violations(template: Json) -> list[str]:
    """What the restricted profile forbids in a pod template ({"metadata": ..., "spec": ...}); [] if allowed."""
    return _run(template, RESTRICTED_CONTROLS)
