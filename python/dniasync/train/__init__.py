"""dniasync.train."""
