"""Does NIXL (the transfer library vLLM's disaggregation uses) move bytes on this machine?

A probe for issue #36's transfer-engine transport, not part of loopserve: two NIXL agents in
one process, the UCX backend, a 4 MiB DRAM WRITE with a completion notification. Run it in a
venv of its own, with torch 2.13.0 installed first: `pip install nixl` alone pulls a CUDA
torch build (2.14.1 on 2026-12-03).

    python3 -m venv /tmp/nixl && /tmp/nixl/bin/pip install torch==2.13.0 && \
        /tmp/nixl/bin/pip install nixl && /tmp/nixl/bin/python scripts/nixl_probe.py

On 2026-12-03 on the 2-vCPU development VM (no GPU), with nixl 1.5.1, it printed
`state DONE ...; equal: True` and the notification. mooncake-transfer-engine 0.3.13.post1
installed but failed to import there: `libcudart.so.12: cannot open shared object file`.
"""

import time

import torch
from nixl._api import nixl_agent, nixl_agent_config

# Two agents in one process, DRAM over UCX (loopback), metadata exchanged in-process.
a = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
b = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
src = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
dst = torch.zeros(1 << 20, dtype=torch.float32)
a.register_memory(a.get_reg_descs(dst))
b.register_memory(b.get_reg_descs(src))
b.add_remote_agent(a.get_agent_metadata())
a.add_remote_agent(b.get_agent_metadata())
local = b.get_xfer_descs(src)
remote = a.get_xfer_descs(dst)
handle = b.initialize_xfer("WRITE", local, remote, "target", b"done")
t = time.perf_counter()
state = b.transfer(handle)
while True:
    state = b.check_xfer_state(handle)
    if state in ("DONE", "ERR"):
        break
print(
    "state",
    state,
    "in",
    round((time.perf_counter() - t) * 1e3, 2),
    "ms; equal:",
    torch.equal(src, dst),
)
notifs = a.get_new_notifs()
print("notifs", notifs)
