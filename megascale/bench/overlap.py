"""`megascale bench overlap`: step time and exposed communication per kind with
overlap off vs on, for tp2×pp2×dp2, tp=2 and dp=2 on loopback, plus the measured pipeline bubble;
and tp2×pp2×dp2 on an emulated network (`emulated`), where communication costs wall time on a link."""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from typing import Callable, Iterator

from megascale.common import netemu
from megascale.config import ClusterConfig, JobConfig, from_dict
from megascale.launch import run_ranks
from megascale.train import layout_of
from megascale.parallel.bubble import measure_bubble
from megascale.parallel.topology import Layout, ParallelContext
from megascale.timers import COMM_KINDS

LAYOUTS = {"tp2_pp2_dp2": {"tp": 2, "pp": 2, "dp": 2}, "tp2": {"tp": 2}, "dp2": {"dp": 2}}


def overlap_job(parallelism: dict, overlap: bool, quick: bool) -> JobConfig:
    return from_dict({
        "model": {"layers": 4, "hidden": 128 if quick else 256, "heads": 4, "ffn": 512 if quick else 1024,
                  "vocab": 1024, "seq": 64 if quick else 128},
        "parallelism": {**parallelism, "sequence_parallel": parallelism.get("tp", 1) > 1,
                        "overlap": {"tp": overlap, "pp": overlap, "dp": overlap}},
        "batch": {"micro": 4, "global": 16},
        "optimizer": {"name": "lamb"},
    })


def _rank_timings(ctx: ParallelContext, cfg: JobConfig, steps: int) -> dict:
    from megascale.train import Trainer

    trainer = Trainer(cfg, ctx)
    trainer.step()  # warm-up: gloo connections, allocator
    stats = [trainer.step() for _ in range(steps)]
    trainer.finish()
    trainer.close()
    segments = {k: statistics.mean(s.timings["segments"][k] for s in stats) for k in stats[0].timings["segments"]}
    return {"step_time": statistics.median(s.step_time for s in stats), "segments": segments}


def _measure(parallelism: dict, overlap: bool, quick: bool, steps: int, **launch) -> dict:
    cfg = overlap_job(parallelism, overlap, quick)
    ranks = run_ranks(_rank_timings, layout_of(cfg), cfg, steps, sequence_parallel=cfg.parallelism.sequence_parallel,
                      **launch)
    exposed = {kind: statistics.mean(r["segments"][f"exposed_{kind}"] for r in ranks) for kind in COMM_KINDS}
    comm = {kind: statistics.mean(r["segments"][f"comm_{kind}"] for r in ranks) for kind in COMM_KINDS}
    return {"step_time_s": max(r["step_time"] for r in ranks), "exposed_s": exposed, "comm_s": comm}


def _reduction(on: float, off: float) -> float | None:
    return None if off <= 0 else 1 - on / off


def run(args: argparse.Namespace) -> dict:
    steps = 2 if args.quick else 4
    results = {name: {"off": _measure(p, False, args.quick, steps), "on": _measure(p, True, args.quick, steps)}
               for name, p in LAYOUTS.items()}
    main = results["tp2_pp2_dp2"]
    bubble = run_ranks(measure_bubble, Layout(pp=4, vpp=2), 8, 0.05, 0.1)
    return {
        "exposed_comm_reduction": {kind: _reduction(main["on"]["exposed_s"][kind], main["off"]["exposed_s"][kind])
                                   for kind in COMM_KINDS},
        "step_time_ratio_on_off": main["on"]["step_time_s"] / main["off"]["step_time_s"],
        "bubble_measured": max(r["measured"] for r in bubble),
        "bubble_formula": bubble[0]["formula"],
        "bubble_layout": "pp4 vpp2 m8, 50 ms forward / 100 ms backward per chunk",
        "layouts": results,
        "emulated": emulated(args.quick, steps, args.link_gbit),
    }


# The emulated section: 8 ranks on 2 nodes, TP inside a node, DP and PP across (node = (dp + pp) mod 2: each
# node holds one TP group of each pipeline stage, and each DP group's two replicas sit on different nodes).
# Links at cluster.link_gbit's default (2 Gbit/s) by default: communication is then about 60% of the step with
# overlap off on this 2-core host (the goals are meant for >= 30%; the JSON reports the share it measured). At
# 0.2 Gbit/s it was 87%, more than compute could hide. Goals: MegaScale's section 3.
EMULATED = {"tp": 2, "pp": 2, "dp": 2}
PLACEMENT = "2 nodes: n0 = (dp0, pp0) + (dp1, pp1), n1 = (dp1, pp0) + (dp0, pp1); TP inside a node"
GOALS = {"dp": 0.70, "pp": 0.50, "step_speedup": 1.15, "comm_share_off": 0.30}


def node_of(rank: int, layout: Layout) -> str:
    _, dp, pp = layout.coords_of(rank)
    return f"n{(dp + pp) % 2}"


def place(job: str, layout: Layout, rank: int) -> None:
    """A rank process onto its node: into the node's namespace, gloo on its link (peers on the node meet on lo)."""
    netemu.enter(netemu.JobNetwork(job).namespace(node_of(rank, layout)))
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"


@contextlib.contextmanager
def emulated_nodes(job: str, layout: Layout, link_gbit: float) -> Iterator[Callable[[int], None]]:
    """`job`'s network of `layout`'s nodes (node_of), each behind a `link_gbit` link, removed on leaving; yields
    `place(rank)`, which puts a rank process onto its node (run_ranks' `place`)."""
    net = netemu.create(job)
    try:
        for node in sorted({node_of(r, layout) for r in range(layout.world_size)}):
            netemu.add_node(net, node, link_gbit)
        yield functools.partial(place, job, layout)
    finally:
        netemu.teardown(job)


def emulated(quick: bool, steps: int, link_gbit: float = ClusterConfig.link_gbit) -> dict:
    """tp2×pp2×dp2 overlap off vs on across a `link_gbit` link per node; one line saying why when it cannot run."""
    try:
        netemu.require_net_admin()
    except netemu.NetworkError as e:
        return {"not_run": str(e)}
    layout = Layout(**EMULATED)
    with emulated_nodes(f"bench-overlap-{os.getpid()}", layout, link_gbit) as on_node:
        off, on = (_measure(EMULATED, switch, quick, steps, place=on_node, backend="gloo") for switch in (False, True))
    reduction = {kind: _reduction(on["exposed_s"][kind], off["exposed_s"][kind]) for kind in COMM_KINDS}
    figures = {"dp": reduction["dp"], "pp": reduction["pp"], "step_speedup": off["step_time_s"] / on["step_time_s"],
               "comm_share_off": sum(off["exposed_s"].values()) / off["step_time_s"]}
    return {
        "placement": PLACEMENT,
        "link_gbit": link_gbit,
        "exposed_comm_reduction": reduction,
        "step_speedup": figures["step_speedup"],
        "comm_share_off": figures["comm_share_off"],
        "goals": {key: {"goal": goal, "value": figures[key], "met": figures[key] is not None and figures[key] >= goal}
                  for key, goal in GOALS.items()},
        "off": off,
        "on": on,
    }
