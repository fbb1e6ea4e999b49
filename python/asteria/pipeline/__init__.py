"""The shadow-state pipeline: side streams, host rings, refresh scheduling and installation."""
