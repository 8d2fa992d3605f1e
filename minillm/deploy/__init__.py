"""``minillm deploy``: the same server as replicas on Ray Serve (the ``deploy`` extra).

    config.py    what a deployment is (model, replicas, threads, budget, keys) and its checks,
                 before any replica starts; the Ray Serve config file ``serve run``/``serve deploy`` read
    replica.py   one replica: one loaded, warmed model behind the same FastAPI app as ``minillm serve``
    app.py       the Ray Serve application built from a config (``import_path: minillm.deploy.app:build``)
    router.py    a prefix-aware ``RequestRouter``: the replica holding most of a prompt's prefix blocks

Ray Serve runs the replicas, its proxy is the one address, its controller scales and rolls them.
"""

from __future__ import annotations

from .config import DeployConfig

__all__ = ["DeployConfig"]
