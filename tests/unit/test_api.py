"""The framework-neutral numpy API's argument checks (no job needed)."""
from __future__ import annotations

import numpy as np
import pytest

import byteps_like as bps


@pytest.mark.parametrize("call", [bps.push_pull, bps.push_pull_async])
@pytest.mark.parametrize("name", [False, True, 3, b"w"])
def test_push_pull_refuses_a_name_that_is_not_a_str(call, name):
    # BytePS's habit push_pull(tensor, average) would name the tensor False and average it
    with pytest.raises(TypeError, match=r"name must be a str.*push_pull\(array, name=None, "
                                        r"average=True"):
        call(np.ones(3, np.float32), name)
