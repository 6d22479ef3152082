"""Model definitions, configs and weight loading for the engine."""
