"""The outside world: sources that yield messages with positions, and the SQL store."""
