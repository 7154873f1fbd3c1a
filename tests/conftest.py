"""Shared fixtures: tiny seeded checkpoints written once per session."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from loopserve.models import load_model
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.models.tiny import make_tiny_checkpoint
from tests import triton_interpreter

# One torch thread: with more, OpenMP workers wait at barriers for a descheduled sibling and the
# suite slows down by an order of magnitude when other processes compete for the cores.
torch.set_num_threads(1)
# Ray workers (engine replicas) at the normal nice level, as `start_embedded_ray` starts them:
# at Ray's default (15) the Ray tests slow down ~9x when other processes load the cores.
os.environ.setdefault("RAY_worker_niceness", "0")
# Interpreted Triton kernels (CPU) without the interpreter's per-helper module scans
# (tests/triton_interpreter.py): the same kernels, 25-30% less time per launch.
triton_interpreter.install()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_two_loop_dir(tmp_path_factory):
    """The tiny checkpoint's two layers run two loops a token, not four: for engine tests
    whose kernels run interpreted (each program in Python), at half the launches; layer to
    layer, loop to loop and early exits (at 1 of 2) all still happen."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny2"), seed=0, total_ut_steps=2)


@pytest.fixture(scope="session")
def huginn_small_dir(tmp_path_factory):
    """A tiny Huginn with one prelude, two core and one coda layer, three steps a token (the
    tiny default: 2 + 4 + 2 layers, eight steps), for tests whose kernels run interpreted."""
    layers = dict(n_layers_in_prelude=1, n_layers_in_recurrent_block=2, n_layers_in_coda=1)
    return make_tiny_huginn_checkpoint(
        tmp_path_factory.mktemp("huginn_small"), mean_recurrence=3, **layers
    )


@pytest.fixture(scope="session")
def tiny_tok_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tok"), seed=1, with_tokenizer=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return load_model(tiny_dir, dtype="float32")


@pytest.fixture(scope="module")
def loop():
    """An event loop of its own for a module's async fixtures (Ray pools, servers)."""
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def pd_pools(loop):
    """The prefill/decode serving tests' pools (`tests.pd_pools.PDPools`) on the process's Ray
    cluster; the module ends with every replica shut down."""
    from tests.pd_pools import PDPools
    from tests.ray_utils import start_local_ray, stop_local_ray

    start_local_ray(4)  # logical: a pool's two replicas, and room while a killed one restarts
    holder = PDPools(loop)
    yield holder
    holder.close()
    stop_local_ray()
