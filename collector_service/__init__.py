"""Collector service: a FastAPI app that writes capture frames to durable, indexed shards."""
