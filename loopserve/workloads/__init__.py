"""Workloads for the tools (`bench`, `simulate`): datasets, exit distributions, the arms table,
shared latency measures and argparse types. Product code never imports this package; `sim/`
and `bench/` both import it and never each other."""
