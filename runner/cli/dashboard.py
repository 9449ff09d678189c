"""`grpo-run dashboard`: a read-only web page for the jobs in a storage (runner.views.dashboard)."""

from __future__ import annotations

import ipaddress
import os
import socket

import click

from grpo_run.runner.cli.output import error as _error
from grpo_run.runner.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

TOKEN_ENV = "GRPO_RUN_DASHBOARD_TOKEN"


def listen_problem(host: str, token: str | None) -> str | None:
    """Why the dashboard may not listen on `host` (None: it may): beyond loopback only with a token."""
    if token:
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    return (f"--host {host or '(every address)'}: a dashboard other machines can reach needs a token: set "
            f"{TOKEN_ENV} (for example `export {TOKEN_ENV}=$(openssl rand -hex 32)`) and open the page as "
            f"http://HOST:PORT/?token=TOKEN, or listen on 127.0.0.1")


@click.command("dashboard", short_help="a read-only web page for the jobs in a storage, live")
@click.option("--storage", required=True, metavar="URL", help="the storage whose jobs to show (s3://, gs://, az://, a folder)")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True, help="0: any free port (printed)")
@click.option("--host", default="127.0.0.1", show_default=True,
              help=f"the address to listen on; beyond loopback only with {TOKEN_ENV} set")
def cmd_dashboard(storage: str, port: int, host: str) -> int:
    """Serve a web page of the jobs in a storage until interrupted: each job's phase, step, spend
    against maxCostUSD, held-out baseline -> final, sampler and nodes, refreshed live; a job's
    attempts as a timeline, its curves as charts, its samples and (where it ran on this machine)
    its log. Read-only: storage is only listed and read, each record at most every few seconds
    however many pages are open. docs/seeing-a-run.md.

    \b
    example:
      grpo-run dashboard --storage s3://bucket/prefix          # then open http://127.0.0.1:8765
      ssh -L 8765:127.0.0.1:8765 my-node                       # from a laptop, through ssh
    """
    try:
        import uvicorn

        from grpo_run.runner.views.dashboard.app import create_app
    except ImportError as e:
        _error(f"the dashboard needs its web server ({e.name}): pip install 'grpo-run[dashboard]'")
        return EXIT_USAGE
    from grpo_run.runner.views.dashboard.data import Bucket

    token = os.environ.get(TOKEN_ENV, "").strip() or None
    refused = listen_problem(host, token)
    if refused:
        _error(refused)
        return EXIT_USAGE
    # bound here, not by uvicorn: a port in use is one line naming the fix, and port 0's number is known
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        _error(f"the dashboard could not listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}; pick another --port")
        return EXIT_FAILED
    server = uvicorn.Server(uvicorn.Config(create_app(Bucket(storage), token=token), log_level="warning",
                                           access_log=False))
    shown = f"[{host}]" if ":" in host else host
    print(f"grpo-run dashboard: http://{shown}:{sock.getsockname()[1]}/ ({storage}); Ctrl-C to stop", flush=True)
    with sock:
        server.run(sockets=[sock])          # until interrupted (uvicorn handles SIGINT and SIGTERM)
    return EXIT_OK
