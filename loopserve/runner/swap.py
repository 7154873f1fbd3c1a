"""Host swap space: whole KV blocks and in-flight hidden states of preempted requests.

The scheduler decides what moves (`KVTransfer`: block id pairs, all planes of a request);
this room only copies. Host blocks live in one tensor shaped like the device cache
`[layers, K/V, host_blocks * block_size, kv_heads, head_dim]` (pinned when the device is
CUDA, so copies can use DMA). Hidden states of the request's paused work (a decode token
between loops, prompt chunks between depths) move with it, under the same handles, so the
request resumes exactly where it stopped. Transfers run in the order given, before the
step's core calls: a device block freed by a swap-out may be reused by a later transfer or
by this step's rows.
"""

from __future__ import annotations

import torch

from loopserve.contracts import KVTransfer, SwapKind


class SwapSpace:
    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device_cache = kv_cache
        shape = (*kv_cache.shape[:2], num_host_blocks * block_size, *kv_cache.shape[3:])
        pin = kv_cache.device.type == "cuda"
        # Allocated on first use: most engines never swap.
        self._shape, self._pin = shape, pin
        self._host: torch.Tensor | None = None
        self.num_bytes_out = 0
        self.num_bytes_in = 0

    @property
    def host_cache(self) -> torch.Tensor:
        if self._host is None:
            self._host = torch.empty(
                self._shape, dtype=self.device_cache.dtype, pin_memory=self._pin
            )
        return self._host

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        # [layers, K/V, blocks, block_size, kv_heads, head_dim]
        return cache.view(*cache.shape[:2], -1, self.block_size, *cache.shape[3:])

    def copy(self, transfer: KVTransfer) -> None:
        if not transfer.block_moves:
            return
        src_ids, dst_ids = zip(*transfer.block_moves)
        if transfer.kind is SwapKind.OUT:
            src, dst = self.device_cache, self.host_cache
        else:
            src, dst = self.host_cache, self.device_cache
        src_index = torch.tensor(src_ids, dtype=torch.int64, device=src.device)
        dst_index = torch.tensor(dst_ids, dtype=torch.int64, device=dst.device)
        moved = self._blocks(src)[:, :, src_index].to(dst.device)
        self._blocks(dst)[:, :, dst_index] = moved
        if transfer.kind is SwapKind.OUT:
            self.num_bytes_out += moved.numel() * moved.element_size()
        else:
            self.num_bytes_in += moved.numel() * moved.element_size()
