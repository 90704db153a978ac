"""Observing numbers and resources while a model trains: memory, NaN/Inf origin, tensor-core fit."""
