"""`make mutants`: mutation testing of the pure modules with mutmut (run.py),
and the reasons kept for the mutants that survive (explained.py)."""
