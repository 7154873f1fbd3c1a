"""The scheduling layer imports without torch (checked in a subprocess where it cannot)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BLOCK_TORCH = """
import importlib.abc, sys

class BlockTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test: {name}")
        return None

sys.meta_path.insert(0, BlockTorch())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker let torch import")
import loopserve.config, loopserve.contracts, loopserve.errors, loopserve.execution, loopserve.exit
import loopserve.sampling_params, loopserve.engine.stats
import pkgutil
import loopserve.scheduler
for module in pkgutil.iter_modules(loopserve.scheduler.__path__):  # every scheduler room
    __import__(f"loopserve.scheduler.{module.name}")
assert "loopserve.scheduler.admission" in sys.modules
import loopserve.runner.handles
assert "torch" not in sys.modules
print("ok")
"""


def test_scheduling_layer_imports_without_torch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
