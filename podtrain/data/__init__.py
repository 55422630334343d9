"""Data: text sources, byte tokens, and the grain pipeline that yields global batches."""
