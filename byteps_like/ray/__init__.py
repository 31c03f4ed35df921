"""byteps_like on a Ray cluster (docs/deployment.md, "Ray"): a Ray Train backend and an
executor. Needs the ``ray`` extra: ``pip install 'byteps_like[ray]'``.

Ray Train::

    from ray.train import ScalingConfig
    from ray.train.data_parallel_trainer import DataParallelTrainer
    import byteps_like.ray

    trainer = DataParallelTrainer(
        train_loop_per_worker,   # calls byteps_like.torch as under bpslaunch: bps.init() ...
        backend_config=byteps_like.ray.BytePSConfig(num_servers=2,
                                                    server_resources={"CPU": 4}),
        scaling_config=ScalingConfig(num_workers=4))
    trainer.fit()

Outside Ray Train: :class:`RayExecutor` (``start()``, ``run(fn, args=...)``, ``shutdown()``).
The scheduler and the servers are Ray actors; :func:`actor_name` names them.
"""
from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("byteps_like.ray needs Ray: pip install 'byteps_like[ray]' "
                      f"(ray[default,train]); importing it failed: {exc}") from exc

from ._backend import BytePSConfig
from ._executor import RayExecutor
from ._job import actor_name

__all__ = ["BytePSConfig", "RayExecutor", "actor_name"]
