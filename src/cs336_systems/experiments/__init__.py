"""Experiment entry points: one CLI per deliverable, each writing tidy rows plus provenance."""
