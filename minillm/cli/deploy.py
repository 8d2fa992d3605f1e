"""``minillm deploy MODEL --replicas N``: the server as Ray Serve replicas on a local Ray cluster.

    minillm deploy smollm2-135m-instruct --replicas 2 --threads 1 --port 8000
    minillm deploy --config fleet.yaml            # Ray Serve's config file; edit it: a rolling update
    minillm deploy MODEL --write-config fleet.yaml   # write that file and exit (Ray's `serve run` reads it)
    minillm deploy MODEL --adapter ./my-lora      # every replica merges the LoRA adapter at load

The settings are checked (model, budget, replicas x memory) before Ray starts. Ctrl-C (or SIGTERM)
stops the application, Serve and the local Ray cluster with its processes.
"""

from __future__ import annotations

import argparse
import signal
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from minillm.errors import MiniLLMError
from minillm.serve import DEFAULT_MODEL


def add_deploy_command(sub) -> None:
    """``minillm deploy``'s flags (the serve flags that apply to a replica)."""
    d = sub.add_parser("deploy", help="serve the model as Ray Serve replicas: autoscaled, rolled, routed by prefix")
    d.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help="a name from `minillm models` (default: %(default)s)"
    )
    d.add_argument("--replicas", type=int, default=1, metavar="N", help="replicas at start (default: %(default)s)")
    d.add_argument("--min-replicas", type=int, default=None, metavar="N", help="autoscaling: the fewest replicas")
    d.add_argument("--max-replicas", type=int, default=None, metavar="N", help="autoscaling: the most replicas")
    d.add_argument("--target-ongoing-requests", type=float, default=2.0, metavar="R", help="autoscaling: per replica")
    d.add_argument("--host", default="127.0.0.1", help="where Ray Serve's proxy listens (default: %(default)s)")
    d.add_argument("--port", type=int, default=8000, help="the one address's port (default: %(default)s)")
    d.add_argument("--threads", type=int, default=None, metavar="T", help="BLAS threads per replica")
    d.add_argument("--weight-dtype", default="float32", help="float32 | bfloat16 | int8 (default: %(default)s)")
    d.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="FOLDER",
        help="a PEFT LoRA adapter folder every replica merges into its weights at load (repeatable)",
    )
    d.add_argument("--memory-budget", default=None, metavar="SIZE", help="bytes one replica may use, e.g. 2GiB")
    d.add_argument("--kv-cache-mib", type=float, default=64.0, help="each replica's paged pool (default: %(default)s)")
    d.add_argument("--router", choices=("prefix", "default"), default="prefix", help="prefix-aware or Ray's default")
    d.add_argument("--api-key", action="append", default=[], metavar="KEY", help="an inference key (repeatable)")
    d.add_argument("--observer-key", action="append", default=[], metavar="KEY", help="an observer key (repeatable)")
    d.add_argument("--metrics-port", type=int, default=None, metavar="P", help="Ray's Prometheus metrics port")
    d.add_argument("--config", default=None, metavar="PATH", help="Ray Serve's config file; watched for changes")
    d.add_argument("--write-config", default=None, metavar="PATH", help="write the settings as that file and exit")
    d.add_argument("--debug", action="store_true", help="show tracebacks")
    d.set_defaults(run_command=run_deploy)


def settings_of(args: argparse.Namespace) -> dict:
    """The flags as :class:`~minillm.deploy.config.DeployConfig`'s fields."""
    return {
        "model": args.model,
        "replicas": args.replicas,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "target_ongoing_requests": args.target_ongoing_requests,
        "threads": args.threads,
        "weight_dtype": args.weight_dtype,
        "memory_budget": args.memory_budget,
        "kv_cache_mib": args.kv_cache_mib,
        "router": args.router,
        "api_keys": list(args.api_key),
        "observer_keys": list(args.observer_key),
        "adapters": list(args.adapter),
    }


def run_deploy(args: argparse.Namespace) -> int:
    """Check, start Ray and the application, follow it until a signal; returns the exit status (0
    after a clean stop, 2 for settings that cannot run: nothing was started)."""
    _require_deploy_extra()
    import yaml

    from minillm.deploy.config import DeployConfig
    from minillm.runtime.memory_plan import format_bytes

    console, err = Console(highlight=False), Console(stderr=True, highlight=False)
    try:
        config = DeployConfig.from_file(args.config) if args.config else DeployConfig.from_args(settings_of(args))
        if args.write_config:
            Path(args.write_config).write_text(yaml.safe_dump(config.serve_config(args.host, args.port)))
            console.print(f"minillm deploy: wrote {args.write_config} (Ray Serve's format)")
            return 0
        plan = config.check()
    except MiniLLMError as exc:
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}")
        return 2
    adapters = "".join(f", adapter {Path(folder).name}" for folder in config.adapters)
    console.print(
        f"minillm deploy: {config.model} ({config.weight_dtype}{adapters}), {format_bytes(plan.total)} per replica, "
        f"up to {config.most_replicas} replicas, router {config.router}"
    )
    return _run(config, args, console)


