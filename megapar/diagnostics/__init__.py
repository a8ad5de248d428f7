"""Diagnostics of a training run: step replay, module tracing, the non-finite search, fault
injection and straggler detection."""
