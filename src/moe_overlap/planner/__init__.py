"""Predict overlap on a cluster without running it: the engine's schedules on a simulated clock."""
