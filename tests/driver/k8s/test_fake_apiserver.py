"""The stand-in speaks what the official client expects: the calls the operator makes, errors with
Status bodies, watches, patches, the status subresource, admission, RBAC and garbage collection."""
from __future__ import annotations

import threading

import pytest
from k8s_support import NS, OPERATOR_USER, wait_for
from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from megascale.driver.k8s.crd import crd
from megascale.driver.k8s.informer import Informer
from megascale.driver.k8s.kube import Kube, connect, reason


def pod(name: str, **labels) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}}


def job(name: str, **spec) -> dict:
    return {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"image": "i", "nodes": 2, "devicesPerNode": 1, "parallelism": {"dp": 2},
                     "config": {"inline": {}}, **spec}}


@pytest.fixture
def admin(apiserver) -> Kube:
    return Kube(connect(apiserver[1]))


def test_pods_create_list_get_delete_with_status_bodies(admin, apiserver):
    assert admin.create_pod(NS, pod("a", app="x"))
    assert not admin.create_pod(NS, pod("a", app="x"))  # 409 AlreadyExists
    admin.create_pod(NS, pod("b", app="y"))
    assert [p["metadata"]["name"] for p in admin.list_pods(NS, "app=x")] == ["a"]
    listed = admin.core.list_namespaced_pod(NS)  # typed models deserialize too
    assert sorted(p.metadata.name for p in listed.items) == ["a", "b"] and listed.items[0].status.phase == "Pending"
    assert admin.delete_pod(NS, "a") and not admin.delete_pod(NS, "a")
    with pytest.raises(ApiException) as e:
        admin.core.read_namespaced_pod("a", NS)
    assert e.value.status == 404 and reason(e.value) == 'pods "a" not found'


def test_watch_streams_changes_after_a_resource_version(admin):
    listing = admin.core.list_namespaced_pod(NS)
    seen: list[tuple[str, str]] = []
    w = watch.Watch()

    def follow():
        for event in w.stream(admin.core.list_namespaced_pod, NS, label_selector="app=x",
                              resource_version=listing.metadata.resource_version, timeout_seconds=10):
            seen.append((event["type"], event["object"].metadata.name))
            if len(seen) == 3:
                w.stop()
    t = threading.Thread(target=follow)
    t.start()
    admin.create_pod(NS, pod("a", app="x"))
    admin.create_pod(NS, pod("other", app="y"))  # filtered out by the selector
    admin.core.patch_namespaced_pod("a", NS, {"metadata": {"annotations": {"k": "v"}}},
                                    _content_type="application/strategic-merge-patch+json")
    admin.delete_pod(NS, "a")
    t.join(timeout=10)
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]


def test_informer_relists_after_410_gone(admin, apiserver):
    api = apiserver[0]
    changes = []
    informer = Informer("pods", admin.core.list_namespaced_pod, lambda kind, obj: changes.append(kind),
                        watch_timeout_s=1, namespace=NS).start()
    try:
        assert informer.synced.wait(5)
        admin.create_pod(NS, pod("a"))
        wait_for(lambda: ("megascale", "a") in informer.items, 5, "the informer to see pod a")
        relists = sum(1 for r in api.requests if r[1] == "list")
        api.compact()  # the open watch's resourceVersion is now too old: 410 Gone
        admin.create_pod(NS, pod("b"))
        wait_for(lambda: ("megascale", "b") in informer.items, 10, "a relist to find pod b")
        assert sum(1 for r in api.requests if r[1] == "list") > relists
    finally:
        informer.stop()


def test_custom_resources_admission_generation_and_status_subresource(admin, apiserver):
    assert admin.apply_crd(crd()) == "created" and admin.apply_crd(crd()) == "replaced"
    created = admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", job("j1"))
    assert created["spec"]["policy"]["heartbeatSeconds"] == 2.0 and created["spec"]["paused"] is False  # defaults
    with pytest.raises(ApiException) as e:
        admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs",
                                                     job("j2", nodes=3))  # 3 x 1 != dp 2
    assert e.value.status == 422 and "world size" in reason(e.value)

    spec_patch = admin.patch_job(NS, "j1", {"spec": {"paused": True}, "status": {"phase": "Running"}})
    assert spec_patch["metadata"]["generation"] == 2 and "status" not in spec_patch  # the main resource ignores status
    status_patch = admin.patch_job_status(NS, "j1", {"phase": "Running", "step": 3})
    assert status_patch["status"] == {"phase": "Running", "step": 3} and status_patch["metadata"]["generation"] == 2
    with pytest.raises(ApiException) as e:
        admin.patch_job_status(NS, "j1", {"phase": "Sleeping"})
    assert e.value.status == 422 and "status.phase" in reason(e.value)


def test_rbac_forbids_what_the_role_does_not_grant(apiserver):
    api, _, operator_config = apiserver
    operator = Kube(connect(operator_config))
    operator.create_pod(NS, pod("a"))  # granted in its namespace
    with pytest.raises(ApiException) as e:
        operator.create_pod("default", pod("a"))
    assert e.value.status == 403 and f'User "{OPERATOR_USER}" cannot create resource "pods"' in reason(e.value)
    with pytest.raises(ApiException) as e:
        operator.core.read_namespaced_pod("a", NS)  # get is not granted: the operator lists
    assert e.value.status == 403
    assert (OPERATOR_USER, "create", "", "pods", "default", 403) in api.requests


def test_deleting_an_owner_collects_its_dependents(admin, apiserver):
    admin.apply_crd(crd())
    owner = admin.custom.create_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", job("j1"))
    ref = {"apiVersion": "megascale.io/v1alpha1", "kind": "TrainingJob", "name": "j1",
           "uid": owner["metadata"]["uid"], "controller": True}
    admin.create_pod(NS, {**pod("owned"), "metadata": {"name": "owned", "ownerReferences": [ref]}})
    admin.create_pod(NS, pod("free"))
    admin.custom.delete_namespaced_custom_object("megascale.io", "v1alpha1", NS, "trainingjobs", "j1")
    assert [p["metadata"]["name"] for p in admin.list_pods(NS, "")] == ["free"]