def _run(config, args: argparse.Namespace, console: Console) -> int:
    """Start the local Ray cluster and the app; redeploy when ``--config`` changes; stop on a signal."""
    import ray
    from ray import serve

    from minillm.deploy.app import build
    from minillm.deploy.config import DeployConfig

    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: stop.append(signal.Signals(s).name))
    ray.init(
        num_cpus=max(2, config.most_replicas + 1),
        include_dashboard=False,
        log_to_driver=True,
        _metrics_export_port=args.metrics_port,  # Ray Serve's own metrics (ray_serve_*), per replica
    )
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        if args.config:  # as Ray's `serve deploy` does: an edit of counts alone replaces no replica
            apply_config(config, args)
        else:
            serve.run(build(asdict(config)), name="minillm", route_prefix="/")
        console.print(f"minillm deploy: ready on http://{args.host}:{args.port} ({_counts(serve)})")
        if args.metrics_port:
            console.print(f"minillm deploy: Ray Serve's metrics on http://127.0.0.1:{args.metrics_port}/metrics")
        seen, counts = _mtime(args.config), _counts(serve)
        while not stop:
            time.sleep(0.25)
            if (now := _counts(serve)) != counts:
                console.print(f"minillm deploy: replicas {now}")
                counts = now
            if args.config and _mtime(args.config) != seen:
                seen = _mtime(args.config)
                old, config = config, DeployConfig.from_file(args.config)
                config.check()
                rolled = old.replica_settings() != config.replica_settings()
                console.print(
                    f"minillm deploy: config changed: {'rolling update' if rolled else 'no replica replaced'}"
                )
                apply_config(config, args)
                counts = _counts(serve)  # once the new replicas all run
                console.print(f"minillm deploy: config applied: replicas {counts}")
        console.print(f"minillm deploy: {stop[0]}: stopping the replicas (each drains), Serve and Ray")
    finally:
        serve.shutdown()
        ray.shutdown()
    console.print("minillm deploy: stopped")
    return 0


def apply_config(config, args: argparse.Namespace, timeout: float = 900.0) -> None:
    """Deploy ``config`` as Ray Serve's config file (what ``serve deploy`` sends the controller) and wait
    until the application runs.

    Raises:
        RuntimeError: the application failed to deploy (Ray's message), or still deploys after ``timeout`` s.
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config.serve_config(args.host, args.port))
    _get_global_client().deploy_apps(schema)
    deadline = time.monotonic() + timeout
    time.sleep(1.0)  # the controller takes the new config before its status says so
    while time.monotonic() < deadline:
        app = serve.status().applications.get("minillm")
        state = (
            app.status.value if app is not None and hasattr(app.status, "value") else str(getattr(app, "status", ""))
        )
        if state == "RUNNING" and _counts(serve).endswith("(healthy)"):
            return
        if state == "DEPLOY_FAILED":
            raise RuntimeError(f"the application failed to deploy: {app.message}")
        time.sleep(0.25)
    raise RuntimeError(f"the application still deploys after {timeout:g} s")


def _require_deploy_extra() -> None:
    """Import Ray Serve and the HTTP stack, or raise MissingExtraError naming the ``deploy`` extra."""
    import importlib

    from minillm.errors import MissingExtraError

    for module in ("ray", "fastapi", "uvicorn"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != module:
                raise
            raise MissingExtraError.for_module(module, "deploy", "minillm deploy") from None


def _counts(serve) -> str:
    """Ray Serve's status of the model deployment: ``running N`` and any other replica states."""
    from minillm.deploy.config import DEPLOYMENT

    app = serve.status().applications.get("minillm")
    if app is None or DEPLOYMENT not in app.deployments:
        return "none"
    status = app.deployments[DEPLOYMENT]
    states = {str(k.value if hasattr(k, "value") else k).lower(): v for k, v in status.replica_states.items()}
    return ", ".join(f"{k} {v}" for k, v in sorted(states.items())) + f" ({status.status.value.lower()})"


def _mtime(path: str | None) -> float | None:
    return Path(path).stat().st_mtime if path else None
