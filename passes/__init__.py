"""Passes over the llmc IR and the manager that runs them."""
