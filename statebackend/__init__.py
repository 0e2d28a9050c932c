"""statebackend: durable keyed state for stream processing jobs."""
