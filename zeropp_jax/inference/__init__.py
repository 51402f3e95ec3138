"""Generation on a sharded state."""
