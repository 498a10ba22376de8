"""dniasync.remote."""
