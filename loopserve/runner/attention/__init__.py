"""Attention backends over paged, per-depth KV planes."""
