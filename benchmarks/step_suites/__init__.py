"""The suites of ``benchmarks/step_cost.py``, one module each (``common`` holds what they share)."""
