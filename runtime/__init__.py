"""Runtime: executes plans, manages the KV cache, schedules and samples."""
