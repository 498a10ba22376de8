"""dniasync.cluster."""
