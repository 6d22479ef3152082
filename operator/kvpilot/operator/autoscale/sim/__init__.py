"""Discrete-event fleet simulator that runs the real autoscaling policy."""
