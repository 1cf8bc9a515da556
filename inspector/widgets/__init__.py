"""The inspector's widgets, one per file."""
