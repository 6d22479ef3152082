"""The engine core in its own process, and the API server's end of it (`kvpilot serve`)."""
