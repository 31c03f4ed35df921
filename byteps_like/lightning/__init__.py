"""byteps_like for PyTorch Lightning 2.x (docs/frameworks/lightning.md).

    import lightning.pytorch as pl
    from byteps_like.lightning import BytePSStrategy

    trainer = pl.Trainer(strategy=BytePSStrategy(), max_epochs=3)
    trainer.fit(model, datamodule)

Run the script under ``bpslaunch`` or torchrun, as any byteps_like script. Importing this
module also registers the name ``"byteps"``: ``pl.Trainer(strategy="byteps")`` is the same.
Needs the ``lightning`` extra: ``pip install 'byteps_like[lightning]'``.
"""
from __future__ import annotations

try:
    import lightning.pytorch as _pl  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("byteps_like.lightning needs Lightning 2.x: pip install "
                      f"'byteps_like[lightning]' (lightning>=2.2); importing it failed: {exc}"
                      ) from exc

from lightning.pytorch.strategies import StrategyRegistry

from .strategy import BytePSStrategy

if BytePSStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(BytePSStrategy.strategy_name, BytePSStrategy,
                              description="byteps_like: gradients averaged through parameter "
                                          "servers (byteps_like.torch.DistributedOptimizer)")

__all__ = ["BytePSStrategy"]
