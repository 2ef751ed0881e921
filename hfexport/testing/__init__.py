"""Test support: tiny real-architecture models and their sample inputs, shared by tests and tools."""
