"""Checkpoint converters: bring external model formats into Hugging Face directories."""
