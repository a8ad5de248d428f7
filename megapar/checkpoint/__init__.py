"""Checkpoints: the sharded format, layout conversion, Hugging Face import/export."""
