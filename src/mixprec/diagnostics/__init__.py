"""Observing numbers and resources while a model trains: memory now; ranges, NaN origin, tensor cores next."""
