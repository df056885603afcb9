"""``build_app`` and ``pie-ctx fleet``: N engine replicas on Ray Serve behind one front.

Owns: the two deployments' settings (``EngineReplica`` with ``FleetRouter`` as its request
router; ``FleetIngress`` as the HTTP front) and the command line. For your own Ray app::

    from runtime.fleet.app import build_app
    app = build_app(["--model", "/models/qwen3", "--page-size", "16"],
                    snapshot_dir="/shared/pie-ctx", replicas=4)
    # serve run my_module:app    (or serve.run(app, route_prefix="/"))

On one machine the engines need not wait for Ray: ``boot_early`` starts them before
``ray.init`` and the replicas adopt them (``runtime.fleet.engines``)::

    early = boot_early(engine_args, folder, replicas=2)      # first: the engines boot
    ray.init(...)                                            # meanwhile
    start_fleet(build_app(engine_args, folder, replicas=2, early=early), host, port)
    ...
    stop_fleet(own_ray=True, early=early)

docs/scale-out.md has the picture, the routing rules and the limits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pie_ctx.proto.errors import InvalidArgument, PieError
from runtime.fleet.engines import EarlyEngines

__all__ = ["build_app", "boot_early", "register", "engine_args_of", "start_fleet",
           "stop_fleet", "RAY_SYSTEM_CONFIG", "RAY_ENV"]

FLEET_APP = "pie-ctx"
# A Ray instance the fleet starts (``ray.init(_system_config=...)``) prestarts no idle
# task workers: Serve's actors never use them (each starts a worker of its own), and on a
# small machine they take CPU from the controller, the proxy and the engines' boot.
RAY_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
# For the fleet's Ray workers (``runtime_env``): Serve's controller gives a starting proxy
# 5 s per readiness check and replaces it after three misses, less than a worker importing
# Ray Serve takes on a busy small machine (the start then fails). A check ends as soon as
# the proxy is ready, so a longer one delays nothing.
RAY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def build_app(engine_args: list[str], snapshot_dir: str | Path, *, replicas: int = 2,
              max_ongoing_requests: int = 16, prefix_routing: bool = True,
              host: str = "127.0.0.1", model: str | None = None,
              early: EarlyEngines | None = None) -> Any:
    """The fleet as a Ray Serve application (``serve.run(app)`` / ``serve run``).

    Args:
        engine_args: ``pie-ctx serve`` engine options for every replica (``--model``...).
        snapshot_dir: the folder the replicas share (it must exist; a network file system
            on a cluster of several machines).
        replicas: engine replicas.
        max_ongoing_requests: a replica's queue bound: past it the router sends a call to
            the next replica in its order.
        prefix_routing: route prompts without a session by the pages replicas hold.
        host: where replicas bind their engine (``"node"``: the node's address, for a
            cluster of several machines; see ``EngineReplica``).
        model: the model reference, for the front's tokenizer (default: ``--model`` in
            ``engine_args``).
        early: engines ``boot_early`` started with the same options, for the replicas to
            adopt (one machine: the Ray instance this process starts).

    Raises:
        InvalidArgument: ``replicas`` or ``max_ongoing_requests`` is not positive, the
            snapshot folder does not exist, or ``early`` was started with other options.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from runtime.fleet.ingress import FleetIngress
    from runtime.fleet.replica import EngineReplica

    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidArgument(f"replicas must be a positive int, got {replicas!r}")
    if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
        raise InvalidArgument("max_ongoing_requests must be a positive int, got "
                              f"{max_ongoing_requests!r}")
    folder = Path(snapshot_dir).expanduser().resolve()
    if not folder.is_dir():
        raise InvalidArgument(f"snapshot folder {folder} does not exist: create it (every "
                              "replica must see it: a shared file system on a cluster)")
    if early is not None and early.key != _early_key(engine_args, folder, host):
        raise InvalidArgument("the early engines were started with other engine options, "
                              "snapshot folder or host than the app's: start them with "
                              "the app's")
    if model is None and "--model" in engine_args:
        model = engine_args[engine_args.index("--model") + 1]
    engines = serve.deployment(
        EngineReplica, name="engine", num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        # The engine's threads are the engine process's, outside Ray's accounting.
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=1, health_check_timeout_s=30, graceful_shutdown_timeout_s=10,
        request_router_config=RequestRouterConfig(
            request_router_class="runtime.fleet.router.FleetRouter",
            request_routing_stats_period_s=1,
            request_routing_stats_timeout_s=5),
    ).bind(list(engine_args), str(folder), host,
           early=list(early.folders) if early is not None else None)
    front = serve.deployment(FleetIngress, name="ingress", num_replicas=1,
                             max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return front.bind(engines, model, prefix_routing)


def boot_early(engine_args: list[str], snapshot_dir: str | Path, *, replicas: int = 2,
               host: str = "127.0.0.1", temp_dir: str | None = None,
               env: dict[str, str] | None = None) -> EarlyEngines:
    """Start the replicas' engines now, before Ray: each boots while Ray and Serve start,
    and a replica adopts one instead of starting its own (pass the result to
    ``build_app``, ``start_fleet`` and ``stop_fleet``). For a Ray instance on this machine.

    Args:
        engine_args, snapshot_dir, replicas, host: the app's (see ``build_app``).
        temp_dir: where the engines' folders go (default: the temporary folder).
        env: the engines' environment (default: this process's, with this checkout on
            ``PYTHONPATH``).
    """
    from runtime.fleet.replica import engine_command

    folder = Path(snapshot_dir).expanduser().resolve()
    if env is None:
        env = {**os.environ, "PYTHONPATH": _python_path()}
    return EarlyEngines(lambda sock: engine_command(list(engine_args), str(folder), host, sock),
                        replicas, key=_early_key(engine_args, folder, host),
                        temp_dir=temp_dir, env=env)


def _early_key(engine_args: list[str], folder: Path, host: str) -> tuple[Any, ...]:
    return (tuple(engine_args), str(folder), host)


def _python_path() -> str:
    """``PYTHONPATH`` with this checkout on it (for engines and Ray's workers)."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"),
                                       str(Path(__file__).parents[2])) if p)


def engine_args_of(args: argparse.Namespace) -> list[str]:
    """``pie-ctx serve`` engine options from ``add_engine_arguments``' parsed values."""
    out: list[str] = []
    if args.model is not None:
        out += ["--model", args.model]
    out += ["--page-size", str(args.page_size), "--weights", args.weights,
            "--kv-dtype", args.kv_dtype, "--backend", args.backend]
    if args.num_pages is not None:
        out += ["--num-pages", str(args.num_pages)]
    if args.kv_memory_gb is not None:
        out += ["--kv-memory-gb", str(args.kv_memory_gb)]
    if args.decode_share is not None:
        out += ["--decode-share", str(args.decode_share)]
    if args.dtype is not None:
        out += ["--dtype", args.dtype]
    if args.tensor_parallel != 1:
        out += ["--tensor-parallel", str(args.tensor_parallel)]
    for name, path in args.adapter or []:
        out += ["--adapter", f"{name}={path}"]
    return out


def register(subparsers: Any) -> None:
    """Add the ``fleet`` subcommand."""
    from runtime.server.cli import add_engine_arguments, default_snapshot_dir

    fleet = subparsers.add_parser(
        "fleet", help="run N engine replicas on Ray Serve behind one HTTP front",
        description="Engine replicas on Ray Serve (pip install 'pie-ctx[ray]'), routed by "
                    "session and by prefix, sharing one snapshot folder (docs/scale-out.md).")
    add_engine_arguments(fleet)
    fleet.add_argument("--replicas", type=int, default=2, metavar="N", help="engine replicas")
    fleet.add_argument("--http", default="127.0.0.1:8000", metavar="[HOST:]PORT",
                       help="the front's HTTP address (default 127.0.0.1:8000)")
    fleet.add_argument("--address", default=None,
                       help="join this Ray cluster (ray://... or HOST:PORT; 'auto': the "
                            "local one); default: start a Ray instance here")
    fleet.add_argument("--snapshot-dir", default=None, metavar="DIR",
                       help="the snapshot folder every replica shares (default: "
                            f"{default_snapshot_dir()}); on several machines, a shared "
                            "file system")
    fleet.add_argument("--max-ongoing", type=int, default=16, metavar="N",
                       help="calls one replica takes at once before the router sends the "
                            "next elsewhere (default 16)")
    fleet.add_argument("--no-prefix-routing", action="store_true",
                       help="route prompts without a session to two random replicas")
    fleet.add_argument("--replica-host", default="127.0.0.1",
                       help="where replicas bind their engines: 127.0.0.1 (default, one "
                            "machine) or 'node' (each node's address, a cluster)")
    fleet.set_defaults(func=fleet_main)


def start_fleet(app: Any, host: str, port: int, early: EarlyEngines | None = None) -> None:
    """Start Serve with the front on ``host:port`` and run ``app`` as ``FLEET_APP``.

    Returns when every replica's engine serves; then the early engines (``boot_early``)
    no replica adopted are stopped. Deploying reconnects to the Serve instance
    ``serve.start`` just made and says so ("Connecting to existing Serve app ... will not
    be applied"): here it is this one, with these options, so that line is left out.

    Raises:
        RuntimeError: a deployment failed to start (Serve's message says why).
    """
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    serve.start(http_options={"host": host, "port": port})
    serve_log = logging.getLogger("ray.serve")
    reconnect = _DropReconnect()
    serve_log.addFilter(reconnect)
    try:
        serve.run_many([serve.RunTarget(target=app, name=FLEET_APP, route_prefix="/")],
                       wait_for_applications_running=False)
    finally:
        serve_log.removeFilter(reconnect)
    # (serve.run asks every second; Serve's controller decides every 0.1 s)
    while True:
        app_status = serve.status().applications.get(FLEET_APP)
        if app_status is not None and app_status.status == ApplicationStatus.RUNNING:
            if early is not None:
                early.release()
            return
        if app_status is not None and app_status.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"deploying the fleet failed: {app_status.message}")
        time.sleep(0.1)


