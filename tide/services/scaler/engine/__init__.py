"""The scaler's engine: the rooms ScalerCore (tide/services/scaler/engine/core.py) wires. None
imports gRPC or SQLAlchemy (pyproject's import-linter contract)."""
