"""cascade."""
