"""Tools for tests and benches of the trainer side (fault injection around the real client)."""
