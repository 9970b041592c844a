"""The compile driver: what turns a model source into an artifact by running the layers below it, and
the only part of the compiler that may run the runtime (tuning/: compile-time measurement)."""
