"""The operator's load on the API server and etcd stays bounded: lists in pages (an expired continue token
relists), watches resumed where a dropped connection left them (no relist), machines cached trimmed, drivers
reading their pods from the operator's cache instead of listing them, and a status that stays small
whatever the job's history."""
from __future__ import annotations

import json

import yaml
from k8s_support import NS, wait_for
from megascale.driver.k8s import informer as informer_module
from megascale.driver.k8s import kube as kube_module
from megascale.driver.k8s.caches import PodCache, trim_machine
from megascale.driver.k8s.informer import Informer
from megascale.driver.k8s.kube import Kube, connect
from megascale.driver.k8s.status import HISTORY, build
from megascale.driver.state import JobRecord, JobState, NodeSlot

from megascale.common.embedded_redis import EmbeddedRedis


def pod(name: str, job: str = "gpt", node: str = "n0") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": NS, "labels": {"megascale.io/job": job, "megascale.io/node": node},
        "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}]},
        "spec": {"nodeName": "m0", "containers": [{"name": "executor", "image": "megascale:test"}],
                 "affinity": {"nodeAffinity": {"huge": ["m"] * 100}}}}


def calls(api, verb: str, resource: str) -> list:
    return [r for r in api.requests if r[1] == verb and r[3] == resource]


def test_lists_page_relist_on_an_expired_continue_and_a_dropped_watch_resumes(apiserver, monkeypatch):
    api, admin_config, _ = apiserver
    admin = Kube(connect(admin_config))
    for i in range(7):
        api.put(pod(f"p{i}"))
    monkeypatch.setattr(informer_module, "PAGE", 3)
    monkeypatch.setattr(kube_module, "PAGE", 3)
    serve, served = api.page, []

    def page(kind, items, query):  # etcd compacts between the first and the second page, once
        served.append(bool(query.get("continue")))
        if served == [False, True]:
            api.compact()
        return serve(kind, items, query)
    monkeypatch.setattr(api, "page", page)
    seen = Informer("pods", admin.core.list_namespaced_pod, lambda kind, obj: None, watch_timeout_s=1,
                    namespace=NS).start()
    try:
        assert seen.synced.wait(10) and len(seen.items) == 7
        # pages of 3: the first, 410 Gone on the expired token, then a fresh list of 3 + 3 + 1
        assert served == [False, True, False, True, True] and len(calls(api, "list", "pods")) == 4
        assert len(admin.list_pods(NS, "")) == 7 and served[5:] == [False, True, True]  # Kube's lists page too

        lists, watches = len(calls(api, "list", "pods")), len(calls(api, "watch", "pods"))
        api.drop_watches()  # the connection breaks mid-stream; the next change comes on a resumed watch
        api.put(pod("late"))
        wait_for(lambda: (NS, "late") in seen.items, 10, "the informer to see the pod created after the drop")
        assert len(calls(api, "list", "pods")) == lists and len(calls(api, "watch", "pods")) == watches + 1
    finally:
        seen.stop()


def test_machines_are_cached_trimmed_and_drivers_read_pods_from_the_operator_cache(apiserver):
    api, _, operator_config = apiserver
    machine = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "m0", "labels": {"pool": "a"}},
               "spec": {"unschedulable": True, "podCIDR": "10.0.0.0/24"},
               "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "DiskPressure"}],
                          "images": [{"names": [f"img{i}"], "sizeBytes": 1} for i in range(50)],
                          "capacity": {"cpu": "64"}}}
    trimmed = trim_machine(api.put(machine))
    assert trimmed["spec"] == {"unschedulable": True} and set(trimmed["status"]) == {"conditions"}
    assert trimmed["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert trimmed["metadata"]["labels"] == {"pool": "a"} and len(json.dumps(trimmed)) * 5 < len(json.dumps(machine))

    with EmbeddedRedis() as redis_server:
        cache = PodCache(redis_server.client(), "megascale.gpt")
        stored = api.put(pod("gpt-n0"))
        driver = Kube(connect(operator_config), pods=cache)
        assert driver.job_pods(NS, "gpt") == [stored]  # nothing published yet: listed
        assert cache.publish({"n0": stored}) and not cache.publish({"n0": stored})  # written once, on change
        before = len(api.requests)
        for _ in range(60):  # a driver's minute: it looks at its pods about once a second
            pods = driver.job_pods(NS, "gpt")
        assert len(api.requests) == before  # no API call at all
        assert [p["metadata"]["name"] for p in pods] == ["gpt-n0"] and "managedFields" not in pods[0]["metadata"]
        assert "affinity" not in pods[0]["spec"] and pods[0]["spec"]["nodeName"] == "m0"


def test_the_status_of_a_job_with_thousands_of_replacements_stays_small():
    rec = JobRecord(job="megascale.gpt", config={}, run_dir="/r", state=JobState.RUNNING)
    rec.nodes = [NodeSlot(f"n{i}", "evicted", None, True, dead="no heartbeat") for i in range(5000)]
    rec.nodes += [NodeSlot(f"n{5000 + i}", "active", i, True) for i in range(64)] + [NodeSlot("n5064", "spare")]
    hosts = [f"machine-{i:05d}" for i in range(5000)]
    status = build({}, rec, None, generation=1, paused=False, evicted_hosts=hosts,
                   hosts={f"n{i}": f"machine-{i:05d}" for i in range(5065)}, checkpoint=None, extra_conditions=[],
                   name="gpt", now=0.0)
    size = len(yaml.safe_dump(status))
    assert size < 32 * 1024, size  # etcd's limit is 1.5 MiB; every node ever used would be ~0.9 MiB here
    evicted = [n["id"] for n in status["nodes"] if n["role"] == "evicted"]
    assert evicted == [f"n{i}" for i in range(5000 - HISTORY, 5000)]
    assert sum(n["role"] != "evicted" for n in status["nodes"]) == 65
    assert len(status["evictedNodes"]) == HISTORY and status["evictedNodesTotal"] == 5000
    rec.nodes.append(NodeSlot("n5065", "evicted", None, True, dead="no heartbeat"))  # one more, on a new machine
    again = build(status, rec, None, generation=1, paused=False, evicted_hosts=hosts + ["new-machine"],
                  hosts={"n5065": "new-machine"}, checkpoint=None, extra_conditions=[], name="gpt", now=1.0)
    assert again["evictedNodes"][-1] == "new-machine" and again["evictedNodes"][:-1] == status["evictedNodes"][1:]
