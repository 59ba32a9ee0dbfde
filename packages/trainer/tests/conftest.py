"""Fixtures of the trainer tests: the ``backend`` parameter of the contract suite.

``backend`` runs every contract test once per registered backend
(``ppo_trainer.available_backends()``); a backend whose optional extra does not import
is skipped. A new backend joins the suite by registering itself, nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ppo_trainer import available_backends, backend_importable

# One intra-op thread: on the small shared CI machine, OpenMP threads contending for two
# busy cores made each tiny-model forward ~30x slower than a single thread.
torch.set_num_threads(1)


def _backend_params() -> list[Any]:
    params = []
    for name in available_backends():
        marks = []
        if not backend_importable(name):
            marks.append(pytest.mark.skip(reason=f"backend {name!r}: its extra is not installed"))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.fixture(params=_backend_params())
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
