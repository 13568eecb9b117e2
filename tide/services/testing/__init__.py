"""Test doubles with real semantics, kept out of the production modules.

Like ``kopf.testing`` or ``temporalio.testing``: tests, benchmarks and the
explicitly test-only entry points (``python -m tide.services.testing.<name>``) import
from here; no production module does, and import-linter enforces it
(pyproject.toml, ``[tool.importlinter]``). Each double implements the same
interface as its real counterpart and is run through the same contract tests.
"""
