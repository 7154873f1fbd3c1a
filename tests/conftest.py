"""Shared fixtures: tiny seeded checkpoints written once per session."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from loopserve.models import load_model
from loopserve.models.tiny import make_tiny_checkpoint

# One torch thread: with more, OpenMP workers wait at barriers for a descheduled sibling and the
# suite slows down by an order of magnitude when other processes compete for the cores.
torch.set_num_threads(1)
# Ray workers (engine replicas) at the normal nice level, as `start_embedded_ray` starts them:
# at Ray's default (15) the Ray tests slow down ~9x when other processes load the cores.
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


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
