"""Benchmarks and measurements, each a script run from the repository root (docs/benchmarks.md).

A package only so that the scripts import what they share by one name: ``benchmarks.harness``
(also used by ``checks/gpu_check.py``) and ``benchmarks.measure_memory``."""
