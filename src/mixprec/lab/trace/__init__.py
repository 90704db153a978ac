"""mixprec trace."""
