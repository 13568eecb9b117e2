"""Support code shared by the test tiers (import it; never import a conftest).

- ``poll``: wait for a condition instead of sleeping (``wait_for`` in threads,
  ``eventually`` on the event loop).
- ``procs``: start a Tide service as a real process and learn its ports from the
  LISTENING line.
"""