def stop_fleet(*, own_ray: bool, early: EarlyEngines | None = None) -> None:
    """Stop the fleet: delete ``FLEET_APP`` (every replica stops gracefully: its engine is
    stopped and its temporary folder removed), then, for a Ray instance this process
    started (``own_ray``), ``ray.shutdown()``, which ends Serve with the instance. On a
    cluster this process joined, Serve stays for its other applications. (``serve.shutdown``
    is not called: on Ray 2.60 the controller's end is logged as a failed
    ``graceful_shutdown`` task.) Last, the early engines still running are stopped and
    their folders removed."""
    import ray
    from ray import serve

    try:
        if not ray.is_initialized():
            return
        try:
            serve.delete(FLEET_APP)
        except Exception as err:  # Serve never started, or is gone already
            logging.getLogger("pie_ctx.fleet").info("deleting the fleet's app: %s", err)
        if own_ray:
            ray.shutdown()
    finally:
        if early is not None:
            early.close()


class _DropReconnect(logging.Filter):
    """Leaves out Serve's "Connecting to existing Serve app" line (see ``start_fleet``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Connecting to existing Serve app")


def fleet_main(args: argparse.Namespace) -> int:
    """Run ``pie-ctx fleet`` until SIGINT/SIGTERM (exit 0); 2 on bad options, 1 when the
    fleet failed to start. Every way out deletes the app (engines stopped, temporary
    folders removed) and shuts down the Ray instance it started. With a Ray instance of
    its own (no ``--address``) the engines boot first, while Ray and Serve start."""
    import importlib.util

    from runtime.server.cli import default_snapshot_dir
    from runtime.server.http.app import parse_http_address

    def say(text: str) -> None:
        print(f"pie-ctx: {text}", file=sys.stderr, flush=True)

    if importlib.util.find_spec("ray") is None:
        say("error: pie-ctx fleet needs Ray Serve: pip install 'pie-ctx[ray]'")
        return 2
    own_ray = args.address is None
    early: EarlyEngines | None = None
    stop = threading.Event()
    serving = False

    def on_signal(*_: Any) -> None:
        stop.set()
        if not serving:  # stop the start where it is (the finally below cleans up)
            raise KeyboardInterrupt

    code = 0
    try:
        try:
            http = parse_http_address(args.http)
            folder = Path(args.snapshot_dir or default_snapshot_dir())
            folder.mkdir(parents=True, exist_ok=True)
            engine_args = engine_args_of(args)
            if own_ray and args.replica_host != "node" and args.replicas >= 1:
                early = boot_early(engine_args, folder, replicas=args.replicas,
                                   host=args.replica_host)
            app = build_app(engine_args, folder, replicas=args.replicas,
                            max_ongoing_requests=args.max_ongoing,
                            prefix_routing=not args.no_prefix_routing,
                            host=args.replica_host, early=early)
        except (PieError, OSError) as err:
            say(f"error: {err}")
            return 2
        import ray

        # (ray.init sets a SIGTERM handler of its own: a SystemExit until ours is set)
        ray.init(address=args.address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": _python_path(), **RAY_ENV}},
                 **({"_system_config": RAY_SYSTEM_CONFIG} if own_ray else {}))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        start_fleet(app, http.host, http.port, early=early)
        serving = True
        say(f"serving HTTP on http://{http.host}:{http.port} ({args.replicas} engine "
            f"replicas on Ray Serve, snapshots shared in {folder})")
        stop.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    except Exception as err:  # a replica failed to start: Serve's message says why
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        say(f"error: the fleet did not start: {lines[-1] if lines else type(err).__name__}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the stop finish
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: now
        stop_fleet(own_ray=own_ray, early=early)
    say("stopped")
    return code
