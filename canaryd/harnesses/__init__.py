"""Adapters that put canaryd inside the evaluation harnesses people run (Inspect AI)."""
