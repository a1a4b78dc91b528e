"""The differential fuzzer: random models qbackend lowers, compared with their reference.
``python -m tests.fuzz --seeds 0:5000`` runs any range and prints a reproducer per failure;
tests/test_fuzz.py runs a fixed slice."""
