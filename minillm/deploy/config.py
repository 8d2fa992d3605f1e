"""What a deployment is, checked before any replica starts, and the Ray Serve config file it becomes.

    DeployConfig.from_file("fleet.yaml")  -> the ``args`` of the one application in Ray's own config
    config.check()                        -> the plan of one replica; refuses what cannot run, naming numbers
    config.serve_config()                 -> the dict ``serve run``/``serve deploy`` read (YAML on disk)

A replica is one process holding one model, so the memory arithmetic is per replica: the plan's
total (weights, KV pool, activations, tokenizer, runtime) times the most replicas that may run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from minillm.errors import AdapterError, InvalidRequestError, MemoryBudgetError
from minillm.runtime.loading import WEIGHT_DTYPES
from minillm.runtime.memory_plan import MIB, MemoryPlan, format_bytes, make_plan, parse_size

#: The deployment's name inside the application (Ray's ``deployments: - name:``).
DEPLOYMENT = "MiniLLM"
#: The application's import path, for Ray's config file.
IMPORT_PATH = "minillm.deploy.app:build"
ROUTERS = ("prefix", "default")  # ours (router.py), or Ray's power-of-two-choices
#: Settings of the deployment, not of a replica: changing them scales or reroutes, replacing no replica.
SCALING = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
           "downscale_delay_s", "router")  # fmt: skip


@dataclass
class DeployConfig:
    """One model served by ``replicas`` Ray Serve replicas (sizes in bytes, times in seconds).

    ``min_replicas``/``max_replicas`` set: autoscaled on ``target_ongoing_requests`` per replica,
    starting at ``replicas``. ``memory_budget``: bytes one replica may use (None: no limit).
    ``api_keys``/``observer_keys``: as ``minillm serve --api-key``/``--observer-key``.
    ``cpus_per_replica``: Ray's ``num_cpus`` for one replica (0 on a small machine: the BLAS
    ``threads`` are what the replica really uses). ``adapters``: PEFT LoRA adapter folders every
    replica merges into its weights at load (``minillm.load(adapters=...)``), made absolute here
    (relative ones from the current folder): the replicas read them from other processes.
    """

    model: str = "smollm2-135m-instruct"
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    threads: int | None = None
    weight_dtype: str = "float32"
    memory_budget: int | None = None
    kv_cache_mib: float = 64.0
    max_seq_len: int | None = 2048
    max_num_seqs: int = 16
    max_ongoing_requests: int = 32
    block_size: int = 16
    router: str = "prefix"
    api_keys: list[str] = field(default_factory=list)
    observer_keys: list[str] = field(default_factory=list)
    cpus_per_replica: float = 0.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 5.0
    shutdown_timeout_s: float = 60.0
    adapters: list[str] = field(default_factory=list)

    def __post_init__(self):
        folders = [self.adapters] if isinstance(self.adapters, str) else self.adapters  # one folder, unlisted
        self.adapters = [str(Path(folder).expanduser().resolve()) for folder in folders]

    @classmethod
    def from_args(cls, args: dict) -> DeployConfig:
        """From a plain dict (Ray's ``args:``); ``memory_budget`` may be ``"2GiB"``.

        Raises:
            InvalidRequestError: an unknown key (the message lists the known ones).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown deploy setting(s) {', '.join(unknown)}; the settings are {', '.join(sorted(known))}"
            )
        values = dict(args)
        if isinstance(values.get("memory_budget"), str):
            values["memory_budget"] = parse_size(values["memory_budget"])
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> DeployConfig:
        """The ``args`` of the first application of a Ray Serve config file (YAML).

        Raises:
            InvalidRequestError: no such file, or a file with no ``applications: - args:``.
        """
        import yaml

        path = Path(path)
        if not path.is_file():
            raise InvalidRequestError(f"no deploy config at {path}; write one with `minillm deploy --write-config`")
        data = yaml.safe_load(path.read_text()) or {}
        apps = data.get("applications") or []
        if not apps or not isinstance(apps[0].get("args"), dict):
            raise InvalidRequestError(f"{path} has no `applications: - args: {{model: ...}}` (Ray Serve's format)")
        scaling = next((d for d in apps[0].get("deployments") or [] if d.get("name") == DEPLOYMENT), {})
        auto = scaling.get("autoscaling_config") or {}
        counts = {"replicas": scaling.get("num_replicas", auto.get("initial_replicas", 1))}
        for name in (
            "min_replicas",
            "max_replicas",
            "target_ongoing_requests",
            "upscale_delay_s",
            "downscale_delay_s",
        ):
            if name in auto:
                counts[name] = auto[name]
        return cls.from_args({**apps[0]["args"], **counts})

    @property
    def most_replicas(self) -> int:
        """The most replicas that may run at once (autoscaling's maximum, else ``replicas``)."""
        return max(self.replicas, self.max_replicas or 0)

    def check(self, available: int | None = None) -> MemoryPlan:
        """One replica's memory plan, after refusing what cannot run (before any replica starts).

        Args:
            available: bytes the machine can give replicas (default: psutil's available memory).

        Raises:
            InvalidRequestError: replica counts or a dtype out of range; an unknown router; adapters
                with ``weight_dtype`` gguf (packed blocks cannot be merged into).
            AdapterError: an adapter folder that is missing, or holds no adapter_config.json or
                adapter_model.safetensors (the message names the path and the fix).
            ModelNotFoundError: an unknown model (as ``minillm serve``).
            MemoryBudgetError: a budget smaller than one replica's plan, or more replicas than
                ``available`` holds (the message gives the bytes and the most that fit).
        """
        self._check_counts()
        self._check_adapters()
        plan = self.plan()
        most = self.most_replicas
        if available is None:
            import psutil

            available = psutil.virtual_memory().available
        if plan.total * most > available:
            fit = available // plan.total
            raise MemoryBudgetError(
                f"{most} replicas of {self.model} need {format_bytes(plan.total * most)} "
                f"({format_bytes(plan.total)} each) but this machine has {format_bytes(available)} available; "
                f"run at most {fit} replica{'s' * (fit != 1)}, or a smaller weight_dtype or kv_cache_mib"
            )
        return plan

    def _check_counts(self) -> None:
        low, high = self.min_replicas, self.max_replicas
        problems = [
            (self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}"),
            ((low is None) == (high is None), "autoscaling needs both min_replicas and max_replicas"),
            (low is None or high is None or 1 <= low <= self.replicas <= high,
             f"need 1 <= min_replicas ({low}) <= replicas ({self.replicas}) <= max_replicas ({high})"),
            (self.weight_dtype in WEIGHT_DTYPES, f"weight_dtype {self.weight_dtype!r} is not one of {WEIGHT_DTYPES}"),
            (self.router in ROUTERS, f"router {self.router!r} is not one of {ROUTERS}"),
            (self.threads is None or self.threads >= 1, f"threads must be >= 1, got {self.threads}"),
            (self.target_ongoing_requests > 0, "target_ongoing_requests must be > 0"),
        ]  # fmt: skip
        for ok, message in problems:
            if not ok:
                raise InvalidRequestError(f"deploy config: {message}")

    def _check_adapters(self) -> None:
        """Each adapter folder as ``minillm.load`` would first read it (no tensor read: the shapes are
        checked by each replica's load, which then fails and starts no traffic to it), and a
        ``weight_dtype`` they can be merged into (not packed GGUF blocks)."""
        from minillm.model.lora import check_adapter_folder

        if self.adapters and self.weight_dtype == "gguf":  # as loading.check_weight_dtype refuses it
            raise InvalidRequestError(
                "deploy config: adapters cannot be merged into weight_dtype gguf: the weights stay packed GGUF "
                "blocks, and a LoRA delta is merged into float32 rows; use weight_dtype float32, bfloat16 or int8"
            )
        for folder in self.adapters:
            try:
                check_adapter_folder(folder)
            except AdapterError as exc:
                raise AdapterError(f"deploy config: adapters: {exc}") from None

    def plan(self) -> MemoryPlan:
        """One replica's plan from the model's config and tokenizer (no weights read).

        Raises:
            ModelNotFoundError: an unknown model. MemoryBudgetError: over ``memory_budget``.
        """
        from minillm.model.config import ModelConfig
        from minillm.runtime.overhead import measured_overhead
        from minillm.sources.plan_files import plan_folder

        folder = plan_folder(self.model)
        measured = measured_overhead([folder], ("fastapi", "uvicorn", "prometheus_client", "minillm.serve.app"))
        config = ModelConfig.from_folder(folder)
        plan = make_plan(
            config,
            model=self.model,
            weight_dtype=self.weight_dtype if self.weight_dtype != "gguf" else "float32",
            context=self.max_seq_len,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            kv_cache_mib=self.kv_cache_mib,
            tokenizer=measured["tokenizers"][str(folder)],
            runtime=measured["runtime"],
        )
        if self.memory_budget is not None and plan.total > self.memory_budget:
            raise MemoryBudgetError(
                f"one replica of {self.model} ({self.weight_dtype}) needs {format_bytes(plan.total)} "
                f"(weights {format_bytes(plan.weights_total)}, KV pool {format_bytes(plan.kv_pool)}, runtime "
                f"{format_bytes(plan.runtime)}) but memory_budget is {format_bytes(self.memory_budget)}; raise it "
                f"to at least {plan.total / MIB:,.0f} MiB or hold the weights smaller (weight_dtype)"
            )
        return plan

    def replica_settings(self) -> dict:
        """The settings a replica is built from (the scaling and routing ones left out): what the
        deployment binds, so a change of these, and only these, makes Ray replace (roll) the replicas."""
        return {k: v for k, v in asdict(self).items() if k not in SCALING}

    def autoscaling(self) -> dict | None:
        """Ray Serve's ``autoscaling_config`` (None without ``min_replicas``): on ongoing requests per
        replica, metrics every half second over a 2 s window, the delays before scaling up and down."""
        if self.min_replicas is None:
            return None
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2.0,
        }

    def serve_config(self, host: str = "127.0.0.1", port: int = 8000, name: str = "minillm") -> dict:
        """Ray Serve's config file as a dict: one application whose ``args`` are what the replicas are
        built from (and the router), and the replica counts as the deployment's own settings, so a
        change of counts alone scales without replacing a replica (Ray's lightweight update)."""
        auto = self.autoscaling()
        deployment = {"name": DEPLOYMENT, **({"autoscaling_config": auto} if auto else {"num_replicas": self.replicas})}
        args = {**self.replica_settings(), "router": self.router}
        return {
            "http_options": {"host": host, "port": port},
            "applications": [
                {
                    "name": name,
                    "route_prefix": "/",
                    "import_path": IMPORT_PATH,
                    "args": args,
                    "deployments": [deployment],
                }
            ],
        }
