"""Kubernetes: the TrainingJob custom resource, an operator that runs each job's driver, and a backend
whose nodes are pods. The driver's logic is the same as with local processes (`driver/backend.py`).

    crd.py        the CustomResourceDefinition, generated from Python (deploy/crd.yaml is its output)
    spec.py       TrainingJob spec -> JobConfig, the pods / Service / ConfigMap around a job, and what a
                  pod spec may ask for (check_pod_spec)
    credentials.py  per job: a Redis ACL user, a Secret with its secrets file, a NetworkPolicy
    kube.py       the official client as used here: raw JSON objects, paged lists, fenced writes, Events
    informer.py   list + watch caches (the operator's TrainingJobs, pods, machines)
    leader.py     leader election among operator replicas (a Lease), and the fence on their writes
    caches.py     what the operator caches of pods and machines; each job's pods published for its driver
    api_retry.py  which API errors are retried (429, 5xx, timeouts: every call) and which are refusals
    ownership.py  what is a job's: objects whose controller ownerReference carries its UID
    failures.py   why a pod ended, from its own evidence: preempted, evicted, OOMKilled, never started, crashed
    gang.py       gang scheduling (spec.scheduling): PodGroups for Volcano / scheduler-plugins, Kueue's pod
                  group labels and gate, the Unschedulable condition
    hardware.py   what a pod asks of its machine: extended resources, host network, a checkpoint volume
    backend.py    Backend over pods: start / stop / list / evict (anti-affinity to evicted machines)
    jobdriver.py  `python -m megascale.driver.k8s.jobdriver`: one job's driver with that backend
    adoption.py   the operator's first step for a job: config, pod spec check, submission, its objects
    operator.py   watches TrainingJobs, runs a driver per job, evicts failed nodes, cordons machines
                  that failed a self-check, writes status
    health.py     which nodes the operator evicts, from pods and Kubernetes nodes; which machines it cordons
    evictions.py  the operator's eviction step: failures reported as Events, disruptions turned into evictions
    status.py     the TrainingJob status: phase, progress, ETTR, conditions
    cli.py        `megascale kube {apply-crd,operator,pause,resume,status}`
"""
from .spec import API_VERSION, GROUP, KIND, PLURAL, VERSION

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION"]
