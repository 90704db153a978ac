"""mixprec inspect."""
