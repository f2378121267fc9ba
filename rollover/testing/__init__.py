"""Scaffolding for Rollover's tests and benchmarks, shipped so that benchmarks can start it as
a process (`python -m rollover.testing.stub_upstream`): nothing in the product imports it."""
