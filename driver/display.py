"""Rendering for the CLI (the only place rich is used): the live view of `run` and `status` tables."""
from __future__ import annotations

import time
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_STYLE = {"Running": "green", "Succeeded": "bold green", "Failed": "bold red", "Stopped": "yellow",
               "Paused": "yellow", "Recovering": "magenta", "Initializing": "cyan", "Pending": "cyan"}


def print_renderable(renderable) -> None:
    Console().print(renderable)


def _num(value, fmt: str, default: str = "-") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else default


def headline(job: str, status: dict) -> Text:
    state = status.get("state", "?")
    text = Text()
    text.append(f"{job}  ")
    text.append(state, style=STATE_STYLE.get(state, ""))
    total = status.get("total_steps")
    text.append(f"  step {_num(status.get('step'), 'd')}{f'/{total}' if total else ''}"
                f"  loss {_num(status.get('loss'), '.4f')}  {_num(status.get('tokens_per_s'), ',.0f')} tok/s"
                f"  restarts {status.get('restarts', 0)}")
    if status.get("val_loss") is not None:  # the newest validation (eval.every)
        text.append(f"\nval_loss {_num(status['val_loss'], '.4f')}  val_ppl {_num(status.get('val_ppl'), '.2f')}"
                    f"  at step {_num(status.get('val_step'), 'd')}")
    if status.get("driver"):  # a driver's view: the reliability figures and where to scrape it
        text.append(f"\nETTR {_num(status.get('ettr'), '.2f')}  MTTR {_num(status.get('mttr_s'), '.1f')} s"
                    f"  recoveries {status.get('recovered') or 0}")
        if status.get("prometheus"):
            text.append(f"  metrics {status['prometheus']}", style="dim")
    if status.get("reason"):
        text.append(f"\n{status['reason']}", style="dim")
    for line in status.get("stragglers") or []:
        text.append(f"\n{line}", style="yellow")
    return text


def job_table(job: str, status: dict, live: bool = True) -> Group:
    table = Table(box=None, pad_edge=False)
    for column in ("node", "role", "host", "heartbeat", "phase", "ranks", "step", "recent errors"):
        table.add_column(column)
    now = time.time()
    for n in status.get("nodes", []):
        seen = n.get("last_heartbeat")
        age = f"{now - seen:.1f} s ago" if seen and live else ("-" if not seen else "at exit")
        ranks = " ".join(f"{count} {state}" for state, count in n.get("ranks", {}).items()) or "-"
        role = n["role"] + (" (dead)" if n.get("dead") else "")
        style = "dim" if n["role"] == "evicted" else ("red" if n.get("dead") else "")
        phase = (n.get("phase") or "-") + (f": waiting for {n['waiting']}" if n.get("waiting") else "")
        table.add_row(n["node"], role, n.get("host") or "-", age, phase, ranks,
                      _num(n.get("step"), "d"), "; ".join(n.get("errors", []))[:80], style=style)
    parts = [headline(job, status)]
    if status.get("nodes"):
        parts.append(table)
    hidden = (status.get("evicted") or 0) - sum(n["role"] == "evicted" for n in status.get("nodes", []))
    if hidden > 0:
        parts.append(Text(f"(and {hidden} nodes evicted before these)", style="dim"))
    if not live:
        parts.append(Text("(not running: last status its `megascale run` saw)", style="dim"))
    return Group(*parts)


def jobs_table(rows: list[tuple[str, dict]]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("job", "state", "step", "loss", "val_loss", "tok/s", "nodes", "restarts"):
        table.add_column(column)
    for job, s in rows:
        nodes = s.get("nodes", [])
        active = [n for n in nodes if n["role"] == "active"]
        up = sum(1 for n in active if n.get("alive"))
        state = s.get("state", "?")
        table.add_row(job, Text(state, style=STATE_STYLE.get(state, "")), _num(s.get("step"), "d"),
                      _num(s.get("loss"), ".4f"), _num(s.get("val_loss"), ".4f"), _num(s.get("tokens_per_s"), ",.0f"),
                      f"{up}/{len(active)} up" if active else "-", str(s.get("restarts", 0)))
    return table


class Display:
    """Live table on a terminal; otherwise one line per state change and a progress line now and then."""

    PLAIN_EVERY_S = 2.0

    def __init__(self, job: str, total_steps: int, live: bool = True):
        self.job, self.total = job, total_steps
        self.console = Console()
        self.live: Optional[Live] = None
        self._want_live = live and self.console.is_terminal
        self._last_state: Optional[tuple] = None
        self._last_print = 0.0
        self._last_step = None

    def __enter__(self) -> "Display":
        if self._want_live:
            self.live = Live(Text(f"{self.job}: starting"), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def update(self, status: dict) -> None:
        if self.live:
            self.live.update(job_table(self.job, status))
            return
        state = (status.get("state"), status.get("reason"))
        if state != self._last_state:
            self._last_state = state
            self.console.print(headline(self.job, status), highlight=False)
            self._last_print = time.monotonic()
        elif status.get("step") != self._last_step and time.monotonic() - self._last_print > self.PLAIN_EVERY_S:
            self.console.print(headline(self.job, {**status, "reason": ""}), highlight=False)
            self._last_print = time.monotonic()
        self._last_step = status.get("step")

    def summary(self, final: dict, run_dir: str) -> None:
        if not self.live and (final.get("state"), final.get("reason")) != self._last_state:
            self.console.print(headline(self.job, final), highlight=False)
        if run_dir:
            self.console.print(f"run directory: {run_dir}", highlight=False)
