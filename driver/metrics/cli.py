"""`megascale dashboard` and `megascale trace`: a job's step timings in a browser or a trace file."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_PORT = 8787


def register(subparsers: argparse._SubParsersAction) -> None:
    dash = subparsers.add_parser("dashboard", help="serve a web UI of a job's step timings on 127.0.0.1")
    _add_source_args(dash)
    dash.add_argument("--port", type=int, default=DEFAULT_PORT,
                      help=f"port on 127.0.0.1 (default {DEFAULT_PORT}; 0 = any free)")
    dash.add_argument("--window", type=int, default=200, help="steps shown (the newest; default 200)")
    dash.set_defaults(func=_dashboard)

    trace = subparsers.add_parser("trace", help="export steps as a Chrome/Perfetto trace JSON")
    _add_source_args(trace)
    trace.add_argument("--steps", default="-20", help="A:B (inclusive), A:, :B or -N for the last N (default -20)")
    trace.add_argument("-o", "--output", required=True, help="trace JSON to write ('-' for stdout)")
    trace.set_defaults(func=_trace)


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", help="job name: its newest run under --runs-root, or its data in --parquet; "
                        "or a run directory")
    parser.add_argument("--run-dir", help="a run directory with timings-rank<R>.jsonl (from `megascale train`)")
    parser.add_argument("--parquet", help="the driver's metrics store (Parquet root)")
    parser.add_argument("--runs-root", default="runs", help="where local runs are (default ./runs)")
    parser.add_argument("--ranks-per-node", type=int, help="ranks per node (default: from the run's config, else 8)")
    parser.add_argument("--keep-steps", type=int, metavar="N",
                        help="a run directory's newest N steps held in memory (default 100,000; 0 = all)")


def _open(args: argparse.Namespace):
    from .sources import open_source

    if args.keep_steps is not None and args.keep_steps < 0:
        print("error: --keep-steps must be 0 (all) or more", file=sys.stderr)
        return None, 0
    kept = {} if args.keep_steps is None else {"keep_steps": args.keep_steps or None}
    try:
        source = open_source(args.job, args.parquet, args.run_dir, args.runs_root, **kept)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return None, 0
    ranks_per_node = args.ranks_per_node or source.ranks_per_node or 8
    if ranks_per_node < 1:
        print("error: --ranks-per-node must be at least 1", file=sys.stderr)
        return None, 0
    return source, ranks_per_node


def _dashboard(args: argparse.Namespace) -> int:
    from ..dashboard.server import Dashboard

    source, ranks_per_node = _open(args)
    if source is None:
        return 2
    try:
        dashboard = Dashboard(source, ranks_per_node, port=args.port, window=args.window)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{args.port} ({e.strerror}); pick another --port", file=sys.stderr)
        return 2
    print(f"dashboard of {source.job}: {dashboard.url}  (Ctrl-C to stop)", flush=True)
    try:
        dashboard.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.httpd.server_close()
    return 0


def _trace(args: argparse.Namespace) -> int:
    from .trace import parse_steps, to_chrome_trace

    source, ranks_per_node = _open(args)
    if source is None:
        return 2
    try:
        first, last = parse_steps(args.steps, source.step_range())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = source.read(first, last)
    if not records:
        print(f"error: no step timings for steps {args.steps} of {source.job} (stored: {source.step_range()})",
              file=sys.stderr)
        return 1
    text = json.dumps(to_chrome_trace(records, ranks_per_node, source.job))
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text)
        steps = sorted({r["step"] for r in records})
        print(f"wrote {args.output}: steps {steps[0]}-{steps[-1]} of {len({r['rank'] for r in records})} ranks; "
              f"open it in ui.perfetto.dev", file=sys.stderr)
    return 0
