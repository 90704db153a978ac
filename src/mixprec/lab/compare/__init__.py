"""mixprec compare."""
