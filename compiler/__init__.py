"""Compiler stage: IR, frontends, lowering, targets, pipeline driver, artifact."""
