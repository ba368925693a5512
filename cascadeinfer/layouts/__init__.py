"""layouts."""
