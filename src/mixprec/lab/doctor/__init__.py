"""mixprec doctor."""
