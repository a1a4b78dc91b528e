"""qbackend's version: the one place it is written (pyproject.toml reads it; cached kernel
choices are keyed by it)."""
VERSION = "0.1.0"
