"""keygate."""
