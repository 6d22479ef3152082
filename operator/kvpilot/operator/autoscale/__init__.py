"""Autoscaling of pools: pure policy and GPU budget, metrics scraping, kopf timers, simulator."""
