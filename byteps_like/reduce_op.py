"""The reduction operations of the Horovod-style API: ``op=Average`` or ``op=Sum``.

The servers sum; an average is that sum divided by the number of contributing workers. Those
are the only two reductions byteps_like has. Horovod's others (Adasum, Min, Max, Product) are
refused with a message that names them, never silently summed.

The values are Horovod's (``hvd.Average == 0``, ``hvd.Sum == 1``), so a constant taken from a
Horovod script means the same here. Framework-neutral: every plugin resolves ``op`` with
:func:`resolve_average`.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Any

import numpy as np


class ReduceOp(IntEnum):
    """``Average`` (the default) or ``Sum``; the values are Horovod's."""
    Average = 0
    Sum = 1


Average = ReduceOp.Average
Sum = ReduceOp.Sum


class UnsupportedOp(IntEnum):
    """Horovod's other reductions, with Horovod's values. They exist so that a Horovod script
    (``hvd.Adasum``) gets the ``ValueError`` naming the op where it passes one, not an
    ``AttributeError`` where it names one; no call accepts them."""
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Adasum = UnsupportedOp.Adasum
Min = UnsupportedOp.Min
Max = UnsupportedOp.Max
Product = UnsupportedOp.Product

# Horovod's other reductions, by value: named in the refusal
_UNSUPPORTED = {int(op): op.name for op in UnsupportedOp}


def resolve_average(op: Any, average: Any, what: str) -> bool:
    """Whether ``what`` averages (True) or sums (False), from Horovod's pair of arguments.

    ``op`` supersedes the older ``average``: giving both (not None) is an error, as in Horovod.
    Neither given: average. ``op`` must be :data:`Average` or :data:`Sum` (or their values);
    ``average`` a bool."""
    if op is not None:
        if average is not None:
            raise ValueError(f"{what}: pass op= or average=, not both (op supersedes average, "
                             "as in Horovod)")
        return _is_average(op, what)
    if average is None:
        return True
    if not isinstance(average, (bool, np.bool_)):
        raise TypeError(f"{what}: average must be a bool, got {average!r}")
    return bool(average)


def _is_average(op: Any, what: str) -> bool:
    if isinstance(op, bool) or not isinstance(op, int):
        raise TypeError(f"{what}: op must be Average or Sum (byteps_like.torch.Average, "
                        f"hvd.Average, ...), got {op!r}")
    if op == ReduceOp.Average:
        return True
    if op == ReduceOp.Sum:
        return False
    other = _UNSUPPORTED.get(int(op))
    said = f"op={other}" if other else f"op={op!r}"
    raise ValueError(f"{what}: {said} is not supported: byteps_like reduces with Average or Sum "
                     "only (its servers sum)")
