"""``minillm serve A --model B ...``: the plans at startup (a rich table each), then the registry behind the app.

GET /v1/models/{id}/plan    that model's memory plan as JSON (memory_plan.MemoryPlan.to_dict)
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from minillm.errors import MiniLLMError
from minillm.runtime.memory_plan import MemoryPlan, format_bytes

from .flags import adapted, base_url, worker_options
from .models import ModelRegistry, ModelSpec


def plan_table(plan: MemoryPlan) -> Table:
    """The plan as a rich table: part, bytes, how it was computed."""
    table = Table(title=f"memory plan: {plan.model} ({plan.weight_dtype})", title_justify="left")
    table.add_column("part")
    table.add_column("bytes", justify="right")
    table.add_column("from")
    for part, nbytes, how in plan.rows():
        table.add_row(part, format_bytes(nbytes), how, style="bold" if part == "total" else None)
    return table


def build_registry(args: argparse.Namespace, console: Console, speculative=None) -> ModelRegistry:
    """The registry for ``args`` with every plan made, its one guard and event stream built from the
    flags (as the single-model server's). Raises MemoryBudgetError (and what resolving raises)."""
    from .events import EventBus
    from .metrics import ServerMetrics
    from .reliability import Guard

    dtype = args.weight_dtype or "float32"
    names = [args.served_model_name or args.model, *args.models]
    specs = [ModelSpec.parse(args.model, dtype), *(ModelSpec.parse(m, dtype) for m in args.models)]
    if args.served_model_name:
        specs[0] = ModelSpec(args.served_model_name, specs[0].source, specs[0].weight_dtype)
    if len(set(names)) != len(names):
        raise MiniLLMError(f"a model is named twice in {names}; give each served model once.")
    metrics = ServerMetrics()
    registry = ModelRegistry(
        specs,
        metrics=metrics,
        budget=args.memory_budget,
        keep_alive_s=-1.0 if args.keep_alive is None else args.keep_alive,
        max_loaded=args.max_loaded_models,
        kv_cache_mib=args.kv_cache_mib,
        guard=Guard(metrics, stream_buffer=args.stream_buffer, test_faults=args.test_faults),
        events=EventBus(args.events_buffer, args.max_event_subscribers, log=console.print),
        speculative=speculative,
        adapters=args.adapters,  # merged into every model's weights at its load
        **worker_options(args, console),
    )
    registry.plan_all()
    return registry


def add_routes(app, registry: ModelRegistry) -> None:
    """``GET /v1/models/{id}/plan``: the plan as JSON; 404 naming the served models."""
    from .app import APIError

    @app.get("/v1/models/{model_id:path}/plan")
    async def plan(model_id: str):
        slot = registry.slots.get(model_id)
        if slot is None:
            served = ", ".join(map(repr, registry.slots))
            raise APIError(404, f"model {model_id!r} not found; this server serves {served}", "not_found_error")
        return {**slot.plan.to_dict(), "state": slot.state, "measured_process_bytes": _rss_now()}

    # ahead of app.py's GET /v1/models/{model_id:path}, whose id would otherwise swallow "/plan"
    app.router.routes.insert(0, app.router.routes.pop())


def _rss_now() -> int:
    from .models import _rss

    return _rss()


def build_registry_app(args: argparse.Namespace, console: Console, err: Console, speculative=None, access=None):
    """(app, guard) for several models: plan every model, print the plans and the banner. None when
    a model cannot fit (or a name is given twice): said on ``err``; the caller exits 2.
    ``server.serve_app`` runs the app, as it runs the single-model one; ``access`` (``auth.Access``,
    None: an open server) is the same as the single-model server's."""
    from .app import create_app

    try:
        registry = build_registry(args, console, speculative)
    except MiniLLMError as exc:
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
        return None
    for slot in registry.slots.values():
        console.print(plan_table(slot.plan))
        console.print(slot.plan.kv_line())
    if registry.budget is not None:
        console.print(f"memory budget {format_bytes(registry.budget)}; runtime {format_bytes(registry.runtime_bytes)}")
    app = create_app(registry, max_request_bytes=args.max_request_bytes, access=access)
    add_routes(app, registry)
    names = ", ".join(registry.slots)
    console.print(
        f"minillm serve: {names}{adapted(args)} on {base_url(args)} (loading {registry.specs[0].served} in the "
        "background; GET /health answers 200 when it is ready, the others load on demand)"
    )
    return app, registry.guard
