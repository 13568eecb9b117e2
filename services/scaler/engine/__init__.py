"""The scaler's engine: the rooms ScalerCore (services/scaler/service.py) wires. None
imports gRPC or SQLAlchemy (pyproject's import-linter contract)."""
