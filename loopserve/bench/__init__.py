"""Benchmark clients for loopserve: workload sampling and an OpenAI-compatible load generator."""
