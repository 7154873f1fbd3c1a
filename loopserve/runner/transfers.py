"""Host <-> device copies of the runner's step path, in one place, counted.

A looped model runs one core call per loop, so every synchronising copy is paid four times per
token for Ouro. The step path (model runner, graphs, sampler) moves data only through
`Transfers`:

- `to_device(values, dtype)`: host integers (or floats) to the device. On CUDA the values go
  into a pinned host tensor (torch's caching host allocator keeps it alive until the copy
  has run) and are copied with `non_blocking=True`, so the host never waits on the device.
- `to_host(tensor)`: a device tensor to a Python list: the one kind of copy that waits for
  the device. Callers pack what they need (hazards, sampled ids, log-probabilities) into as
  few such copies as the step's decisions allow.

Counts are logical: a copy is counted on CPU too (where it costs nothing), so CPU tests pin
how many copies a core call makes on a GPU. `RunnerOutput` reports them per step and
`EngineStats` in total. tests/test_transfers.py fails if the step path copies any other way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


class Transfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.num_h2d = 0
        self.num_d2h = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self._deferred: list[tuple[torch.Tensor, Callable[[list[float]], None]]] = []

    def to_device(
        self, values: Sequence | np.ndarray, dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """`values` (a list, or a numpy array of `dtype`: a staged buffer the caller no longer
        touches) as a device tensor, in one copy."""
        if self.pinned:
            host = torch.empty(len(values), dtype=dtype, pin_memory=True)
            host.copy_(torch.as_tensor(values, dtype=dtype))
            out = host.to(self.device, non_blocking=True)
        elif isinstance(values, np.ndarray):  # on CPU: the staged buffer itself, no copy
            out = torch.from_numpy(values).to(device=self.device, dtype=dtype)
        else:
            out = torch.tensor(values, dtype=dtype, device=self.device)
        self.num_h2d += 1
        self.h2d_bytes += out.numel() * out.element_size()
        return out

    def to_device_into(self, values: np.ndarray, out: torch.Tensor) -> None:
        """Copy a staged host array into an existing device tensor of its dtype and size (a
        static buffer, e.g. a decode graph's inputs), in one copy."""
        host = torch.from_numpy(values)
        if self.pinned:
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host)
            out.copy_(pinned, non_blocking=True)
        else:
            out.copy_(host)
        self.num_h2d += 1
        self.h2d_bytes += out.numel() * out.element_size()

    def defer(self, tensor: torch.Tensor, receive: Callable[[list[float]], None]) -> None:
        """Read `tensor` (any shape, as float64 values) with the next copy to the host, and
        hand its values to `receive` then: results that are not needed yet ride along with
        the next read that is (`flush` reads them alone)."""
        self._deferred.append((tensor.reshape(-1), receive))

    def to_host(self, tensor: torch.Tensor) -> list:
        """`tensor.tolist()` in one copy, together with every deferred tensor."""
        if not self._deferred:
            self.num_d2h += 1
            self.d2h_bytes += tensor.numel() * tensor.element_size()
            return tensor.tolist()
        deferred, self._deferred = self._deferred, []
        parts = [tensor.reshape(-1).double(), *(part.double() for part, _ in deferred)]
        packed = torch.cat(parts)
        self.num_d2h += 1
        self.d2h_bytes += packed.numel() * packed.element_size()
        values = packed.tolist()
        start = tensor.numel()
        for part, receive in deferred:
            receive(values[start : start + part.numel()])
            start += part.numel()
        return values[: tensor.numel()]

    def discard_deferred(self) -> None:
        """Drop deferred reads left by a step that raised before reading them."""
        self._deferred.clear()

    def flush(self) -> None:
        """Read every deferred tensor now (one copy; none if nothing is deferred)."""
        if len(self._deferred) == 1:  # read as it is: nothing to gather
            part, receive = self._deferred.pop()
            receive(self.to_host(part if part.dtype == torch.float64 else part.double()))
        elif self._deferred:
            self.to_host(torch.empty(0, dtype=torch.float64, device=self.device))

    def counts(self) -> tuple[int, int, int, int]:
        return self.num_h2d, self.num_d2h, self.h2d_bytes, self.d2h_bytes


class Staged:
    """Integer arrays gathered on the host, then sent in one copy (`send`): a call's metadata
    from several places, as device views in the order they were added."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []

    def add(self, values) -> int:
        """Queue `values` (ints); returns its index in what `send` returns."""
        self._parts.append(np.asarray(values, dtype=np.int64).reshape(-1))
        return len(self._parts) - 1

    def send(self, transfers: Transfers) -> list[torch.Tensor]:
        """One copy to the device; the queued arrays as int64 views of it."""
        if not self._parts:
            return []
        staged = transfers.to_device(np.concatenate(self._parts))
        return list(staged.split([len(part) for part in self._parts]))
