"""Tide, one namespace: the control plane (``tide.services``), the trainer side
(``tide.trainer``), the base both stand on (``tide.base``) and the generated API
(``tide.v1``). Nothing is imported here: the trainer image ships without
``tide.services``, and a worker must not pay for what it does not use
(docs/packaging.md)."""
