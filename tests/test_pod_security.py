"""The Pod Security Standards checker in tests/pod_security.py, against upstream's own cases, and the engine pod.

Each control runs on the pods of its upstream unit test, policy/check_<control>_test.go in
k8s.io/pod-security-admission, and must report exactly upstream's ForbiddenReason and ForbiddenDetail (as
`"<reason> (<detail>)"`), or nothing where upstream allows the pod. Cases the unit tests lack (mostly allowed
pods) come from the admission fixtures in test/fixtures_<control>.go and test/fixtures.go of the same module.
Case ids name the file (policy/ unless it starts with test/), the Go test function and the case.

Then the profiles: which checks run, in what order, which restricted checks replace baseline ones, and the
hardened pod the operator should render, which passes restricted while each single weakening fails the one
control it weakens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.pod_security import (
    CONTROLS,
    RESTRICTED_CONTROLS,
    baseline_violations,
    restricted_violations,
)

Obj = dict[str, Any]


def ctr(name: str, security_context: Obj | None = None, **fields: Any) -> Obj:
    """A container; `security_context` {} is a set but empty securityContext, None leaves it unset."""
    out: Obj = {"name": name, **fields}
    if security_context is not None:
        out["securityContext"] = security_context
    return out


def spec(*containers: Obj, **fields: Any) -> Obj:
    return {"containers": list(containers), **fields}


def forbidden(reason: str, detail: str) -> list[str]:
    return [f"{reason} ({detail})"]


def case(control: str, pod_spec: Obj, expected: list[str], case_id: str, metadata: Obj | None = None) -> Any:
    return pytest.param(control, metadata or {}, pod_spec, expected, id=case_id)


def probe(action: str, host: str | None = None) -> Obj:
    """A probe or lifecycle handler with one httpGet or tcpSocket action, to `host` if given."""
    return {action: {"port": 8080} if host is None else {"host": host, "port": 8080}}


APPARMOR = "container.apparmor.security.beta.kubernetes.io/"
DEFAULT_CAPS = ["AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"]
RUNTIME_DEFAULT = {"seccompProfile": {"type": "RuntimeDefault"}}
UNCONFINED = {"seccompProfile": {"type": "Unconfined"}}


def seccomp_containers() -> list[Obj]:
    """Containers a-f of the seccomp unit tests: unset, empty, two Unconfined, two RuntimeDefault."""
    return [ctr("a"), ctr("b", {}), ctr("c", UNCONFINED), ctr("d", UNCONFINED), ctr("e", RUNTIME_DEFAULT),
            ctr("f", RUNTIME_DEFAULT)]


def selinux(**options: str) -> Obj:
    return {"seLinuxOptions": options}


SELINUX_GOOD = [ctr("a", selinux(type="container_t")), ctr("b", selinux(type="container_init_t")),
                ctr("c", selinux(type="container_kvm_t")), ctr("d", selinux(type="container_engine_t"))]
SELINUX_BAD = [ctr("e", selinux(type="bar")), ctr("f", selinux(user="bar")), ctr("g", selinux(role="baz"))]
PROC_MOUNTS = [ctr("a"), ctr("b", {}), ctr("c", {"procMount": "Default"}), ctr("d", {"procMount": "Unmasked"}),
               ctr("e", {"procMount": "other"})]
PROC_MOUNT_DETAIL = 'containers "d", "e" must not set securityContext.procMount to "Unmasked", "other"'
ALLOWED_VOLUMES = [{"name": f"a{i}", source: {}} for i, source in enumerate((
    "emptyDir", "secret", "persistentVolumeClaim", "downwardAPI", "configMap", "projected", "csi", "ephemeral", "image",
), start=1)]
FORBIDDEN_VOLUME_SOURCES = [
    "hostPath", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "nfs", "iscsi", "glusterfs", "rbd",
    "flexVolume", "cinder", "cephfs", "flocker", "fc", "azureFile", "vsphereVolume", "quobyte", "azureDisk",
    "photonPersistentDisk", "portworxVolume", "scaleIO", "storageos",
]
SAFE_SYSCTLS = ["kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
                "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat"]
ALL_CAPS_ONE_BY_ONE = ["SYS_TIME", "SYS_MODULE", "SYS_RAWIO", "SYS_PACCT", "SYS_ADMIN", "SYS_NICE", "SYS_RESOURCE",
                       "SYS_TTY_CONFIG", "MKNOD", "AUDIT_WRITE", "AUDIT_CONTROL", "MAC_OVERRIDE", "MAC_ADMIN",
                       "NET_ADMIN", "SYSLOG", "CHOWN", "NET_RAW", "DAC_OVERRIDE", "FOWNER", "DAC_READ_SEARCH", "FSETID",
                       "KILL", "SETGID", "SETUID", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "IPC_LOCK",
                       "IPC_OWNER", "SYS_CHROOT", "SYS_PTRACE", "SYS_BOOT", "LEASE", "SETFCAP", "WAKE_ALARM",
                       "BLOCK_SUSPEND"]
SECCOMP_MUST_SET = 'must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"'

UPSTREAM_CASES = [
    # --- HostProcess
    case("windowsHostProcess", spec(
        ctr("a"), ctr("b", {}), ctr("c", {"windowsOptions": {}}), ctr("d", {"windowsOptions": {"hostProcess": False}}),
        ctr("e", {"windowsOptions": {"hostProcess": True}}), ctr("f", {"windowsOptions": {"hostProcess": True}}),
        securityContext={"windowsOptions": {"hostProcess": True}}),
        forbidden("hostProcess",
                  'pod and containers "e", "f" must not set securityContext.windowsOptions.hostProcess=true'),
        "check_windowsHostProcess_test.go:TestWindowsHostProcess/host process"),
    case("windowsHostProcess", spec(
        ctr("a"), ctr("b", {}), ctr("c", {"windowsOptions": {}}), ctr("d", {"windowsOptions": {"hostProcess": False}}),
        securityContext={"windowsOptions": {"hostProcess": False}}),
        [], "check_windowsHostProcess_test.go:TestWindowsHostProcess/host process, without pod and e, f"),
    # --- Host Namespaces
    case("hostNamespaces", spec(ctr("a"), hostNetwork=True, hostIPC=True, hostPID=True),
         forbidden("host namespaces", "hostNetwork=true, hostPID=true, hostIPC=true"),
         "check_hostNamespaces_test.go:TestHostNamespaces/multiple host namespaces"),
    case("hostNamespaces", spec(ctr("a"), hostIPC=True), forbidden("host namespaces", "hostIPC=true"),
         "test/fixtures_hostNamespaces.go:fail/hostIPC"),
    case("hostNamespaces", spec(ctr("a"), hostNetwork=False, hostIPC=False, hostPID=False), [],
         "check_hostNamespaces.go:allowed values/false"),
    # --- Privileged Containers
    case("privileged", spec(ctr("a"), ctr("b", {}), ctr("c", {"privileged": False}), ctr("d", {"privileged": True}),
                            ctr("e", {"privileged": True})),
         forbidden("privileged", 'containers "d", "e" must not set securityContext.privileged=true'),
         "check_privileged_test.go:TestPrivileged/privileged"),
    case("privileged", spec(ctr("a"), ctr("b", {}), ctr("c", {"privileged": False})), [],
         "check_privileged_test.go:TestPrivileged/privileged, without d, e"),
    # --- Capabilities (baseline)
    case("capabilities_baseline", spec(ctr("a", {"capabilities": {"add": ["FOO", "BAR"]}}),
                                       ctr("b", {"capabilities": {"add": ["BAR", "BAZ"]}})),
         forbidden("non-default capabilities",
                   'containers "a", "b" must not include "BAR", "BAZ", "FOO" in securityContext.capabilities.add'),
         "check_capabilities_baseline_test.go:TestCapabilitiesBaseline/multiple containers"),
    case("capabilities_baseline", {"initContainers": [ctr("init", {"capabilities": {"add": DEFAULT_CAPS}})],
                                   "containers": [ctr("main", {"capabilities": {"add": DEFAULT_CAPS}})]},
         [], "test/fixtures_capabilities_baseline.go:pass/default set"),
    case("capabilities_baseline", spec(ctr("main", {"capabilities": {"add": ["chown"]}})),
         forbidden("non-default capabilities",
                   'container "main" must not include "chown" in securityContext.capabilities.add'),
         "test/fixtures_capabilities_baseline.go:fail/chown"),
    case("capabilities_baseline", spec(ctr("main", {"capabilities": {"add": ["CAP_CHOWN"]}})),
         forbidden("non-default capabilities",
                   'container "main" must not include "CAP_CHOWN" in securityContext.capabilities.add'),
         "test/fixtures_capabilities_baseline.go:fail/CAP_CHOWN"),
    # --- HostPath Volumes
    case("hostPathVolumes", spec(ctr("x"), volumes=[{"name": "a", "hostPath": {}}, {"name": "b", "hostPath": {}},
                                                    {"name": "c", "emptyDir": {}}]),
         forbidden("hostPath volumes", 'volumes "a", "b"'),
         "check_hostPathVolumes_test.go:TestHostPathVolumes/host path volumes"),
    case("hostPathVolumes", spec(ctr("x"), volumes=[{"name": "c", "emptyDir": {}}]), [],
         "check_hostPathVolumes_test.go:TestHostPathVolumes/host path volumes, without a, b"),
    # --- Host Ports
    case("hostPorts", spec(ctr("a", ports=[{"hostPort": 0}]), ctr("b", ports=[{"hostPort": 0}, {"hostPort": 20}])),
         forbidden("hostPort", 'container "b" uses hostPort 20'),
         "check_hostPorts_test.go:TestHostPort/one container, one host port"),
    case("hostPorts", spec(ctr("a", ports=[{"hostPort": 0}]),
                           ctr("b", ports=[{"hostPort": 0}, {"hostPort": 10}, {"hostPort": 20}]),
                           ctr("c", ports=[{"hostPort": 0}, {"hostPort": 10}, {"hostPort": 30}])),
         forbidden("hostPort", 'containers "b", "c" use hostPorts 10, 20, 30'),
         "check_hostPorts_test.go:TestHostPort/multiple containers, multiple host port"),
    # Upstream keeps the ports in a string set, so 10 sorts before 9.
    case("hostPorts", spec(ctr("a", ports=[{"hostPort": 9}, {"hostPort": 10}])),
         forbidden("hostPort", 'container "a" uses hostPorts 10, 9'), "check_hostPorts.go:ports sorted as strings"),
    case("hostPorts", {"initContainers": [ctr("init", ports=[{"containerPort": 12346}])],
                       "containers": [ctr("main", ports=[{"containerPort": 12345}])]},
         [], "test/fixtures_hostPorts.go:pass"),
    # --- Host Probes / Lifecycle Hooks
    case("hostProbesAndHostLifecycle", spec(ctr("a", livenessProbe=probe("httpGet"), readinessProbe=probe("tcpSocket"),
                                                lifecycle={"postStart": probe("httpGet")})),
         [], "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/valid pod with unset hosts"),
    case("hostProbesAndHostLifecycle", spec(ctr("a", livenessProbe=probe("httpGet", "127.0.0.1"),
                                                readinessProbe=probe("tcpSocket", "::1"),
                                                startupProbe=probe("httpGet", "localhost"))),
         forbidden("probe or lifecycle host",
                   'container "a" uses probe or lifecycle hosts "127.0.0.1", "::1", "localhost"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/"
         "invalid pod with local host IP as probe host"),
    case("hostProbesAndHostLifecycle", spec(ctr("a", livenessProbe=probe("httpGet", "invalid.host"))),
         forbidden("probe or lifecycle host", 'container "a" uses probe or lifecycle host "invalid.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/"
         "invalid httpget host in liveness probe"),
    case("hostProbesAndHostLifecycle", spec(ctr("b", readinessProbe=probe("tcpSocket", "invalid.host"))),
         forbidden("probe or lifecycle host", 'container "b" uses probe or lifecycle host "invalid.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/"
         "invalid tcpsocket host in readiness probe"),
    case("hostProbesAndHostLifecycle", spec(ctr("c", startupProbe=probe("httpGet", "invalid.host"))),
         forbidden("probe or lifecycle host", 'container "c" uses probe or lifecycle host "invalid.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/"
         "invalid httpget host in startup probe"),
    case("hostProbesAndHostLifecycle", spec(ctr("d", lifecycle={"postStart": probe("tcpSocket", "invalid.host")})),
         forbidden("probe or lifecycle host", 'container "d" uses probe or lifecycle host "invalid.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/invalid poststart tcpsocket host"),
    case("hostProbesAndHostLifecycle", spec(ctr("e", lifecycle={"preStop": probe("httpGet", "another.invalid.host")})),
         forbidden("probe or lifecycle host", 'container "e" uses probe or lifecycle host "another.invalid.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/invalid prestop httpget host"),
    case("hostProbesAndHostLifecycle", spec(ctr("valid"), ctr("invalid1", livenessProbe=probe("httpGet", "a.com")),
                                            ctr("invalid2", lifecycle={"preStop": probe("tcpSocket", "b.com")},
                                                startupProbe=probe("httpGet", "a.com"))),
         forbidden("probe or lifecycle host",
                   'containers "invalid1", "invalid2" use probe or lifecycle hosts "a.com", "b.com"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/"
         "multiple containers with multiple invalid hosts"),
    case("hostProbesAndHostLifecycle", spec(ctr("a", livenessProbe=probe("httpGet", "8.8.8.8"))),
         forbidden("probe or lifecycle host", 'container "a" uses probe or lifecycle host "8.8.8.8"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/invalid ipv4 host in probe"),
    case("hostProbesAndHostLifecycle", spec(ctr("a", livenessProbe=probe("tcpSocket", "2001:4860:4860::8888"))),
         forbidden("probe or lifecycle host", 'container "a" uses probe or lifecycle host "2001:4860:4860::8888"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/invalid ipv6 host in probe"),
    case("hostProbesAndHostLifecycle",
         {"initContainers": [ctr("init", livenessProbe=probe("httpGet", "invalid.init.host"))]},
         forbidden("probe or lifecycle host", 'container "init" uses probe or lifecycle host "invalid.init.host"'),
         "check_hostProbesAndhostLifecycle_test.go:TestHostProbesAndHostLifecycle/invalid host in initcontainer"),
    case("hostProbesAndHostLifecycle",
         {"initContainers": [ctr("init", restartPolicy="Always", readinessProbe=probe("tcpSocket", "8.8.8.8"))],
          "containers": [ctr("main")]},
         forbidden("probe or lifecycle host", 'container "init" uses probe or lifecycle host "8.8.8.8"'),
         "test/fixtures_hostProbesAndHostLifecycle.go:fail/sidecar readiness probe"),
    # --- AppArmor
    case("appArmorProfile", {}, [], "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/"
         "container with default AppArmor + extra annotations",
         metadata={"annotations": {APPARMOR + "test": "runtime/default", "env": "prod"}}),
    case("appArmorProfile", {}, [], "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/"
         "container with local AppArmor + extra annotations",
         metadata={"annotations": {APPARMOR + "test": "localhost/sec-profile01", "env": "dev"}}),
    case("appArmorProfile", {}, [],
         "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/container with no AppArmor annotations",
         metadata={"annotations": {"env": "dev"}}),
    case("appArmorProfile", {}, [],
         "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/container with no annotations"),
    case("appArmorProfile", {"securityContext": {"appArmorProfile": {"type": "RuntimeDefault"}}}, [],
         "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/pod with runtime default"),
    case("appArmorProfile", spec(ctr("foo", {"appArmorProfile": {"type": "RuntimeDefault"}})), [],
         "check_appArmorProfile_test.go:TestCheckAppArmor_Allowed/container with localhost profile"),
    case("appArmorProfile", {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}},
         forbidden("forbidden AppArmor profile", 'pod must not set AppArmor profile type to "Unconfined"'),
         "check_appArmorProfile_test.go:TestCheckAppArmor_Forbidden/unconfined pod"),
    case("appArmorProfile", spec(ctr("foo", {"appArmorProfile": {"type": "Unconfined"}}),
                                 securityContext={"appArmorProfile": {"type": "RuntimeDefault"}}),
         forbidden("forbidden AppArmor profile", 'container "foo" must not set AppArmor profile type to "Unconfined"'),
         "check_appArmorProfile_test.go:TestCheckAppArmor_Forbidden/unconfined container"),
    case("appArmorProfile", spec(ctr("foo"), initContainers=[ctr("bar", {"appArmorProfile": {"type": "Unconfined"}})],
                                 securityContext={"appArmorProfile": {"type": "RuntimeDefault"}}),
         forbidden("forbidden AppArmor profile", 'container "bar" must not set AppArmor profile type to "Unconfined"'),
         "check_appArmorProfile_test.go:TestCheckAppArmor_Forbidden/unconfined init container"),
    case("appArmorProfile", {},
         forbidden("forbidden AppArmor profiles", "annotations must not set AppArmor profile type to "
                   f'"{APPARMOR}="bogus"", "{APPARMOR}e="unconfined"", "{APPARMOR}f="unknown""'),
         "check_appArmorProfile_test.go:TestCheckAppArmor_Forbidden/multiple containers",
         metadata={"annotations": {APPARMOR: "bogus", APPARMOR + "a": "", APPARMOR + "b": "runtime/default",
                                   APPARMOR + "c": "localhost/", APPARMOR + "d": "localhost/foo",
                                   APPARMOR + "e": "unconfined", APPARMOR + "f": "unknown"}}),
    # --- SELinux
    case("seLinuxOptions", spec(*SELINUX_GOOD, *SELINUX_BAD,
                                securityContext=selinux(type="foo", user="bar", role="baz")),
         forbidden("seLinuxOptions", 'pod and containers "e", "f", "g" set forbidden securityContext.seLinuxOptions: '
                   'types "bar", "foo"; user may not be set; role may not be set'),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/invalid pod and containers"),
    case("seLinuxOptions", spec(*SELINUX_GOOD, securityContext=selinux(type="foo", user="bar", role="baz")),
         forbidden("seLinuxOptions", 'pod set forbidden securityContext.seLinuxOptions: type "foo"; '
                   "user may not be set; role may not be set"),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/invalid pod"),
    case("seLinuxOptions", spec(*SELINUX_GOOD, *SELINUX_BAD, securityContext=selinux()),
         forbidden("seLinuxOptions", 'containers "e", "f", "g" set forbidden securityContext.seLinuxOptions: '
                   'type "bar"; user may not be set; role may not be set'),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/invalid containers"),
    case("seLinuxOptions", {"securityContext": selinux(type="bad")},
         forbidden("seLinuxOptions", 'pod set forbidden securityContext.seLinuxOptions: type "bad"'),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/bad type"),
    case("seLinuxOptions", {"securityContext": selinux(user="bad")},
         forbidden("seLinuxOptions", "pod set forbidden securityContext.seLinuxOptions: user may not be set"),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/bad user"),
    case("seLinuxOptions", {"securityContext": selinux(role="bad")},
         forbidden("seLinuxOptions", "pod set forbidden securityContext.seLinuxOptions: role may not be set"),
         "check_seLinuxOptions_test.go:TestSELinuxOptions/bad role"),
    case("seLinuxOptions", spec(*SELINUX_GOOD, securityContext=selinux()), [],
         "check_seLinuxOptions_test.go:TestSELinuxOptions/invalid containers, without e, f, g"),
    case("seLinuxOptions", {"securityContext": selinux(type="container_t"),
                            "initContainers": [ctr("init", selinux(type="container_kvm_t"))],
                            "containers": [ctr("main", selinux(type="container_init_t", level="somevalue"))]},
         [], "test/fixtures_seLinuxOptions.go:pass/types and level"),
    # --- /proc Mount Type
    case("procMount", spec(*PROC_MOUNTS, hostUsers=True), forbidden("procMount", PROC_MOUNT_DETAIL),
         "check_procMount_baseline_test.go:TestProcMountBaseline/procMount"),
    case("procMount", spec(*PROC_MOUNTS, hostUsers=False), [],
         "check_procMount_baseline_test.go:TestProcMountBaseline/procMount with userns"),
    case("procMount_restricted", spec(*PROC_MOUNTS, hostUsers=True), forbidden("procMount", PROC_MOUNT_DETAIL),
         "check_procMount_restricted_test.go:TestProcMountRestricted/procMount, hostUsers=true"),
    case("procMount_restricted", spec(*PROC_MOUNTS, hostUsers=False), forbidden("procMount", PROC_MOUNT_DETAIL),
         "check_procMount_restricted_test.go:TestProcMountRestricted/procMount, hostUsers=false"),
    case("procMount_restricted", spec(*PROC_MOUNTS[:3]), [],
         "check_procMount_restricted_test.go:TestProcMountRestricted/procMount, without d, e"),
    # --- Seccomp (baseline)
    case("seccompProfile_baseline", spec(ctr("a"), securityContext=UNCONFINED),
         forbidden("seccompProfile", 'pod must not set securityContext.seccompProfile.type to "Unconfined"'),
         "check_seccompProfile_baseline_test.go:TestSeccompProfileBaseline_1_19/pod seccomp invalid"),
    case("seccompProfile_baseline", spec(*seccomp_containers(), securityContext=RUNTIME_DEFAULT),
         forbidden("seccompProfile",
                   'containers "c", "d" must not set securityContext.seccompProfile.type to "Unconfined"'),
         "check_seccompProfile_baseline_test.go:TestSeccompProfileBaseline_1_19/containers seccomp invalid"),
    case("seccompProfile_baseline", spec(*seccomp_containers(), securityContext=UNCONFINED),
         forbidden("seccompProfile",
                   'pod and containers "c", "d" must not set securityContext.seccompProfile.type to "Unconfined"'),
         "check_seccompProfile_baseline_test.go:TestSeccompProfileBaseline_1_19/pod and containers seccomp invalid"),
    # Before 1.19 the alpha annotations were checked; at "latest" only the fields are.
    case("seccompProfile_baseline", spec(ctr("a"), ctr("b"), ctr("c")), [],
         "check_seccompProfile_baseline_test.go:TestSeccompProfileBaseline_1_0/pod and containers seccomp invalid",
         metadata={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined",
                                   "container.seccomp.security.alpha.kubernetes.io/a": "unconfined",
                                   "container.seccomp.security.alpha.kubernetes.io/b": "unknown"}}),
    case("seccompProfile_baseline", spec(ctr("a"), ctr("b")), [],
         "test/fixtures.go:baseline minimal pod, no profile anywhere"),
    # --- Sysctls
    case("sysctls", {"securityContext": {"sysctls": [{"name": "a"}, {"name": "b"}]}},
         forbidden("forbidden sysctls", "a, b"), "check_sysctls_test.go:TestSysctls_1_37/forbidden sysctls"),
    case("sysctls", {"securityContext": {"sysctls": [{"name": name, "value": "1"} for name in SAFE_SYSCTLS]}}, [],
         "check_sysctls_test.go:TestSysctls_1_27..TestSysctls_1_37/new supported sysctls, all at once"),
    case("sysctls", {"securityContext": {"sysctls": [{"name": "othersysctl", "value": "other"}]}},
         forbidden("forbidden sysctls", "othersysctl"), "test/fixtures_sysctls.go:fail"),
    # --- Volume Types
    case("restrictedVolumes", spec(ctr("x"), volumes=[
        *ALLOWED_VOLUMES,
        *({"name": f"b{i}", source: {}} for i, source in enumerate(FORBIDDEN_VOLUME_SOURCES, start=1)),
        {"name": "c1"}]),
        forbidden("restricted volume types", "volumes "
                  '"b1", "b2", "b3", "b4", "b5", "b6", "b7", "b8", "b9", "b10", "b11", "b12", "b13", "b14", "b15", '
                  '"b16", "b17", "b18", "b19", "b20", "b21", "c1" use restricted volume types "awsElasticBlockStore", '
                  '"azureDisk", "azureFile", "cephfs", "cinder", "fc", "flexVolume", "flocker", "gcePersistentDisk", '
                  '"gitRepo", "glusterfs", "hostPath", "iscsi", "nfs", "photonPersistentDisk", "portworxVolume", '
                  '"quobyte", "rbd", "scaleIO", "storageos", "unknown", "vsphereVolume"'),
        "check_restrictedVolumes_test.go:TestRestrictedVolumes/host path volumes"),
    case("restrictedVolumes", spec(ctr("x"), volumes=ALLOWED_VOLUMES), [],
         "check_restrictedVolumes_test.go:TestRestrictedVolumes/host path volumes, allowed types only"),
    # --- Privilege Escalation
    case("allowPrivilegeEscalation", spec(ctr("a"), ctr("b", {}), ctr("c", {"allowPrivilegeEscalation": True}),
                                          ctr("d", {"allowPrivilegeEscalation": False})),
         forbidden("allowPrivilegeEscalation != false",
                   'containers "a", "b", "c" must set securityContext.allowPrivilegeEscalation=false'),
         "check_allowPrivilegeEscalation_test.go:TestAllowPrivilegeEscalation_1_25/multiple containers"),
    case("allowPrivilegeEscalation", spec(ctr("a"), os={"name": "windows"}), [],
         "check_allowPrivilegeEscalation_test.go:TestAllowPrivilegeEscalation_1_25/"
         "windows pod, admit without checking privilegeEscalation"),
    case("allowPrivilegeEscalation", spec(ctr("a"), os={"name": "linux"}),
         forbidden("allowPrivilegeEscalation != false",
                   'container "a" must set securityContext.allowPrivilegeEscalation=false'),
         "check_allowPrivilegeEscalation_test.go:TestAllowPrivilegeEscalation_1_25/"
         "linux pod, reject if security context is not set"),
    case("allowPrivilegeEscalation", spec(ctr("d", {"allowPrivilegeEscalation": False})), [],
         "check_allowPrivilegeEscalation_test.go:TestAllowPrivilegeEscalation_1_25/multiple containers, only d"),
    # --- Running as Non-root
    case("runAsNonRoot", spec(ctr("a")),
         forbidden("runAsNonRoot != true", 'pod or container "a" must set securityContext.runAsNonRoot=true'),
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/no explicit runAsNonRoot"),
    case("runAsNonRoot", spec(ctr("a"), securityContext={"runAsNonRoot": False}),
         forbidden("runAsNonRoot != true", "pod must not set securityContext.runAsNonRoot=false"),
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/pod runAsNonRoot=false"),
    case("runAsNonRoot", spec(ctr("a"), ctr("b", {}), ctr("c", {"runAsNonRoot": False}),
                              ctr("d", {"runAsNonRoot": False}), ctr("e", {"runAsNonRoot": True}),
                              ctr("f", {"runAsNonRoot": True}), securityContext={"runAsNonRoot": True}),
         forbidden("runAsNonRoot != true", 'containers "c", "d" must not set securityContext.runAsNonRoot=false'),
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/containers runAsNonRoot=false"),
    case("runAsNonRoot", spec(ctr("a"), ctr("b", {}), ctr("d", {"runAsNonRoot": True}),
                              ctr("e", {"runAsNonRoot": True})),
         forbidden("runAsNonRoot != true", 'pod or containers "a", "b" must set securityContext.runAsNonRoot=true'),
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/pod nil, container fallthrough"),
    case("runAsNonRoot", {"hostUsers": False}, [],
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/host users false allowed"),
    case("runAsNonRoot", spec(ctr("a"), ctr("b", {}), ctr("e", {"runAsNonRoot": True}),
                              securityContext={"runAsNonRoot": True}), [],
         "check_runAsNonRoot_test.go:TestRunAsNonRoot/containers runAsNonRoot=false, without c, d"),
    # --- Running as Non-root user
    case("runAsUser", spec(ctr("a"), securityContext={"runAsUser": 0}),
         forbidden("runAsUser=0", "pod must not set runAsUser=0"),
         "check_runAsUser_test.go:TestRunAsUser/pod runAsUser=0"),
    case("runAsUser", spec(ctr("a"), securityContext={"runAsUser": 1000}), [],
         "check_runAsUser_test.go:TestRunAsUser/pod runAsUser=non-zero"),
    case("runAsUser", spec(ctr("a"), securityContext={"runAsUser": None}), [],
         "check_runAsUser_test.go:TestRunAsUser/pod runAsUser=nil"),
    case("runAsUser", spec(ctr("a"), ctr("b", {}), ctr("c", {"runAsUser": 0}), ctr("d", {"runAsUser": 0}),
                           ctr("e", {"runAsUser": 1}), ctr("f", {"runAsUser": 1}), securityContext={"runAsUser": 1000}),
         forbidden("runAsUser=0", 'containers "c", "d" must not set runAsUser=0'),
         "check_runAsUser_test.go:TestRunAsUser/containers runAsUser=0"),
    case("runAsUser", spec(*(ctr(name, {"runAsUser": uid}) for name, uid in zip("cdef", range(1, 5), strict=True))), [],
         "check_runAsUser_test.go:TestRunAsUser/containers runAsUser=non-zero"),
    case("runAsUser", {"hostUsers": False}, [], "check_runAsUser_test.go:TestRunAsUser/host users false allowed"),
    # --- Seccomp (restricted)
    case("seccompProfile_restricted", spec(ctr("a")),
         forbidden("seccompProfile", f'pod or container "a" {SECCOMP_MUST_SET}'),
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/no explicit seccomp"),
    case("seccompProfile_restricted", spec(ctr("a"), os={"name": "windows"}), [],
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/no explicit seccomp, windows Pod"),
    case("seccompProfile_restricted", spec(ctr("a"), os={"name": "linux"}),
         forbidden("seccompProfile", f'pod or container "a" {SECCOMP_MUST_SET}'),
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/no explicit seccomp, linux pod"),
    case("seccompProfile_restricted", spec(ctr("a"), securityContext=UNCONFINED),
         forbidden("seccompProfile", 'pod must not set securityContext.seccompProfile.type to "Unconfined"'),
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/pod seccomp invalid"),
    case("seccompProfile_restricted", spec(*seccomp_containers(), securityContext=RUNTIME_DEFAULT),
         forbidden("seccompProfile",
                   'containers "c", "d" must not set securityContext.seccompProfile.type to "Unconfined"'),
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/containers seccomp invalid"),
    case("seccompProfile_restricted",
         spec(ctr("a"), ctr("b", {}), ctr("d", RUNTIME_DEFAULT), ctr("e", RUNTIME_DEFAULT)),
         forbidden("seccompProfile", f'pod or containers "a", "b" {SECCOMP_MUST_SET}'),
         "check_seccompProfile_restricted_test.go:TestSeccompProfileRestricted_1_25/pod nil, container fallthrough"),
    case("seccompProfile_restricted",
         spec(ctr("a"), securityContext={"seccompProfile": {"type": "Localhost", "localhostProfile": "testing"}}),
         [], "test/fixtures_seccompProfile_restricted.go:pass/pod Localhost"),
    case("seccompProfile_restricted", {"initContainers": [ctr("init", {"seccompProfile": {"type": "Localhost"}})],
                                       "containers": [ctr("main", RUNTIME_DEFAULT)]},
         [], "test/fixtures_seccompProfile_restricted.go:pass/every container, no pod profile"),
    case("seccompProfile_restricted",
         {"initContainers": [ctr("init", UNCONFINED)], "containers": [ctr("main", RUNTIME_DEFAULT)]},
         forbidden("seccompProfile",
                   'container "init" must not set securityContext.seccompProfile.type to "Unconfined"'),
         "test/fixtures_seccompProfile_restricted.go:fail/init container Unconfined, no pod profile"),
    # --- Capabilities (restricted)
    case("capabilities_restricted", spec(
        ctr("a", {"capabilities": {"add": ["FOO", "BAR"]}}), ctr("b", {"capabilities": {"add": ["BAR", "BAZ"]}}),
        ctr("c", {"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN"], "drop": ["ALL", "FOO"]}})),
        forbidden("unrestricted capabilities",
                  'containers "a", "b" must set securityContext.capabilities.drop=["ALL"]; containers "a", "b", "c" '
                  'must not include "BAR", "BAZ", "CHOWN", "FOO" in securityContext.capabilities.add'),
        "check_capabilities_restricted_test.go:TestCapabilitiesRestricted_1_25/multiple containers"),
    case("capabilities_restricted", spec(ctr("a"), os={"name": "windows"}), [],
         "check_capabilities_restricted_test.go:TestCapabilitiesRestricted_1_25/"
         "windows pod, admit without checking capabilities"),
    case("capabilities_restricted", spec(ctr("a"), os={"name": "linux"}),
         forbidden("unrestricted capabilities", 'container "a" must set securityContext.capabilities.drop=["ALL"]'),
         "check_capabilities_restricted_test.go:TestCapabilitiesRestricted_1_25/"
         "linux pod, reject if security context is not set"),
    case("capabilities_restricted", {"initContainers": [ctr("init", {"capabilities": {"drop": ["ALL"],
                                                                                     "add": ["NET_BIND_SERVICE"]}})],
                                     "containers": [ctr("main", {"capabilities": {"drop": ["ALL"],
                                                                                  "add": ["NET_BIND_SERVICE"]}})]},
         [], "test/fixtures_capabilities_restricted.go:pass/drop ALL, add NET_BIND_SERVICE"),
    case("capabilities_restricted", spec(ctr("main", {"capabilities": {"drop": ALL_CAPS_ONE_BY_ONE}})),
         forbidden("unrestricted capabilities", 'container "main" must set securityContext.capabilities.drop=["ALL"]'),
         "test/fixtures_capabilities_restricted.go:fail/every capability named but not ALL"),
    # Upstream compares with "ALL" verbatim.
    case("capabilities_restricted", spec(ctr("main", {"capabilities": {"drop": ["all"]}})),
         forbidden("unrestricted capabilities", 'container "main" must set securityContext.capabilities.drop=["ALL"]'),
         "check_capabilities_restricted.go:drop compared verbatim"),
]


@pytest.mark.parametrize(("control", "metadata", "pod_spec", "expected"), UPSTREAM_CASES)
def test_control_reports_upstream_reason_and_detail(control: str, metadata: Obj, pod_spec: Obj,
                                                    expected: list[str]) -> None:
    assert CONTROLS[control](metadata, pod_spec) == expected


def test_every_control_has_an_allowed_and_a_forbidden_upstream_case() -> None:
    outcomes: dict[str, set[bool]] = {}
    for param in UPSTREAM_CASES:
        control, _, _, expected = param.values
        outcomes.setdefault(control, set()).add(bool(expected))
    assert outcomes == {control: {True, False} for control in CONTROLS}


def test_apparmor_annotation_values_are_quoted_as_go_does() -> None:
    metadata = {"annotations": {APPARMOR + "a": 'un"confined\n'}}
    assert CONTROLS["appArmorProfile"](metadata, {}) == forbidden(
        "forbidden AppArmor profile",
        f'annotation must not set AppArmor profile type to "{APPARMOR}a="un\\"confined\\n""')


def test_ephemeral_containers_are_checked_after_init_and_regular_ones() -> None:
    pod_spec = {"initContainers": [ctr("init", {"privileged": True})],
                "containers": [ctr("main", {"privileged": True})],
                "ephemeralContainers": [ctr("debug", {"privileged": True})]}
    assert CONTROLS["privileged"]({}, pod_spec) == forbidden(
        "privileged", 'containers "init", "main", "debug" must not set securityContext.privileged=true')


# --- profiles ------------------------------------------------------------------------------------------

# test/fixtures.go: the minimal valid pods of each profile at the newest version.
MINIMAL_BASELINE = {"spec": {"initContainers": [ctr("initcontainer1", image="registry.k8s.io/pause")],
                             "containers": [ctr("container1", image="registry.k8s.io/pause")]}}


def restricted_context() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


PAUSE = "registry.k8s.io/pause"
MINIMAL_RESTRICTED = {"spec": {"initContainers": [ctr("initcontainer1", restricted_context(), image=PAUSE)],
                               "containers": [ctr("container1", restricted_context(), image=PAUSE)],
                               "securityContext": {"runAsNonRoot": True, **RUNTIME_DEFAULT}}}
# None of the restricted requirements after 1.0 apply to a pod that says it is Windows.
MINIMAL_RESTRICTED_WINDOWS = {"spec": {**MINIMAL_BASELINE["spec"], "os": {"name": "windows"},
                                       "securityContext": {"runAsNonRoot": True}}}


def test_upstream_minimal_baseline_pod_passes_baseline_but_not_restricted() -> None:
    assert baseline_violations(MINIMAL_BASELINE) == []
    assert restricted_violations(MINIMAL_BASELINE) == [
        *forbidden("allowPrivilegeEscalation != false",
                   'containers "initcontainer1", "container1" must set securityContext.allowPrivilegeEscalation=false'),
        *forbidden("unrestricted capabilities",
                   'containers "initcontainer1", "container1" must set securityContext.capabilities.drop=["ALL"]'),
        *forbidden("runAsNonRoot != true",
                   'pod or containers "initcontainer1", "container1" must set securityContext.runAsNonRoot=true'),
        *forbidden("seccompProfile", f'pod or containers "initcontainer1", "container1" {SECCOMP_MUST_SET}'),
    ]


@pytest.mark.parametrize("template", [MINIMAL_RESTRICTED, MINIMAL_RESTRICTED_WINDOWS], ids=["base", "base_windows"])
def test_upstream_minimal_restricted_pods_pass_restricted(template: Obj) -> None:
    assert restricted_violations(template) == []


def test_restricted_runs_baseline_checks_first_then_its_own_in_check_id_order() -> None:
    # sysctls (baseline) before allowPrivilegeEscalation (restricted), though "a" sorts before "s".
    template = {"spec": {**MINIMAL_RESTRICTED["spec"], "hostPID": True,
                         "securityContext": {"runAsNonRoot": True, "sysctls": [{"name": "kernel.msgmax", "value": "1"}],
                                             **RUNTIME_DEFAULT},
                         "containers": [ctr("container1", {"capabilities": {"drop": ["ALL"]}})]}}
    assert restricted_violations(template) == [
        *forbidden("host namespaces", "hostPID=true"),
        *forbidden("forbidden sysctls", "kernel.msgmax"),
        *forbidden("allowPrivilegeEscalation != false",
                   'container "container1" must set securityContext.allowPrivilegeEscalation=false'),
    ]


@pytest.mark.parametrize(("weaken", "baseline", "restricted"), [
    pytest.param(lambda s: s["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
                 forbidden("hostPath volumes", 'volume "host"'),
                 forbidden("restricted volume types", 'volume "host" uses restricted volume type "hostPath"'),
                 id="restrictedVolumes replaces hostPathVolumes"),
    pytest.param(lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["NET_RAW"]),
                 forbidden("non-default capabilities",
                           'container "container1" must not include "NET_RAW" in securityContext.capabilities.add'),
                 forbidden("unrestricted capabilities",
                           'container "container1" must not include "NET_RAW" in securityContext.capabilities.add'),
                 id="capabilities_restricted replaces capabilities_baseline"),
    pytest.param(lambda s: s["securityContext"].update(UNCONFINED),
                 forbidden("seccompProfile", 'pod must not set securityContext.seccompProfile.type to "Unconfined"'),
                 forbidden("seccompProfile", 'pod must not set securityContext.seccompProfile.type to "Unconfined"'),
                 id="seccompProfile_restricted replaces seccompProfile_baseline"),
    pytest.param(lambda s: [s.update(hostUsers=False),
                            s["containers"][0]["securityContext"].update(procMount="Unmasked")],
                 [],
                 forbidden("procMount", 'container "container1" must not set securityContext.procMount to "Unmasked"'),
                 id="procMount_restricted replaces procMount, which a user namespace relaxes"),
])
def test_restricted_replaces_the_baseline_check_it_tightens(weaken: Callable[[Obj], Any], baseline: list[str],
                                                             restricted: list[str]) -> None:
    template = copy.deepcopy(MINIMAL_RESTRICTED)
    template["spec"]["volumes"] = []
    weaken(template["spec"])
    assert baseline_violations(template) == baseline
    assert restricted_violations(template) == restricted


def test_profiles_see_a_volume_without_a_source_as_the_emptydir_the_api_server_defaults_it_to() -> None:
    # test/fixtures_restrictedVolumes.go passes {name: volume0} as an "implicit empty dir"; the check alone does not.
    template = {"spec": {**MINIMAL_RESTRICTED["spec"], "volumes": [{"name": "volume0"}]}}
    assert restricted_violations(template) == []
    assert CONTROLS["restrictedVolumes"]({}, template["spec"]) == forbidden(
        "restricted volume types", 'volume "volume0" uses restricted volume type "unknown"')


# --- the engine pod ------------------------------------------------------------------------------------

ENGINE, FETCH = "engine", "fetch-model"


def hardened() -> Obj:
    """The engine pod template as the operator should render it: restricted in every container."""

    def container(name: str, **fields: Any) -> Obj:
        return ctr(name, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                          "readOnlyRootFilesystem": True}, image="ghcr.io/example/governor:0.1.0", **fields)

    def http_probe(path: str) -> Obj:
        return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}

    return {
        "metadata": {"labels": {"app.kubernetes.io/name": "governor-engine"},
                     "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, **RUNTIME_DEFAULT},
            "initContainers": [container(FETCH, volumeMounts=[{"name": "hf-cache", "mountPath": "/hf"}])],
            "containers": [container(
                ENGINE, ports=[{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                startupProbe=http_probe("/health"), livenessProbe=http_probe("/health"),
                readinessProbe=http_probe("/ready"),
                volumeMounts=[{"name": "hf-cache", "mountPath": "/hf", "readOnly": True},
                              {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}])],
            "volumes": [
                {"name": "hf-cache", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                {"name": "tmp", "emptyDir": {}},
                {"name": "knobs", "configMap": {"name": "chat-knobs"}},
                {"name": "admin-token", "secret": {"secretName": "chat-admin"}},
                {"name": "model-pvc-0", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
            ],
        },
    }


def failing_controls(template: Obj) -> dict[str, list[str]]:
    """The restricted controls that forbid `template`, with what each reports."""
    spec_ = template["spec"]
    reports = {name: CONTROLS[name](template["metadata"], spec_) for name in RESTRICTED_CONTROLS}
    return {name: report for name, report in reports.items() if report}


def pod(t: Obj) -> Obj:
    return t["spec"]


def pod_context(t: Obj) -> Obj:
    return t["spec"]["securityContext"]


def container_of(t: Obj, name: str) -> Obj:
    return next(c for c in [*t["spec"]["initContainers"], *t["spec"]["containers"]] if c["name"] == name)


def context_of(t: Obj, name: str) -> Obj:
    return container_of(t, name)["securityContext"]


def test_hardened_engine_pod_passes_restricted_and_baseline() -> None:
    assert restricted_violations(hardened()) == []
    assert baseline_violations(hardened()) == []


# Each entry weakens the hardened pod in one way; exactly one control must object, with this message.
WEAKENINGS = [
    pytest.param(lambda t: pod_context(t).update(runAsNonRoot=False), "runAsNonRoot",
                 "runAsNonRoot != true (pod must not set securityContext.runAsNonRoot=false)",
                 id="pod runAsNonRoot=false"),
    pytest.param(lambda t: pod_context(t).pop("runAsNonRoot"), "runAsNonRoot",
                 f'runAsNonRoot != true (pod or containers "{FETCH}", "{ENGINE}" must set '
                 "securityContext.runAsNonRoot=true)", id="pod runAsNonRoot unset"),
    pytest.param(lambda t: context_of(t, ENGINE).update(runAsNonRoot=False), "runAsNonRoot",
                 f'runAsNonRoot != true (container "{ENGINE}" must not set securityContext.runAsNonRoot=false)',
                 id="container overrides runAsNonRoot=false"),
    pytest.param(lambda t: pod_context(t).update(runAsUser=0), "runAsUser",
                 "runAsUser=0 (pod must not set runAsUser=0)", id="pod runAsUser=0"),
    pytest.param(lambda t: context_of(t, FETCH).update(runAsUser=0), "runAsUser",
                 f'runAsUser=0 (container "{FETCH}" must not set runAsUser=0)', id="init container runAsUser=0"),
    pytest.param(lambda t: pod_context(t).pop("seccompProfile"), "seccompProfile_restricted",
                 f'seccompProfile (pod or containers "{FETCH}", "{ENGINE}" {SECCOMP_MUST_SET})',
                 id="pod seccompProfile unset"),
    pytest.param(lambda t: pod_context(t).update(UNCONFINED), "seccompProfile_restricted",
                 'seccompProfile (pod must not set securityContext.seccompProfile.type to "Unconfined")',
                 id="pod seccompProfile Unconfined"),
    pytest.param(lambda t: context_of(t, ENGINE).update(UNCONFINED), "seccompProfile_restricted",
                 f'seccompProfile (container "{ENGINE}" must not set securityContext.seccompProfile.type to '
                 '"Unconfined")',
                 id="container seccompProfile Unconfined"),
    pytest.param(lambda t: context_of(t, ENGINE).pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation",
                 f'allowPrivilegeEscalation != false (container "{ENGINE}" must set '
                 "securityContext.allowPrivilegeEscalation=false)", id="allowPrivilegeEscalation unset"),
    pytest.param(lambda t: context_of(t, FETCH).update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation",
                 f'allowPrivilegeEscalation != false (container "{FETCH}" must set '
                 "securityContext.allowPrivilegeEscalation=false)", id="init container allowPrivilegeEscalation=true"),
    pytest.param(lambda t: context_of(t, ENGINE)["capabilities"].pop("drop"), "capabilities_restricted",
                 f'unrestricted capabilities (container "{ENGINE}" must set securityContext.capabilities.drop=["ALL"])',
                 id="capabilities drop unset"),
    pytest.param(lambda t: context_of(t, FETCH)["capabilities"].update(add=["SYS_ADMIN"]), "capabilities_restricted",
                 f'unrestricted capabilities (container "{FETCH}" must not include "SYS_ADMIN" in '
                 "securityContext.capabilities.add)", id="init container adds SYS_ADMIN"),
    pytest.param(lambda t: pod(t)["volumes"].append({"name": "host", "hostPath": {"path": "/var/lib"}}),
                 "restrictedVolumes",
                 'restricted volume types (volume "host" uses restricted volume type "hostPath")',
                 id="hostPath volume"),
    pytest.param(lambda t: pod(t)["volumes"].append({"name": "shared", "nfs": {"server": "nfs", "path": "/"}}),
                 "restrictedVolumes",
                 'restricted volume types (volume "shared" uses restricted volume type "nfs")', id="nfs volume"),
    pytest.param(lambda t: pod(t).update(hostNetwork=True), "hostNamespaces",
                 "host namespaces (hostNetwork=true)", id="hostNetwork"),
    pytest.param(lambda t: context_of(t, ENGINE).update(privileged=True), "privileged",
                 f'privileged (container "{ENGINE}" must not set securityContext.privileged=true)', id="privileged"),
    pytest.param(lambda t: container_of(t, ENGINE)["ports"][0].update(hostPort=8000), "hostPorts",
                 f'hostPort (container "{ENGINE}" uses hostPort 8000)', id="hostPort"),
    pytest.param(lambda t: container_of(t, ENGINE)["readinessProbe"]["httpGet"].update(host="127.0.0.1"),
                 "hostProbesAndHostLifecycle",
                 f'probe or lifecycle host (container "{ENGINE}" uses probe or lifecycle host "127.0.0.1")',
                 id="probe host"),
    pytest.param(lambda t: pod_context(t).update(sysctls=[{"name": "kernel.msgmax", "value": "65536"}]), "sysctls",
                 "forbidden sysctls (kernel.msgmax)", id="unsafe sysctl"),
    pytest.param(lambda t: context_of(t, ENGINE).update(procMount="Unmasked"), "procMount_restricted",
                 f'procMount (container "{ENGINE}" must not set securityContext.procMount to "Unmasked")',
                 id="procMount Unmasked"),
    pytest.param(lambda t: pod_context(t).update(seLinuxOptions={"type": "spc_t"}), "seLinuxOptions",
                 'seLinuxOptions (pod set forbidden securityContext.seLinuxOptions: type "spc_t")', id="SELinux spc_t"),
    pytest.param(lambda t: context_of(t, ENGINE).update(appArmorProfile={"type": "Unconfined"}), "appArmorProfile",
                 f'forbidden AppArmor profile (container "{ENGINE}" must not set AppArmor profile type to '
                 '"Unconfined")',
                 id="AppArmor Unconfined"),
    pytest.param(lambda t: pod_context(t).update(windowsOptions={"hostProcess": True}), "windowsHostProcess",
                 "hostProcess (pod must not set securityContext.windowsOptions.hostProcess=true)", id="hostProcess"),
]


@pytest.mark.parametrize(("weaken", "control", "message"), WEAKENINGS)
def test_each_weakening_of_the_hardened_pod_fails_its_control(weaken: Callable[[Obj], Any], control: str,
                                                              message: str) -> None:
    template = hardened()
    weaken(template)
    assert failing_controls(template) == {control: [message]}
    assert restricted_violations(template) == [message]


def test_an_unhardened_ephemeral_container_fails_escalation_and_capabilities_only() -> None:
    # runAsNonRoot and seccomp come from the pod; the two per-container settings do not.
    template = hardened()
    pod(template)["ephemeralContainers"] = [ctr("debug", image="busybox", targetContainerName=ENGINE)]
    assert failing_controls(template) == {
        "allowPrivilegeEscalation": ['allowPrivilegeEscalation != false (container "debug" must set '
                                     "securityContext.allowPrivilegeEscalation=false)"],
        "capabilities_restricted": ['unrestricted capabilities (container "debug" must set '
                                    'securityContext.capabilities.drop=["ALL"])'],
    }


@pytest.mark.parametrize("change", [
    pytest.param(lambda t: context_of(t, ENGINE)["capabilities"].update(add=["NET_BIND_SERVICE"]),
                 id="adding NET_BIND_SERVICE"),
    pytest.param(lambda t: context_of(t, ENGINE).update(readOnlyRootFilesystem=False),
                 id="readOnlyRootFilesystem is not a Pod Security control"),
    pytest.param(lambda t: [pod_context(t).pop("seccompProfile"),
                            context_of(t, FETCH).update(seccompProfile={"type": "Localhost", "localhostProfile": "p"}),
                            context_of(t, ENGINE).update(RUNTIME_DEFAULT)],
                 id="seccompProfile on every container instead of the pod"),
    pytest.param(lambda t: [pod_context(t).pop("runAsNonRoot"),
                            *(context_of(t, name).update(runAsNonRoot=True) for name in (FETCH, ENGINE))],
                 id="runAsNonRoot on every container instead of the pod"),
    pytest.param(lambda t: [pod(t).update(hostUsers=False), pod_context(t).update(runAsUser=0),
                            pod_context(t).pop("runAsNonRoot")],
                 id="root inside a user namespace"),
    pytest.param(lambda t: pod(t)["volumes"].append({"name": "weights", "image": {"reference": "ghcr.io/m:1"}}),
                 id="image volume"),
    pytest.param(lambda t: container_of(t, ENGINE)["ports"][0].update(hostPort=0), id="hostPort 0"),
    pytest.param(lambda t: context_of(t, ENGINE).update(procMount="Default"), id="procMount Default"),
    pytest.param(lambda t: pod_context(t).update(sysctls=[{"name": "net.ipv4.tcp_keepalive_time", "value": "600"}]),
                 id="safe sysctl"),
])
def test_changes_the_restricted_profile_allows(change: Callable[[Obj], Any]) -> None:
    template = hardened()
    change(template)
    assert restricted_violations(template) == []


def test_baseline_orders_check_ids_by_bytes_as_go_sorts_them() -> None:
    # "seLinuxOptions" sorts before "seccompProfile_baseline" because "L" < "c".
    template = {"spec": {"containers": [ctr("a")], "securityContext": {"seLinuxOptions": {"role": "r"}, **UNCONFINED}}}
    assert baseline_violations(template) == [
        *forbidden("seLinuxOptions", "pod set forbidden securityContext.seLinuxOptions: role may not be set"),
        *forbidden("seccompProfile", 'pod must not set securityContext.seccompProfile.type to "Unconfined"'),
    ]
