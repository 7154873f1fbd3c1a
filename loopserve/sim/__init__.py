"""Simulated GPU executor: the real scheduler and KV manager on a virtual clock.

See docs/simulator.md. Entry points: `Simulator` (simulator.py), `SimExecutor` (executor.py),
`CostModel` (cost_model.py), and the `loopserve simulate` CLI (cli.py).
"""
