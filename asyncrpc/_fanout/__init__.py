"""Local fan-out: running several members side by side in one process (Fanout)."""
