"""The training loop, the train step and their logging."""
