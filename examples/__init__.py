"""Runnable examples built on the library (not part of the installed packages; run them with
``python -m examples.<name>`` from the repository root)."""
