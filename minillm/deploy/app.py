"""The Ray Serve application of a :class:`~minillm.deploy.config.DeployConfig`.

    router "default":  Ray's proxy -> MiniLLM replicas (their FastAPI app is the ingress);
                       Ray's power-of-two-choices router picks the replica
    router "prefix":   Ray's proxy -> Relay (a few lines: reads the body) -> MiniLLM replicas through
                       a handle whose router is ``router.PrefixRouter``: Ray's proxy passes a replica
                       the request's headers only, and the prefix is in the body

Ray's own ``serve run``/``serve deploy`` read the same thing from a config file
(``import_path: minillm.deploy.app:build``, ``args:`` the settings): :func:`build` checks the
settings first, so a config that cannot run starts no replica.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from .config import DEPLOYMENT, DeployConfig
from .replica import MiniLLMReplica

#: Headers and the rest of an ASGI scope a relayed request keeps (plain data, picklable).
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers", "client")


def deployment_options(config: DeployConfig) -> dict:
    """``serve.deployment(...).options(**this)``: replicas (or autoscaling between min and max on
    ongoing requests per replica), Ray's CPUs per replica, the graceful shutdown (drain) timeout, and
    the request router."""
    options = {
        "name": DEPLOYMENT,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.cpus_per_replica},
        "graceful_shutdown_timeout_s": config.shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
    }
    auto = config.autoscaling()
    if auto is not None:
        options["autoscaling_config"] = AutoscalingConfig(**auto)
    else:
        options["num_replicas"] = config.replicas
    if config.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="minillm.deploy.router:PrefixRouter",
            request_router_kwargs={"model": config.model, "block_size": config.block_size},
            request_routing_stats_period_s=0.5,
            request_routing_stats_timeout_s=2.0,
        )
    return options


def build(args: dict) -> serve.Application:
    """The application for ``args`` (:class:`~minillm.deploy.config.DeployConfig`'s fields).

    Raises:
        InvalidRequestError, ModelNotFoundError, MemoryBudgetError: as ``DeployConfig.check``.
    """
    config = DeployConfig.from_args(args)
    config.check()
    replicas = serve.deployment(serve.ingress()(MiniLLMReplica)).options(**deployment_options(config))
    bound = replicas.bind(config.replica_settings())
    if config.router == "prefix":
        return serve.deployment(Relay, name="Relay", ray_actor_options={"num_cpus": 0}).bind(bound)
    return bound


class Relay:
    """The prefix router's ingress: reads a request's body, then hands the ASGI scope and the body to a
    replica (``MiniLLMReplica.relay``) chosen by ``PrefixRouter``, and streams its answer back."""

    def __init__(self, replicas):
        self.replicas = replicas.options(stream=True, method_name="relay")

    async def __call__(self, request):
        from starlette.responses import StreamingResponse

        body = await request.body()
        scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
        scope["root_path"] = ""
        messages = self.replicas.remote(scope, body).__aiter__()
        start = await messages.__anext__()  # http.response.start: the status and headers

        async def chunks():
            async for message in messages:
                if message.get("body"):
                    yield message["body"]

        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", [])}
        headers.pop("content-length", None)
        return StreamingResponse(chunks(), status_code=start["status"], headers=headers)
