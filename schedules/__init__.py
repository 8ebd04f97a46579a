"""The standard library of schedules (`*.pipe`), installed as package data."""
