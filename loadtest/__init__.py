"""Locust load tests and concurrency sweeps (installed as `dflash_sglang.loadtest`)."""
